"""Where one compiled denoising step's GPU time goes, fp16 against FP8 (issue 41, item 5: the step, profile-led).

One CFG-batched step at `--batch` x `--side`² (the `compiled` and `fp8` rows' kernels from the cache: nothing is
built; a row whose artifact is missing is recorded as such), outside any graph (a replay hides its kernels from the
profiler). Per row: every kernel's device ms per step, and the kernels grouped by what they are (GEMMs, FP8 GEMMs,
attention, convolutions, the compiler's reductions and pointwise kernels, the rest), so the next scout aims at the
largest group.

    python benchmarks/probes/step_profile.py --out profile.json                 # H200, sdxl-random, cache filled
    python benchmarks/probes/step_profile.py --model tiny --side 128 --rows compiled --out /tmp/p.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import compiled_kernels
from storyboard_cli.engine.device import DTYPES
from storyboard_cli.engine.eager import denoise
from storyboard_cli.models.loader import load_sdxl
from storyboard_cli.run.capture import synthetic_inputs

# first match wins: a convolution's implicit GEMM is a convolution, not a GEMM
GROUPS = (("attention", r"sdpa|fmha|flash|attention"),
          ("convolution", r"fprop|conv|implicit_gemm|nchwToNhwc|nhwcToNchw"),
          ("gemm fp8", r"e4m3|f8f8|qqh|fp8|_scaled_mm|sm90_xmma_gemm_e4"),
          ("gemm", r"nvjet|gemm|cutlass|cublas|xmma"),
          ("compiler reduction", r"^triton_(red|per)_"),
          ("compiler pointwise", r"^triton_poi_"),
          ("other", r""))


def group(name: str) -> str:
    return next(g for g, pattern in GROUPS if re.search(pattern, name, re.IGNORECASE))


def profile_step(fn, n: int) -> dict:
    """Each kernel's device ms per call of `fn` and the groups' sums (torch.profiler, after two warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    for _ in range(2):
        fn()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(n):
            fn()
        sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0] if torch.cuda.is_available() else \
        [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    time_of = (lambda e: e.device_time_total) if torch.cuda.is_available() else (lambda e: e.self_cpu_time_total)
    kernels = sorted(({"kernel": e.key[:140], "group": group(e.key), "ms": round(time_of(e) / 1000 / n, 3),
                       "calls": e.count // n} for e in events), key=lambda k: -k["ms"])
    groups: dict[str, dict] = {}
    for k in kernels:
        g = groups.setdefault(k["group"], {"ms": 0.0, "calls": 0, "kernels": 0})
        g["ms"] += k["ms"]
        g["calls"] += k["calls"]
        g["kernels"] += 1
    total = sum(k["ms"] for k in kernels)
    return {"ms_per_step": round(total, 2), "calls": sum(k["calls"] for k in kernels),
            "groups": {name: {**g, "ms": round(g["ms"], 2), "share": round(g["ms"] / total, 3)}
                       for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["ms"])},
            "top": kernels[:60]}


def wall_ms(fn, n: int) -> float:
    """The step's wall per call, outside a graph (launches included): an upper bound on the replay's."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return round((time.perf_counter() - t0) / n * 1000, 2)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="sdxl-random")
    p.add_argument("--side", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", default="compiled,fp8", help="the variants' rows to profile, joined by commas")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES["fp16" if cuda else "fp32"]
    rec: dict = {"model": args.model, "shape": f"{args.batch}x{args.side}x{args.side}", "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name() if cuda else None, "rows": {}}
    models = load_sdxl(args.model, None, device, dtype)
    shape = Shape(args.batch, args.side, args.side, False)
    x, cond, conds, guidance = synthetic_inputs(models, args.batch, args.side, args.side, False)
    sigma, t = torch.tensor(10.0, device=device), torch.tensor(500.0, device=device)
    for row in args.rows.split(","):
        notes: list[str] = []
        try:
            kernels = compiled_kernels(models, [shape], "auto", notes, kernels=row)
            missing = kernels.want(kernels.targets([shape])) if kernels is not None else ["no compiled kernels"]
            why = kernels.ready(*shape) if kernels is not None else "none"
            if missing or why:
                rec["rows"][row] = {"skipped": f"not in the cache: {missing} {why}", "notes": notes}
                continue
            kernels.reserve(args.batch, args.side * args.side)
            with torch.no_grad():
                step = lambda: denoise(models, x, sigma, t, cond, conds, guidance, kernels)  # noqa: E731
                rec["rows"][row] = {**profile_step(step, args.calls), "wall_ms": wall_ms(step, 5), "notes": notes}
        except Exception as e:  # one row's failure never stops the other's
            rec["rows"][row] = {"failed": f"{type(e).__name__}: {e}"[:400], "notes": notes}
        args.out.write_text(json.dumps(rec, indent=1))
        summary = rec["rows"][row]
        print(row, json.dumps({k: summary.get(k) for k in ("ms_per_step", "wall_ms", "groups", "skipped", "failed")}))
    if cuda:
        rec["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    args.out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
