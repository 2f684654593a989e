"""Compiled kernels inside the CUDA graphs (skipped without CUDA), on sdxl-random at 1024x1024 fp16, a size
the bench job uses: the kernels come from $BCG_CACHE (built side by side first when missing: minutes on an
H200), and every compiled replay is checked against the UNCOMPILED eager step. A LoRA swap reaches the
compiled graphs with no new capture and no pointer changed."""

import pytest
import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.kernels.export import text_dims
from test_compiled import loads_in_a_new_process
from test_gpu import _close, _inputs

pytestmark = pytest.mark.gpu
SIDE = 1024
# the runner's own first-replay check (one step, its variant's check_rtol) and the module calls below are the close
# comparisons; over a few steps a random-weight network in fp16 grows the kernels' rounding difference, and
# guidance would multiply it: the loops run at guidance 1
RTOL = 0.05
# the compiled UNet's noise prediction against the eager module's, same inputs: 1.6e-3 measured (fp16, H200); an
# artifact that read its float32 timestep as fp16 was 1.2e-1 to 1.6e-1 off
EPS_RTOL = 1e-2


def _derived_pointers(models) -> list[int]:
    out = []
    for value, _ in models.derived.values():
        out += [t.data_ptr() for t in (value if isinstance(value, tuple) else (value,))]
    return out


def _unguided(args):
    x, sched, noise, cond, ctl, guidance = args
    return x, sched, noise, cond, ctl, torch.ones_like(guidance)


def compiled_setup(fp8: bool = False):
    """sdxl-random at 1024x1024 fp16, a runner whose compiled kernels (FP8 ones with `fp8`) cover 1 and 2 images with
    and without ControlNet (built first when the cache lacks them), and the eager engine."""
    from storyboard_cli.engine.build import graph_runner
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)
    shapes = [Shape(b, SIDE, SIDE, c) for b in (1, 2) for c in (False, True)]
    notes = []
    runner = graph_runner(models, shapes, compile="on", notes=notes, fp8=fp8)
    assert all(runner.compiled.ready(*s) is None for s in shapes), notes
    return models, runner, EagerEngine(models)


def replay_is_checked(setup, batch: int, control: bool, variant: str, rtol: float, sampler: str) -> None:
    """A 4-step loop at guidance 1 on `variant`'s graph, checked on its first replay, against the uncompiled eager
    loop."""
    models, runner, eager = setup
    args = _unguided(_inputs(models, batch, SIDE, SIDE, control, sampler, steps=4))
    got = runner.sample(*args)
    key = runner.shape_key(batch, SIDE, SIDE, control)
    stats = runner.stats[key]
    assert key.variant == variant and stats.state == "graph" and stats.checked, stats.reason
    _close(got, eager.sample(*args), rtol)


def unit_eps(models, calls, timestep: float, control: bool, seed: int) -> torch.Tensor:
    """The UNet's noise prediction through `calls` (the ControlNet's residuals first, with `control`) on unit-scale
    inputs: random latents and text embeddings (as the step's c_in scales latents), 4 rows, float32."""
    g = torch.Generator().manual_seed(seed)
    rows, h = 4, SIDE // 8
    text_dim, pooled_dim = text_dims(models.unet)
    new = lambda *shape: torch.randn(*shape, generator=g).to(models.device, models.dtype)  # noqa: E731
    latents, embeds, pooled = new(rows, 4, h, h), new(rows, 77, text_dim), new(rows, pooled_dim)
    time_ids = torch.tensor([SIDE, SIDE, 0, 0, SIDE, SIDE], device=models.device, dtype=models.dtype).expand(rows, 6)
    image = torch.rand(rows, 3, SIDE, SIDE, generator=g).to(models.device, models.dtype) if control else None
    scale = torch.full((rows, 1, 1, 1), 0.8, device=models.device, dtype=models.dtype)
    t = torch.full((rows,), timestep, device=models.device)  # float32, as the step passes it
    mid = down = None
    with torch.no_grad():
        if image is not None:
            mid, *down = calls.controlnet(latents, t, embeds, pooled, time_ids.clone(), image, scale)
        return calls.unet(latents, t, embeds, pooled, time_ids.clone(), mid, down).float()


@pytest.fixture(scope="module")
def setup():
    return compiled_setup()


@pytest.mark.parametrize("batch,control", [(1, False), (2, False), (2, True)])
def test_compiled_replay_matches_the_uncompiled_eager_step(setup, batch, control):
    replay_is_checked(setup, batch, control, "compiled", RTOL, "euler_a")


def lora_swap_reaches_the_graph(setup, tmp_path, rtol: float, variant: str = "compiled") -> None:
    """A LoRA swap reaches the compiled graph of 2 x 1024x1024 + ControlNet: no new capture, no pointer changed (the
    weights, and what is derived from them: channels_last copies, FP8 weights and scales), equal to the eager step
    within `rtol`; the empty set restores it."""
    from storyboard_cli.models.lora import LoraApplier, read_lora
    from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya

    models, runner, eager = setup
    factors = {k: (d.half(), u.half()) for k, (d, u) in random_factors(models, 3, 8, relative=0.1).items()}
    path = save_kohya(tmp_path / "a.safetensors", factors, models.unet.config.layers_per_block, alpha=8.0)
    lora = read_lora("a", path, models.unet.config)
    applier = LoraApplier(models)
    applier.register(lora)
    pointers = [p.data_ptr() for p in models.unet.parameters()] + _derived_pointers(models)
    args = _unguided(_inputs(models, 2, SIDE, SIDE, True, "euler", steps=4, seed=5))
    before = runner.sample(*args)
    key = runner.shape_key(2, SIDE, SIDE, True)
    assert key.variant == variant
    captured, graphs = runner.stats[key].capture_s, len(runner.graphs)
    applier.apply({"a": (lora, 0.9)})
    try:
        after = runner.sample(*args)
        assert runner.stats[key].capture_s == captured and len(runner.graphs) == graphs  # no new capture
        _close(after, eager.sample(*args), rtol)
        assert not torch.allclose(after, before)
    finally:
        applier.restore()
    assert [p.data_ptr() for p in models.unet.parameters()] + _derived_pointers(models) == pointers
    _close(runner.sample(*args), before, 1e-3)


def test_a_lora_swap_reaches_the_compiled_graph(setup, tmp_path):
    lora_swap_reaches_the_graph(setup, tmp_path, RTOL)


def test_a_check_failure_falls_back_to_the_plain_graph(setup, monkeypatch):
    """The compiled graph fails its check (and was the runner's only graph, so its pool went with it): the shape runs
    its PLAIN graph, captured into a new pool and checked, not eager (capturing into the dead pool's handle tripped an
    allocator assert, and that failed capture left the default CUDA generator in capture mode)."""
    from dataclasses import replace

    from storyboard_cli.engine.graph.keys import ShapeKey
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.variants import VARIANTS

    models, runner, eager = setup
    fresh = GraphRunner(models, max_batch=1, max_hw=(SIDE, SIDE), compiled=runner.compiled)
    monkeypatch.setitem(VARIANTS, "compiled", replace(VARIANTS["compiled"], check_rtol=-1.0))
    args = _unguided(_inputs(models, 1, SIDE, SIDE, False, "euler", steps=3))
    got = fresh.sample(*args)
    key = ShapeKey(1, SIDE, SIDE, False, "float16", "compiled")
    assert fresh.stats[key].state == "plain" and "relative error" in fresh.stats[key].reason
    plain = fresh.shape_key(1, SIDE, SIDE, False)
    assert plain.variant == "plain" and fresh.stats[plain].state == "graph" and fresh.stats[plain].checked, \
        fresh.stats[plain].reason
    _close(got, eager.sample(*args), RTOL)
    torch.empty(4, device=models.device).uniform_()  # CUDA random ops still work outside a capture


def test_a_second_process_loads_from_the_cache(setup):
    from storyboard_cli.models.tiny import cache_root

    assert loads_in_a_new_process(cache_root() / "compiled", "cuda", "float16", "sdxl-random", SIDE,
                                  model="sdxl-random") == "loaded"


@pytest.mark.parametrize("timestep", [999.0, 500.0, 50.0])
@pytest.mark.parametrize("control", [False, True])
def test_compiled_module_calls_match_the_eager_modules(setup, timestep, control):
    """The compiled UNet (and ControlNet) calls against the eager modules on the same unit-scale inputs, at three
    timesteps: the prediction itself, not a step's result, which a wrong prediction moves by a fraction of its error."""
    from storyboard_cli.engine.eager import StepCalls

    models, runner, _ = setup
    _close(unit_eps(models, runner.compiled, timestep, control, 0),
           unit_eps(models, StepCalls.eager(models), timestep, control, 0), EPS_RTOL)
