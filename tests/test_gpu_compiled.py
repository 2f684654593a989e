"""Compiled kernels inside the CUDA graphs (skipped without CUDA). Tiny preset, fp16: one UNet and one
ControlNet artifact are built for the session (child processes, as `bcg capture --warm` does), then
every replay of a compiled graph is checked against the UNCOMPILED eager step."""

import pytest
import torch

from storyboard_cli.engine import compiled as C
from storyboard_cli.engine.eager import EagerEngine
from test_compiled import loads_in_a_new_process
from test_gpu import _close, _inputs

pytestmark = pytest.mark.gpu
SIZE = (256, 192)  # inside the compiled ranges (multiples of 64)
RTOL = 2e-2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from storyboard_cli.engine.graphs import GraphRunner
    from storyboard_cli.models.loader import load_sdxl

    root = tmp_path_factory.mktemp("compiled")
    models = load_sdxl("tiny", "tiny", "cuda", torch.float16)
    assert C.build_missing(models, "tiny", "tiny", root=root) == []
    calls, notes = C.load_calls(models, root)
    assert calls is not None, notes
    runner = GraphRunner(models, max_batch=8, max_hw=SIZE, compiled=calls)
    return models, runner, EagerEngine(models), root


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("control", [False, True])
def test_compiled_replay_matches_the_uncompiled_eager_step(setup, batch, control):
    models, runner, eager, _ = setup
    w, h = SIZE
    args = _inputs(models, batch, w, h, control, "euler_a")
    got = runner.sample(*args)
    key = runner.shape_key(batch, h, w, control)
    assert key.variant == "compiled" and runner.stats[key].state == "graph" and runner.stats[key].checked
    _close(got, eager.sample(*args), RTOL)


def test_shapes_outside_the_ranges_run_the_plain_graph(setup):
    models, runner, eager, _ = setup
    args = _inputs(models, 1, 72, 72, False, "euler")  # not a multiple of 64
    got = runner.sample(*args)
    assert runner.shape_key(1, 72, 72, False).variant == "plain"
    _close(got, eager.sample(*args), RTOL)


def test_an_in_place_weight_update_reaches_the_compiled_graph(setup):
    models, runner, eager, _ = setup
    w, h = SIZE
    args = _inputs(models, 2, w, h, True, "euler", seed=9)
    before = runner.sample(*args)
    weight = models.unet.conv_out.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        after = runner.sample(*args)  # no new capture, no reload
        _close(after, eager.sample(*args), RTOL)
        assert not torch.allclose(before, after)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_a_check_failure_falls_back_to_the_plain_graph(setup, monkeypatch):
    from storyboard_cli.engine import graphs

    models, runner, eager, _ = setup
    monkeypatch.setattr(graphs, "CHECK_RTOL", -1.0)  # every check fails
    args = _inputs(models, 4, 128, 128, False, "euler")
    got = runner.sample(*args)
    key = graphs.ShapeKey(4, 128, 128, False, "float16", "compiled")
    assert runner.stats[key].state == "plain" and "relative error" in runner.stats[key].reason
    assert runner.shape_key(4, 128, 128, False).variant == "plain"
    _close(got, eager.sample(*args), RTOL)


def test_a_corrupt_artifact_falls_back(setup, tmp_path):
    models, _, _, root = setup
    good = C.artifact_path("unet", models.unet, root)
    bad = C.artifact_path("unet", models.unet, tmp_path)
    bad.write_bytes(good.read_bytes()[:4096])
    calls, notes = C.load_calls(models, tmp_path)
    assert calls is None and "not used" in notes[0]


def test_a_second_process_loads_from_the_cache(setup):
    _, _, _, root = setup
    assert loads_in_a_new_process(root, "cuda", "float16", "tiny") == "loaded"
