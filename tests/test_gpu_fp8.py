"""FP8 UNet kernels inside the CUDA graphs (skipped without CUDA or without FP8 tensor cores), on sdxl-random at
1024x1024 fp16: the FP8 artifact from $BCG_CACHE (built first when missing: minutes on an H200), the ControlNet's
fp16 one beside it. Every replay is checked against the UNCOMPILED fp16 eager step at FP8's own limit; a LoRA swap
reaches the FP8 weights with no new capture and no pointer changed."""

import pytest
import torch

from storyboard_cli.engine import compiled as C
from storyboard_cli.engine import fp8 as F
from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.eager import EagerEngine, StepCalls
from test_gpu import _close, _inputs
from test_gpu_compiled import _unguided, lora_swap_reaches_the_graph

pytestmark = pytest.mark.gpu
SIDE = 1024
# over 4 steps at guidance 1 the FP8 loop against the fp16 eager loop (the quantisation's 3.4e-2 per prediction,
# diluted by the latents the sampler carries)
RTOL = 0.1


@pytest.fixture(scope="module")
def setup():
    from storyboard_cli.engine.build import graph_runner
    from storyboard_cli.models.loader import load_sdxl

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or later")
    models = load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)
    shapes = [Shape(b, SIDE, SIDE, c) for b in (1, 2) for c in (False, True)]
    notes = []
    runner = graph_runner(models, shapes, compile="on", notes=notes, fp8=True)
    assert all(runner.compiled.ready(*s) is None for s in shapes), notes
    return models, runner, EagerEngine(models)


@pytest.mark.parametrize("batch,control", [(1, False), (2, False), (2, True)])
def test_fp8_replay_is_checked_against_the_uncompiled_eager_step(setup, batch, control):
    models, runner, eager = setup
    args = _unguided(_inputs(models, batch, SIDE, SIDE, control, "euler", steps=4))
    got = runner.sample(*args)
    key = runner.shape_key(batch, SIDE, SIDE, control)
    stats = runner.stats[key]
    assert key.variant == "fp8" and stats.state == "graph" and stats.checked, stats.reason
    _close(got, eager.sample(*args), RTOL)


@pytest.mark.parametrize("timestep", [999.0, 500.0, 50.0])
def test_fp8_module_call_against_the_eager_unet(setup, timestep):
    """The FP8 UNet's noise prediction against the fp16 eager UNet's on unit-scale inputs: the quantisation's error
    (3.4e-2 scouted), above compiled fp16's (1.6e-3) and inside the first-replay check's limit."""
    models, runner, _ = setup
    g = torch.Generator().manual_seed(1)
    rows, h = 4, SIDE // 8
    text_dim, pooled_dim = C.text_dims(models.unet)
    new = lambda *shape: torch.randn(*shape, generator=g).to(models.device, models.dtype)  # noqa: E731
    latents, embeds, pooled = new(rows, 4, h, h), new(rows, 77, text_dim), new(rows, pooled_dim)
    time_ids = torch.tensor([SIDE, SIDE, 0, 0, SIDE, SIDE], device=models.device, dtype=models.dtype).expand(rows, 6)
    t = torch.full((rows,), timestep, device=models.device)
    with torch.no_grad():
        got = runner.compiled.unet(latents, t, embeds, pooled, time_ids.clone(), None, None).float()
        want = StepCalls.eager(models).unet(latents, t, embeds, pooled, time_ids.clone(), None, None).float()
    err = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
    assert 2e-3 < err < F.CHECK_RTOL, err


def test_a_lora_swap_reaches_the_fp8_graph(setup, tmp_path):
    """The FP8 weights and their scales are re-quantised in place: the same pointers, the same graph."""
    lora_swap_reaches_the_graph(setup, tmp_path, RTOL, "fp8")
