"""ControlNet embedding scout: what share of the ControlNet's step is its conditioning embedding? (issue 41)

A ControlNet first turns its control image into a latent-sized feature (`controlnet_cond_embedding`: eight
convolutions with SiLUs, from 3 channels at the image's full size to 320 at the latent's, most of them at 16 to 96
channels over 256² to 1024² positions, where the matrix units are poorly fed). That feature is the same at every step
of a batch, and for every candidate of a shot and both halves of the guidance (one control image). The step's
ControlNet (its compiled artifact) computed it again at every step, for every row. This measured what precomputing it
once per batch would save before the artifact's inputs were changed for it; the product now does so (engine/conditions/
control.py `embed_guide`, export.CONTROLNET_RECIPE), and the scout still times the embedding alone.

Per size (1024x1024, 832x1216) and rows (2, 4, 8, 16: 1 to 8 images, guided), fp16, each in ms (a CUDA graph of 10
calls, median of --repeats replays):
  embed_eager     the embedding, eager, NCHW
  embed_cl        the same channels_last (the artifact's convolutions run NHWC)
  embed_compiled  torch.compile of the embedding on a channels_last input (inductor: the SiLUs fused, cuDNN's
                  convolutions), the nearest to what the artifact runs
and at --net-rows (4: the issue's 2 x 1024² +control shape) the whole net, eager, channels_last, with the embedding
(`net_eager`) and with the embedding passed in precomputed (`net_eager_pre`), their outputs' relative difference
(should be 0), and FLOPs of the embedding per row. The compiled net's step for comparison is in
benchmarks/results/step/2026-12-02-14550ef-controlnet.json (fp16 27.2 ms, FP8 24.3 ms at 2 images).

    python benchmarks/probes/cn_embed_scout.py --out cn_embed.json          # CUDA (H200): about a minute
    python benchmarks/probes/cn_embed_scout.py --out /tmp/e.json --smoke    # CPU: tiny, 2 rows, no compile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from attention_scout import last_line  # noqa: E402
from attention_scout import time_graph_ms  # noqa: E402


def timed(fn, iters: int, repeats: int) -> float:
    """ms per call: replays of a CUDA graph of 10 calls; on the CPU (the smoke run) one call's wall."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    return time_graph_ms(fn, iters, repeats)


def embed_gflop(embedding: nn.Module, h: int, w: int) -> float:
    """GFLOP of one row's embedding at an h x w image (2 x MACs of every convolution, hooks on the meta device)."""
    total = [0.0]

    def hook(m, args, out):
        total[0] += 2.0 * out.numel() * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]

    hooks = [m.register_forward_hook(hook) for m in embedding.modules() if isinstance(m, nn.Conv2d)]
    try:
        embedding.to("meta")(torch.empty(1, 3, h, w, device="meta", dtype=next(embedding.parameters()).dtype))
    finally:
        for k in hooks:
            k.remove()
    return total[0] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--sizes", default="1024x1024,832x1216")
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--net-rows", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--smoke", action="store_true", help="tiny, 128x128, 2 rows, no compile")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    if a.smoke:
        a.model, a.sizes, a.rows, a.net_rows, a.iters, a.repeats = "tiny", "128x128", "2", 2, 1, 1
    record: dict = {"model": a.model, "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None,
                    "dtype": str(dtype), "sizes": {}}

    def save():
        record["elapsed_s"] = round(time.perf_counter() - t0, 1)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, a.out)

    import copy

    from storyboard_cli.models.loader import load_sdxl

    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per size and rows: never eager
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    models = load_sdxl(a.model, a.model, device, dtype)
    net = models.controlnets[0].eval()
    embedding = net.controlnet_cond_embedding
    record["load_s"] = round(time.perf_counter() - t0, 1)
    with torch.no_grad():
        for size in a.sizes.split(","):
            w, h = (int(v) for v in size.split("x"))
            res: dict = {"embed_gflop_per_row": round(embed_gflop(copy.deepcopy(embedding), h, w), 2), "rows": {}}
            record["sizes"][size] = res
            for rows in map(int, a.rows.split(",")):
                if time.perf_counter() - t0 > a.budget:
                    record.setdefault("left_out", []).append(f"{size} at {rows} rows")
                    continue
                r: dict = {}
                image = torch.rand(rows, 3, h, w, device=device, dtype=dtype)
                image_cl = image.contiguous(memory_format=torch.channels_last)
                embedding_cl = copy.deepcopy(embedding).to(memory_format=torch.channels_last)
                try:
                    r["embed_eager_ms"] = timed(lambda: embedding(image), a.iters, a.repeats)
                    r["embed_cl_ms"] = timed(lambda: embedding_cl(image_cl), a.iters, a.repeats)
                    if cuda:
                        compiled = torch.compile(embedding_cl, dynamic=False)
                        r["embed_compiled_ms"] = timed(lambda: compiled(image_cl), a.iters, a.repeats)
                        r["embed_compiled_err"] = float(f"{rel(compiled(image_cl), embedding(image)):.3g}")
                except Exception as exc:  # noqa: BLE001 - one shape's failure never stops the rest
                    r["error"] = last_line(exc)
                res["rows"][str(rows)] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                print(size, rows, res["rows"][str(rows)], flush=True)
                save()
            if time.perf_counter() - t0 > a.budget:
                continue
            try:
                res[f"net_{a.net_rows}_rows"] = net_pair(net, a.net_rows, h, w, a.iters, a.repeats)
            except Exception as exc:  # noqa: BLE001
                res[f"net_{a.net_rows}_rows"] = {"error": last_line(exc)}
            print(size, "net", res[f"net_{a.net_rows}_rows"], flush=True)
            save()
    save()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


def net_pair(net: nn.Module, rows: int, h: int, w: int, iters: int, repeats: int) -> dict:
    """The whole net's call, eager and channels_last, with its embedding and with the embedding passed in."""
    import copy

    from storyboard_cli.engine.conditions.control import embedding_apart
    from storyboard_cli.engine.eager import controlnet_call
    from storyboard_cli.engine.kernels.export import example_inputs

    cl = copy.deepcopy(net).to(memory_format=torch.channels_last)
    latents, t, embeds, pooled, time_ids, _, scale = example_inputs("controlnet", cl, rows, h // 8, w // 8)
    image = torch.rand(rows, 3, h, w, dtype=latents.dtype, device=latents.device)
    latents, image = (x.contiguous(memory_format=torch.channels_last) for x in (latents, image))
    whole = lambda: controlnet_call(cl, latents, t, embeds, pooled, time_ids, image, scale)  # noqa: E731
    feature = cl.controlnet_cond_embedding(image)
    pre = embedding_apart(cl)  # the product's: the same modules, its embedding an identity
    passed = lambda: controlnet_call(pre, latents, t, embeds, pooled, time_ids, feature, scale)  # noqa: E731
    out = {"net_eager_ms": timed(whole, iters, repeats), "net_eager_pre_ms": timed(passed, iters, repeats)}
    out["pre_vs_whole"] = float(f"{max(rel(g, w) for g, w in zip(passed(), whole())):.3g}")
    out["saved_ms"] = out["net_eager_ms"] - out["net_eager_pre_ms"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


if __name__ == "__main__":
    main()
