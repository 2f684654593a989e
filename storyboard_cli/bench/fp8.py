"""`bcg bench`'s FP8 drift report: what the FP8 UNet kernels (`--kernels fp8`, engine/kernels/fp8.py) change against
the compiled fp16 ones. Per step: the guided noise prediction's relative error along one fp16 trajectory. Per image:
PSNR of the final pictures of the job, rendered both ways on the same seeds (harness: contenders (e) and (f))."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.bench.drift import drift_summary, picture_drift
from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import compiled_kernels
from storyboard_cli.engine.eager import sample_step
from storyboard_cli.engine.sampling import SIGMA, schedule
from storyboard_cli.engine.variants import FP8, VARIANTS, why_not
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.capture import synthetic_inputs


def fp8_ready(device: torch.device) -> bool:
    """Whether this device runs the `fp8` row's kernels (its capability: FP8 GEMMs)."""
    return why_not(VARIANTS[FP8], "graph", "on", device) is None


@torch.no_grad()
def step_drift(models: SdxlModels, log: Callable[[str], None], batch: int = 2, side: int = 1024, steps: int = 30,
               guidance: float = 6.0) -> dict:
    """One euler loop on the compiled fp16 kernels; at every step the FP8 kernels predict from the same latents:
    the relative L2 error of the guided noise prediction (and of the denoised latents) per step. Kernels from the
    cache, built first where it lacks them."""
    shape = Shape(batch, side, side, False)
    notes: list[str] = []
    k16 = compiled_kernels(models, [shape], "on", notes, defer=False)
    k8 = compiled_kernels(models, [shape], "on", notes, kernels=FP8, defer=False)
    for k in (k16, k8):
        k.reserve(batch, side * side)
        if k.ready(*shape) is not None:
            raise RuntimeError(f"no compiled kernels for {shape.label}: {k.ready(*shape)}; {notes}")
    x, cond, conds, _ = synthetic_inputs(models, batch, side, side, False)
    sched = schedule("euler", steps, models.scheduler_config)
    x = x.float() * sched.init_sigma
    g = torch.full((batch,), guidance, device=models.device)
    table = sched.table.to(models.device)
    prev, zero = torch.zeros_like(x), torch.zeros_like(x)
    rows = []
    for i in range(steps):
        sigma = table[i][SIGMA]
        x_next, d16 = sample_step(models, x, prev, zero, table[i], cond, conds.at(i), g, k16)
        _, d8 = sample_step(models, x, prev, zero, table[i], cond, conds.at(i), g, k8)
        eps16, eps8 = (x - d16) / sigma, (x - d8) / sigma
        rows.append({"step": i, "t": round(table[i][1].item(), 1), "eps_rel": _rel(eps8, eps16),
                     "denoised_rel": _rel(d8, d16)})
        x, prev = x_next, d16
    eps = [r["eps_rel"] for r in rows]
    rec = {"shape": shape.label, "guidance": guidance, "steps": rows,
           "eps_rel": {"median": statistics.median(eps), "max": max(eps), "first": eps[0], "last": eps[-1]},
           "notes": notes}
    log(f"FP8 drift per step ({shape.label}, guidance {guidance:g}): noise prediction {json.dumps(rec['eps_rel'])}")
    return rec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm((a - b).float()) / torch.linalg.vector_norm(b.float()).clamp_min(1e-12)).item()


def image_drift(fp8_dir: Path, fp16_dir: Path) -> dict:
    """PSNR (dB, 8-bit) and mean absolute difference of every FP8 picture against the fp16 one of the same seed."""
    rows = picture_drift(fp8_dir, fp16_dir)
    return {"images": rows, **drift_summary(rows)}
