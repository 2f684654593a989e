"""The UNet's noise prediction through compiled kernels against the eager module, same inputs, on the CPU
(or any device): whether the compiled recipe and its weight binding compute the same function, and how
far a dtype's rounding moves them apart. Builds the artifact first if the cache lacks it.

    python benchmarks/probes/precision.py sdxl-random float32 128    # the full SDXL UNet at 128x128 (3 minutes on 2 cores)
    python benchmarks/probes/precision.py tiny bfloat16 128
"""

from __future__ import annotations

import json
import sys
import time

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.eager import StepCalls
from storyboard_cli.engine.kernels.artifacts import targets
from storyboard_cli.engine.kernels.builds import Builds
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.kernels.export import text_dims
from storyboard_cli.models.loader import load_sdxl


def main(model: str, dtype_name: str, side: int) -> None:
    dtype = getattr(torch, dtype_name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = load_sdxl(model, None, device, dtype)
    k = CompiledKernels(m, Builds(m.device))
    built = None
    if k.want(targets([Shape(1, side, side, False)], False)):
        t0 = time.perf_counter()
        k.wait()
        built = round(time.perf_counter() - t0, 1)
    k.reserve(1, side * side)
    h = side // 8
    g = torch.Generator().manual_seed(0)
    text_dim, pooled_dim = text_dims(m.unet)
    inputs = (torch.randn(2, 4, h, h, generator=g), torch.full((2,), 500.0), torch.randn(2, 77, text_dim, generator=g),
              torch.randn(2, pooled_dim, generator=g),
              torch.tensor([side, side, 0, 0, side, side], dtype=torch.float32).expand(2, 6).clone())
    latents, t, embeds, pooled, time_ids = (x.to(device, dtype if x.dim() > 1 else torch.float32) for x in inputs)
    with torch.no_grad():
        got = k.unet(latents, t, embeds, pooled, time_ids, None, None).float()
        want = StepCalls.eager(m).unet(latents, t, embeds, pooled, time_ids, None, None).float()
    sys.stdout.write(json.dumps({"model": model, "dtype": dtype_name, "side": side, "device": device,
                                 "built_s": built, "notes": k.notes,
                                 "rel_err_eps": (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()})
                     + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
