"""`bcg bench`'s step microbenchmarks: the matmul rate, a step's FLOPs, eager against graph ms per step by batch
size, and the top kernels of one step, plain against compiled."""

from __future__ import annotations

import json
import time
from typing import Callable

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import compiled_kernels, graph_runner
from storyboard_cli.engine.eager import StepCalls, denoise
from storyboard_cli.engine.kernels.artifacts import targets
from storyboard_cli.engine.variants import AUTO
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.capture import synthetic_inputs, time_shapes


# ---------------------------------------------------------------- microbenchmarks


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) / 1000) / 1e12


def launch_us(device: torch.device, n: int = 2000) -> float:
    """The host's microseconds per small op (an in-place add to 64 numbers; on CUDA, its launch), the median of three
    runs of `n`. The plain loop's steps at one or two images are thousands of such launches, bound by the host: its
    wall moves with this figure from one machine to the next, where bcg's graphs replay without them."""
    x = torch.zeros(64, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        runs.append((time.perf_counter() - t) / n * 1e6)
    sync()
    return sorted(runs)[1]


def step_flops(models: SdxlModels, batch: int, width: int, height: int, control: bool) -> float:
    """FLOPs of one CFG-batched denoising step (ControlNet + UNet), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    x, cond, conds, guidance = synthetic_inputs(models, batch, width, height, control)
    one = torch.ones((), device=models.device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        denoise(models, x, one, one * 500, cond, conds.at(0), guidance)
    return float(counter.get_total_flops())


def step_curve(models: SdxlModels, batches: tuple[int, ...], width: int, height: int, control: bool,
               matmul_rate: float, log: Callable[[str], None], compile: str = "off", eager: bool = True,
               kernels: str = AUTO) -> list[dict]:
    """Eager vs graph ms/step per batch size, FLOPs per step and the share of the matmul rate reached
    (compile "on": the graphs run the compiled kernels, built first if the cache lacks them, on `kernels`' row:
    "fp8", the UNet's FP8 ones)."""
    shapes = [Shape(b, height, width, control) for b in batches]
    rows = []
    runner = graph_runner(models, shapes, compile, kernels=kernels)
    for t in sorted(time_shapes(models, runner, shapes, steps=10, repeats=3, eager=eager), key=lambda t: t.shape):
        b = int(t.shape.split("x")[0])
        flops = step_flops(models, b, width, height, control)
        row = {"shape": t.shape, "state": t.state, "reason": t.reason, "batch": b, "eager_ms": t.eager_ms,
               "graph_ms": t.graph_ms,
               "speedup": t.speedup, "graph_ms_per_image": t.graph_ms / b if t.graph_ms else None,
               "tflop_per_step": flops / 1e12, "capture_s": t.capture_s, "pool_mb": t.pool_mb,
               "matmul_share": (flops / (t.graph_ms / 1000) / 1e12 / matmul_rate) if t.graph_ms else None}
        rows.append(row)
        log(json.dumps(row))
    return sorted(rows, key=lambda r: r["batch"])


# ---------------------------------------------------------------- compiled kernels


def top_kernels(fn: Callable[[], object], n: int = 3, k: int = 15) -> list[dict]:
    """The `k` GPU kernels that take the most time in `fn`, per call (torch.profiler, after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 1000 / n
    return [{"kernel": "all kernels", "ms_per_step": round(total, 2), "calls": sum(e.count for e in events) // n}] + \
        [{"kernel": e.key[:100], "ms_per_step": round(e.device_time_total / 1000 / n, 3), "calls": e.count // n}
         for e in events[:k]]


def kernel_profile(models: SdxlModels, log: Callable[[str], None], batch: int = 8, side: int = 1024) -> dict:
    """Top kernels of one denoising step (CFG batched), plain modules against the compiled kernels from the
    cache, outside any graph (a graph replay hides its kernels from the profiler)."""
    shape = Shape(batch, side, side, False)
    notes: list[str] = []
    kernels = compiled_kernels(models, [shape], "auto", notes)
    kernels.want(targets([shape], False))
    why = kernels.ready(*shape)
    if why:
        raise RuntimeError(f"no compiled kernels to profile: {why} {notes}")
    kernels.reserve(batch, side * side)
    x, cond, conds, guidance = synthetic_inputs(models, batch, side, side, False)
    sigma, t = torch.tensor(10.0, device=models.device), torch.tensor(500.0, device=models.device)
    rel = lambda a, b: (torch.linalg.vector_norm((a - b).float()) / torch.linalg.vector_norm(b.float())).item()  # noqa: E731
    with torch.no_grad():
        rec = {"shape": shape.label,
               "plain": top_kernels(lambda: denoise(models, x, sigma, t, cond, conds, guidance)),
               "compiled": top_kernels(lambda: denoise(models, x, sigma, t, cond, conds, guidance, kernels))}
        # how far the compiled kernels are from the plain modules: the noise prediction itself, and the
        # denoised estimate with and without guidance (CFG amplifies the first where eps+ and eps- are close)
        latents, tt = (x * 0.1).half().repeat(2, 1, 1, 1), t.expand(2 * batch)
        eps = [calls.unet(latents, tt, cond.embeds, cond.pooled, cond.time_ids, None, None)
               for calls in (StepCalls.eager(models), kernels)]
        rec["rel_err_eps"] = rel(eps[1], eps[0])
        for g in (1.0, 5.0):
            full = torch.full_like(guidance, g)
            rec[f"rel_err_denoised_g{g:g}"] = rel(denoise(models, x, sigma, t, cond, conds, full, kernels),
                                                 denoise(models, x, sigma, t, cond, conds, full))
    log(json.dumps(rec))
    return rec
