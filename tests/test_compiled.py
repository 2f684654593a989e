"""Compiled denoiser artifacts on the CPU (AOTInductor builds CPU code too): the child-process build,
the cache key, loading with the eager modules' own weights, the zero residuals, fallbacks.

One tiny UNet artifact is built per session (about a minute on two cores); the GPU side (compiled
kernels inside CUDA graphs) is tests/test_gpu_compiled.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from storyboard_cli.engine import compiled as C
from storyboard_cli.engine.eager import StepCalls
from storyboard_cli.models.loader import load_sdxl

pytestmark = pytest.mark.slow


STATIC_CXX = """#!/bin/sh
# g++ that puts a static copy of libstdc++ into every shared library it makes, as the H200 image's does
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; *) exec g++ "$@" ;; esac
"""


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """A tiny UNet artifact built the way `bcg capture --warm` builds one: a child process per module,
    with a compiler that links libstdc++ statically. A library with its own copy of libstdc++ crashed
    at load on the GPU image (AOTInductor's loader parses the device string with std::regex, which
    reads the copy's never-initialised locale); bcg's link options must keep it loadable."""
    root = tmp_path_factory.mktemp("compiled")
    cxx = root / "g++"
    cxx.write_text(STATIC_CXX)
    cxx.chmod(0o755)
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    events = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", str(cxx))  # the build children inherit it
        notes = C.build_missing(models, "tiny", None, events.append, root)
    assert notes == []
    assert [e.state for e in events][-1] == "done" and {e.module for e in events} == {"unet"}
    return root


@pytest.fixture(scope="module")
def models_cn():
    return load_sdxl("tiny", "tiny", "cpu", torch.float32)


def _inputs(models, rows, h, w, control):
    unet = models.unet
    args = C.example_inputs("unet", unet, rows, h, w, models.dtype, models.device, unet.config.cross_attention_dim,
                            models.text_encoders[1].config.projection_dim)
    latents, t, embeds, pooled, time_ids = args[:5]
    t = t.expand(rows)  # as the step passes it
    image = scale = None
    if control:
        g = torch.Generator().manual_seed(1)
        image = torch.rand(rows, 3, 8 * h, 8 * w, generator=g)
        scale = torch.full((rows, 1, 1, 1), 0.7)
    return latents, t, embeds, pooled, time_ids, image, scale


def _run(calls: StepCalls, latents, t, embeds, pooled, time_ids, image, scale):
    mid = down = None
    if image is not None:
        mid, *down = calls.controlnet(latents, t, embeds, pooled, time_ids, image, scale)
    return calls.unet(latents, t, embeds, pooled, time_ids, mid, down)


def _rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


@pytest.mark.parametrize("rows,h,w,control", [(2, 16, 16, False), (8, 16, 24, False), (4, 24, 16, True)])
def test_compiled_calls_match_the_modules_at_any_shape_in_range(artifacts, models_cn, rows, h, w, control):
    calls, notes = C.load_calls(models_cn, artifacts)
    assert calls is not None, notes
    calls.reserve(rows // 2, 64 * h * w)
    inputs = _inputs(models_cn, rows, h, w, control)
    with torch.no_grad():
        got, expect = _run(calls, *inputs), _run(StepCalls.eager(models_cn), *inputs)
    assert got.shape == expect.shape
    assert _rel(got, expect) < 1e-4


def test_an_in_place_weight_update_is_seen_by_the_compiled_kernels(artifacts):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    calls, _ = C.load_calls(models, artifacts)
    calls.reserve(1, 64 * 16 * 16)
    inputs = _inputs(models, 2, 16, 16, False)
    with torch.no_grad():
        before = _run(calls, *inputs)
        ptr = models.unet.conv_out.weight.data_ptr()
        models.unet.conv_out.weight.mul_(3.0)  # in place, as LoRA swaps weights
        models.unet.conv_out.bias.add_(0.5)  # 4 values: compiled code must not have inlined them
        after, expect = _run(calls, *inputs), _run(StepCalls.eager(models), *inputs)
    assert models.unet.conv_out.weight.data_ptr() == ptr
    assert _rel(after, before) > 0.1
    assert _rel(after, expect) < 1e-4


def test_shapes_outside_the_compiled_ranges_are_named():
    assert C.fits(8, 1024, 1024) is None
    assert C.fits(1, 832, 1216) is None
    assert "exceed" in C.fits(16, 1024, 1024)
    assert "outside" in C.fits(1, 1000, 1000)
    assert "outside" in C.fits(1, 4096, 1024)


def test_the_key_follows_what_changes_the_code(models_cn):
    unet = models_cn.unet
    key = C.artifact_key("unet", unet)
    assert key == C.artifact_key("unet", unet)
    assert key != C.artifact_key("controlnet", unet)
    half = load_sdxl("tiny", None, "cpu", torch.bfloat16).unet
    assert C.artifact_key("unet", half) != key


def test_a_corrupt_artifact_is_reported_and_never_crashes(tmp_path, artifacts):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    good = C.artifact_path("unet", models.unet, artifacts)
    bad = C.artifact_path("unet", models.unet, tmp_path)
    bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 3])  # a truncated copy
    calls, notes = C.load_calls(models, tmp_path)
    assert calls is None and "compiled kernels not used" in notes[0]
    assert bad.with_suffix(".bad").is_file()  # the next render does not try it again
    assert C.load_calls(models, tmp_path)[0] is None
    assert C.missing(models, tmp_path) == ["unet"] and not bad.exists()  # capture rebuilds it


def test_no_artifact_means_plain_with_a_reason(tmp_path):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    calls, notes = C.load_calls(models, tmp_path)
    assert calls is None and "no compiled kernels" in notes[0]


def loads_in_a_new_process(root, device: str, dtype: str, controlnet: str | None) -> str:
    """What a second process gets from the cache folder `root`: 'loaded', or the notes."""
    code = ("import sys, torch; from pathlib import Path; from storyboard_cli.engine import compiled as C;"
            "from storyboard_cli.models.loader import load_sdxl;"
            f"m = load_sdxl('tiny', {controlnet!r}, {device!r}, torch.{dtype});"
            "c, n = C.load_calls(m, Path(sys.argv[1]));"
            "print('loaded' if c is not None and (m.controlnet is None or c._compiled_cn) else n)")
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]


def test_a_second_process_loads_from_the_cache(artifacts):
    assert loads_in_a_new_process(artifacts, "cpu", "float32", None) == "loaded"
