"""What the GPU tests share (tests/test_gpu*.py): a sampling loop's inputs with per-row guidance and ControlNet scale,
the relative-error assertion, and the compiled-kernel runner on sdxl-random at 1024x1024 with the checks that the
fp16 and FP8 variants both pass."""

from dataclasses import replace

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.conditions.control import embed_guide
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.kernels.export import text_dims
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.run.capture import synthetic_inputs

from helpers.reference import rel_error

def loop_inputs(models, batch, w, h, control, sampler="euler_a", steps=6, seed=0):
    sched = schedule(sampler, steps, models.scheduler_config)
    x, cond, conds, guidance = synthetic_inputs(models, batch, w, h, control)
    x0, noise = draw_noise([seed + i for i in range(batch)], steps, (4, h // 8, w // 8), sched)
    guidance = torch.linspace(3.0, 8.0, batch, device=models.device)  # per-row guidance
    ctl = conds.get("control")
    if ctl is not None:
        scale = torch.linspace(0.3, 1.2, batch, device=models.device, dtype=models.dtype).repeat(2)
        scaled = replace(ctl, scale=scale.view(1, -1, 1, 1, 1).repeat(len(ctl.nets), 1, 1, 1, 1))  # [nets, 2B, 1, 1, 1]
        conds = Conditions.of(scaled, *(c for c in conds if c is not ctl))
    noise = None if noise is None else noise.to(models.device)
    return x0.to(models.device), sched, noise, cond, conds, guidance



def assert_rel_close(a, b, rtol):
    err = rel_error(a, b)
    assert err < rtol, f"relative error {err:.2e}"



SIDE = 1024



def derived_pointers(models) -> list[int]:
    out = []
    for value, _ in models.derived.values():
        out += [t.data_ptr() for t in (value if isinstance(value, tuple) else (value,))]
    return out



def unguided(args):
    x, sched, noise, cond, ctl, guidance = args
    return x, sched, noise, cond, ctl, torch.ones_like(guidance)



def compiled_setup(kernels: str = "compiled"):
    """sdxl-random at 1024x1024 fp16, a runner whose compiled kernels (`kernels`' row: FP8 ones with "fp8") cover 1 and
    2 images with and without ControlNet (built first when the cache lacks them), and the eager engine."""
    from storyboard_cli.engine.build import graph_runner
    from storyboard_cli.models.loader import load_sdxl

    models = load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)
    shapes = [Shape(b, SIDE, SIDE, c) for b in (1, 2) for c in (False, True)]
    notes = []
    runner = graph_runner(models, shapes, compile="on", notes=notes, kernels=kernels)
    k = runner.compiled  # in the cache, each loaded before its graph's first capture (as a render does)
    assert not k.waiting and all(t in k.calls or t in k.deferred() for t in k.targets(shapes)), notes
    return models, runner, EagerEngine(models)



def replay_is_checked(setup, batch: int, control: bool, variant: str, rtol: float, sampler: str) -> None:
    """A 4-step loop at guidance 1 on `variant`'s graph, checked on its first replay, against the uncompiled eager
    loop."""
    models, runner, eager = setup
    args = unguided(loop_inputs(models, batch, SIDE, SIDE, control, sampler, steps=4))
    got = runner.sample(*args)
    key = runner.shape_key(batch, SIDE, SIDE, control)
    stats = runner.stats[key]
    assert key.variant == variant and stats.state == "graph" and stats.checked, stats.reason
    assert_rel_close(got, eager.sample(*args), rtol)



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
    guide = None if image is None else embed_guide(models.controlnets[0], image)  # as the step hands it over
    scale = torch.full((rows, 1, 1, 1), 0.8, device=models.device, dtype=models.dtype)
    t = torch.full((rows,), timestep, device=models.device)  # float32, as the step passes it
    mid = down = None
    with torch.no_grad():
        if guide is not None:
            mid, *down = calls.controlnet(latents, t, embeds, pooled, time_ids.clone(), guide, scale)
        return calls.unet(latents, t, embeds, pooled, time_ids.clone(), mid, down).float()



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
    pointers = [p.data_ptr() for p in models.unet.parameters()] + derived_pointers(models)
    args = unguided(loop_inputs(models, 2, SIDE, SIDE, True, "euler", steps=4, seed=5))
    before = runner.sample(*args)
    key = runner.shape_key(2, SIDE, SIDE, True)
    assert key.variant == variant
    captured, graphs = runner.stats[key].capture_s, len(runner.graphs)
    applier.apply({"a": (lora, 0.9)})
    try:
        after = runner.sample(*args)
        assert runner.stats[key].capture_s == captured and len(runner.graphs) == graphs  # no new capture
        assert_rel_close(after, eager.sample(*args), rtol)
        assert not torch.allclose(after, before)
    finally:
        applier.restore()
    assert [p.data_ptr() for p in models.unet.parameters()] + derived_pointers(models) == pointers
    assert_rel_close(runner.sample(*args), before, 1e-3)



def timed_decode(models, latents, reps=3):
    """(seconds per `run/batch.py decode` of `latents`, after one warm-up, the last decode's uint8 pixels on the CPU):
    the decoder GPU tests' timing (the copy to the CPU ends each decode, so no sync is needed but the first)."""
    import time

    from storyboard_cli.run.batch import decode

    decode(models, latents)
    torch.cuda.synchronize()
    start = time.perf_counter()
    pixels = [decode(models, latents) for _ in range(reps)][-1]
    return (time.perf_counter() - start) / reps, pixels
