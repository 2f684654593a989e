"""Conv PSNR scout: what FP8 convolutions would do to the pictures, before any kernel of ours is built (issue 41 item 5).

`conv_scout.py` times an implicit-GEMM FP8 convolution against cuDNN's fp16 one and measures the UNet's noise
prediction error with FP8 convolutions (8.0e-2 against the FP8 Linears' 3.4e-2 on an H100, 2026-12-06). The issue
keeps a step lever only with a PSNR against fp16 of at least 45 dB, and a prediction error does not say what 30
steps and the VAE make of it. This renders the same seeds through the plain diffusers loop (the bench's (a),
`bench/contenders.py DiffusersLoop`) with the UNet's arithmetic rounded through float8_e4m3fn where a variant says,
and compares each variant's pictures with fp16's:

  lin        the Linears the product's FP8 kernels run (engine/kernels/fp8.py: a transformer block's Linears that
             read image tokens), input at a static per-tensor scale calibrated as the product calibrates it
             (`calibration_steps`: the input amax over eager calls / 448), weight per tensor: what `--fp8` does
             today (its PSNR against (e) in the bench job is about 49.5 dB), as a check of this emulation
  lin_conv   lin, and every convolution a tile can take (channels multiples of 16: all but conv_in and conv_out)
             with its input at a static per-tensor scale (calibrated the same way) and its weight per output channel
             (what `conv_scout.py`'s FP8 kernel computes)
  lin_conv3  lin, and only the 3x3 convolutions (the 1x1 shortcuts read a block's input, whose quantisation could not
             be fused into a norm)
  lin_conv64, lin_conv32  lin, and the convolutions lin_conv takes whose input is at most 64 (32) latent pixels high
             at the model's native size: the UNet's two (one) inner levels, where the channels are many and the
             spatial error is spread over fewer, coarser pixels

Every rounding is exact emulation (values rounded to FP8 and back, products in fp16 with fp32 accumulation), not
the FP8 kernels: the kernels' own accumulation differs by far less than the rounding. The pictures are the bench
job's first --images images without ControlNet, each variant on the same seeds; PSNR per image (uint8 RGB) and its
median and minimum per variant.

    python benchmarks/probes/conv_psnr.py --out psnr.json                   # CUDA: sdxl-random, about 2 minutes
    python benchmarks/probes/conv_psnr.py --out /tmp/p.json --smoke         # CPU: tiny, 2 images, 3 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from storyboard_cli.engine.kernels.fp8 import FP8, FP8_MAX, calibration_steps  # noqa: E402

VARIANTS = ("lin", "lin_conv", "lin_conv3", "lin_conv64", "lin_conv32")


def fp8_linears(unet: torch.nn.Module) -> list[str]:
    """The unfused UNet's names of the Linears the product's FP8 kernels run: in a transformer block, all but the
    cross-attention's key and value (they read the 77 text tokens). The self-attention's q, k and v read one input,
    as the fused to_qkv does."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    out = []
    for prefix, block in unet.named_modules():
        if not isinstance(block, Transformer2DModel):
            continue
        cross_kv = {f"{prefix}.{n}.{p}" for n, m in block.named_modules()
                    if isinstance(m, Attention) and m.is_cross_attention for p in ("to_k", "to_v")}
        out += [f"{prefix}.{n}" for n, m in block.named_modules()
                if isinstance(m, torch.nn.Linear) and f"{prefix}.{n}" not in cross_kv]
    return out


def fp8_convs(unet: torch.nn.Module, only_3x3: bool) -> list[str]:
    return [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Conv2d)
            and m.in_channels % 16 == 0 and m.out_channels % 16 == 0 and (m.kernel_size == (3, 3) or not only_3x3)]


def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x through float8_e4m3fn at `scale` (a tensor that broadcasts against x), saturating, and back in x's dtype."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def calibrate(models, names: list[str]) -> tuple[dict[str, float], dict[str, int]]:
    """name -> the amax of the module's input over the product's calibration calls; name -> its input's height."""
    from storyboard_cli.engine.eager import unet_call

    seen: dict[str, torch.Tensor] = {}
    height: dict[str, int] = {}

    def record(name, _m, args):
        height[name] = args[0].shape[-2] if args[0].dim() == 4 else 0
        a = args[0].detach().abs().amax().float()
        seen[name] = a if name not in seen else torch.maximum(seen[name], a)

    unet = models.unet
    hooks = [unet.get_submodule(n).register_forward_pre_hook(partial(record, n)) for n in names]
    try:
        with torch.no_grad():
            for latents, t, embeds, pooled, ids in calibration_steps(models):
                unet_call(unet, latents, t, embeds, pooled, ids, None, None)
    finally:
        for h in hooks:
            h.remove()
    return {n: a.item() for n, a in seen.items()}, height


class Rounding:
    """The UNet with the named modules' inputs and weights rounded through FP8 while inside the `with`."""

    def __init__(self, unet, amax: dict[str, float], linears: list[str], convs: list[str]):
        self.unet, self.amax, self.names = unet, amax, linears + convs
        self.convs = set(convs)

    def __enter__(self):
        self.saved, self.hooks = {}, []
        for n in self.names:
            m = self.unet.get_submodule(n)
            w = m.weight.data
            self.saved[n] = w
            dims = (1, 2, 3) if n in self.convs else None  # per output channel; a Linear's per tensor
            amax = w.abs().amax(dim=dims, keepdim=True) if dims else w.abs().amax()
            m.weight.data = rounded(w, amax.float().clamp_min(1e-12) / FP8_MAX)
            x_scale = torch.tensor(max(self.amax[n], 1e-12) / FP8_MAX, device=w.device)
            self.hooks.append(m.register_forward_pre_hook(
                lambda _m, args, s=x_scale: (rounded(args[0], s), *args[1:])))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for n, w in self.saved.items():
            self.unet.get_submodule(n).weight.data = w


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255**2 / mse) if mse else float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny model, 3 steps at 128x128")
    a = p.parse_args()

    from storyboard_cli.bench.contenders import DiffusersLoop
    from storyboard_cli.job.file import load_job
    from storyboard_cli.models.loader import load_sdxl

    t0 = time.perf_counter()
    device = "cpu" if a.smoke else "cuda"
    dtype = torch.float32 if a.smoke else torch.float16
    models = load_sdxl("tiny" if a.smoke else "sdxl-random", None, device, dtype)
    loop = DiffusersLoop(models)
    job = load_job(ROOT / "jobs" / "bench.yaml")
    shots, n = [], 0
    for shot in job.shots:
        if shot.controls or n >= a.images:
            continue
        shot = replace(shot, candidates=min(shot.candidates, a.images - n))
        if a.smoke:
            shot = replace(shot, steps=3, width=128, height=128)
        shots.append(shot)
        n += shot.candidates
    unet = models.unet
    linears = fp8_linears(unet)
    convs = fp8_convs(unet, False)
    amax, height = calibrate(models, linears + convs)
    side = unet.config.sample_size  # latent pixels at the native size, the calibration's
    variants = {"lin": (linears, []), "lin_conv": (linears, convs), "lin_conv3": (linears, fp8_convs(unet, True)),
                "lin_conv64": (linears, [c for c in convs if height[c] <= side // 2]),
                "lin_conv32": (linears, [c for c in convs if height[c] <= side // 4])}
    wanted = [v for v in a.variants.split(",") if v]
    record: dict = {"model": models.name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "images": n, "shots": [s.id for s in shots],
                    "linears": len(linears), "convs": {v: len(variants[v][1]) for v in wanted}, "variants": {}}

    def render() -> list[np.ndarray]:
        out = []
        with torch.no_grad():
            for shot in shots:
                out += [np.asarray(im.convert("RGB")) for im in loop.shot(shot)]
        return out

    base = render()
    record["fp16_s"] = time.perf_counter() - t0
    for v in wanted:
        t1 = time.perf_counter()
        with Rounding(unet, amax, *variants[v]):
            got = render()
        values = [psnr(x, y) for x, y in zip(got, base)]
        finite = [x for x in values if x != float("inf")]
        record["variants"][v] = {"psnr_db": [round(x, 2) for x in values],
                                 "median_db": round(statistics.median(finite), 2) if finite else None,
                                 "min_db": round(min(finite), 2) if finite else None,
                                 "s": round(time.perf_counter() - t1, 1)}
        print(v, json.dumps(record["variants"][v]), flush=True)
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    record["elapsed_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
