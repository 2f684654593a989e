"""Regions scout: what the regions' masked cross-attention costs per step at 8 x 1024x1024 on sdxl-random (fp16,
plain CUDA graphs), and what changes it. One process, the same loaded weights, each variant a graph runner of its
own timed by run/capture.py `time_shapes` (10-step loops, median of 3), in this order:
  plain         no regions (diffusers' AttnProcessor2_0)
  slots4        the regions' processors, 4 region slots filled (what bcg renders with: 385 keys)
  slots2        2 slots (231 keys): a graph sized to a batch's most regions
  slots1        1 slot (154 keys)
  slots4_cudnn  4 slots, SDPA's cuDNN backend first (torch.nn.attention.sdpa_kernel(..., set_priority=True))
  plain_cudnn   no regions, cuDNN first
  plain_again   no regions again (the clock's drift over the run)
and a micro-benchmark of the cross-attention alone at both levels (SDPA on [16, heads, L, 64] queries with 77 keys,
unmasked, against 385 keys with the additive mask) per backend.

    python benchmarks/probes/regions_scout.py --out regions.json [--variants plain,slots4,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ALL = "plain,slots4,slots2,slots1,slots4_cudnn,plain_cudnn,plain_again"
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def step_ms(models, slots: int, cudnn: bool) -> dict:
    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.job.conditions.region import REGION_REFERENCES
    from storyboard_cli.models.regions import install
    from storyboard_cli.run.capture import time_shapes

    if slots:
        models.region_layout = install(models.unet, slots, REGION_REFERENCES)
    else:
        models.region_layout = None
    shape = Shape(8, 1024, 1024, 0)
    runner = GraphRunner(models, max_batch=8, max_hw=(1024, 1024))
    with sdpa_kernel(CUDNN_FIRST, set_priority=True) if cudnn else contextlib.nullcontext():
        (timing,) = time_shapes(models, runner, [shape], steps=10, repeats=3, eager=False)
    runner.release()
    models.region_layout = None
    return {"state": timing.state, "ms_per_step": timing.graph_ms, "ms_per_image_step": timing.graph_ms / 8}


def micro(budget_s: float = 20.0) -> list[dict]:
    """SDPA alone, 16 rows (8 images, CFG), fp16: SDXL's cross-attention at levels 1 (4096 queries, 10 heads) and 2
    (1024 queries, 20 heads)."""
    out = []
    dev, dt = torch.device("cuda"), torch.float16
    for length, heads in ((4096, 10), (1024, 20)):
        q = torch.randn(16, heads, length, 64, device=dev, dtype=dt)
        for keys, masked in ((77, False), (385, True), (231, True)):
            k = torch.randn(16, heads, keys, 64, device=dev, dtype=dt)
            v = torch.randn_like(k)
            bias = None
            if masked:
                bias = torch.zeros(16, 1, length, keys, device=dev, dtype=dt)
                bias[..., 154:] = float("-inf")
            for name, backends in (("default", None), ("cudnn", CUDNN_FIRST)):
                ctx = sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext()
                try:
                    with ctx:
                        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa
                        fn()
                        torch.cuda.synchronize()
                        times = []
                        for _ in range(5):
                            t0 = time.perf_counter()
                            for _ in range(20):
                                fn()
                            torch.cuda.synchronize()
                            times.append((time.perf_counter() - t0) / 20 * 1e3)
                    out.append({"queries": length, "heads": heads, "keys": keys, "masked": masked, "backend": name,
                                "ms": statistics.median(times)})
                except RuntimeError as e:
                    out.append({"queries": length, "heads": heads, "keys": keys, "masked": masked, "backend": name,
                                "error": str(e).splitlines()[0][:200]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=ALL)
    args = ap.parse_args()
    from diffusers.models.attention_processor import AttnProcessor2_0

    from storyboard_cli.models.loader import load_sdxl

    result: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "variants": {}}
    result["micro"] = micro()
    print(json.dumps(result["micro"], indent=1), flush=True)
    models = load_sdxl("sdxl-random", None, "cuda", torch.float16)
    for name in args.variants.split(","):
        slots = {"plain": 0, "plain_cudnn": 0, "plain_again": 0, "slots4": 4, "slots2": 2, "slots1": 1,
                 "slots4_cudnn": 4}[name]
        try:
            result["variants"][name] = step_ms(models, slots, name.endswith("_cudnn"))
        except Exception as e:  # noqa: BLE001 - a scout: record and go on
            result["variants"][name] = {"error": f"{e.__class__.__name__}: {str(e)[:300]}"}
        models.unet.set_attn_processor(AttnProcessor2_0())  # what load_sdxl leaves without regions
        print(name, result["variants"][name], flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    base = min(v["ms_per_step"] for k, v in result["variants"].items() if k.startswith("plain") and "ms_per_step" in v)
    for k, v in result["variants"].items():
        if "ms_per_step" in v:
            v["ratio"] = v["ms_per_step"] / base
            print(f"{k}: {v['ms_per_step']:.1f} ms per step, {v['ratio']:.3f}x", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
