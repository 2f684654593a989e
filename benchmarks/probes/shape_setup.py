"""What a compiled UNet's first call at new rows costs in a fresh process, and in which library (issue 41).

In the bench job a graph that needs a warm-up costs (e) 0.4-0.7 s and (f), right after (e) in the same process, 0.07-0.13
s; a graph captured at new rows without a warm-up costs (e) up to 0.44 s and (f) 0.02-0.03 s (docs/PERFORMANCE.md,
2026-12-04, seventeenth session). The guess: the libraries' per-shape setup (cuDNN's convolution and attention plans,
cuBLAS's), paid once per process and shape. This probe measures it on the cache's UNet artifact of `--variant` at
`--side`, loaded as a render loads it, in a process that has run nothing else:

  call    at each of --call-rows, in order: the first call at those rows and a second, each timed on the host to the
          GPU's end; the first call's host CPU time per operator (torch.profiler, CPU only), grouped: convolutions,
          attention, GEMMs, the rest
  capture at each of --capture-rows (rows no call ran at): a graph captured at once (the runner's capture without a
          warm-up), then a second graph at the same rows; the host seconds of each

    python benchmarks/probes/shape_setup.py OUT.json [--variant compiled|fp8] [--side 1024] [--model sdxl-random]
        [--call-rows 16,4] [--capture-rows 8,2] [--cache DIR]
    python benchmarks/probes/shape_setup.py /tmp/s.json --model tiny --side 128 --cache DIR   # CPU: the calls only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_scout import Record  # noqa: E402

from storyboard_cli.engine.kernels.calls import CompiledKernels  # noqa: E402
from storyboard_cli.engine.kernels.export import example_inputs  # noqa: E402
from storyboard_cli.models.loader import cuda_allocator, load_sdxl  # noqa: E402

GROUPS = (("convolution", ("conv",)), ("attention", ("attention", "sdpa")), ("gemm", ("mm", "addmm", "linear")))


def group(name: str) -> str:
    low = name.lower()
    return next((g for g, needles in GROUPS if any(n in low for n in needles)), "other")


def synced(fn) -> tuple[float, object]:
    """(host seconds to the GPU's end, fn's result)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def profiled(fn) -> tuple[float, dict]:
    """fn timed to the GPU's end under a CPU-only profiler: (seconds, group -> {ms, calls, top operators})."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        s, _ = synced(fn)
    groups: dict[str, dict] = {}
    for e in prof.key_averages():
        if not e.key.startswith("aten::") or e.key in ("aten::empty", "aten::empty_strided"):
            continue
        g = groups.setdefault(group(e.key), {"ms": 0.0, "calls": 0, "ops": {}})
        g["ms"] += e.self_cpu_time_total / 1000
        g["calls"] += e.count
        g["ops"][e.key] = round(e.self_cpu_time_total / 1000, 2)
    for g in groups.values():
        g["ms"] = round(g["ms"], 1)
        g["ops"] = dict(sorted(g["ops"].items(), key=lambda kv: -kv[1])[:5])
    return s, groups


def cache_unet(rec: Record, model: str, variant: str, side: int, cache: Path | None):
    """The cache's UNet artifact of `variant` at `side`, loaded as a render loads it (on the GPU in fp16, on the CPU in
    fp32): (its call, inputs(rows) -> its example inputs at those rows), or None once the record says why not. The
    record gets the weights' load seconds, the artifact's name and its load seconds."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    models = load_sdxl(model, None, device, torch.float16 if device == "cuda" else torch.float32)
    rec.put("load_s", round(time.perf_counter() - t0, 1))
    k = CompiledKernels(models, root=cache, variant=variant)
    target = k.unet_target(side, side)
    path = k.path(target)
    t0 = time.perf_counter()
    if not path.is_file() or not k.add(target, path):
        rec.put("error", f"no {target.label} artifact in the cache ({path}); {k.notes}")
        return None
    rec.put("artifact", path.name)
    rec.put("artifact_load_s", round(time.perf_counter() - t0, 3))
    lat = side // 8

    def inputs(rows: int) -> tuple:
        args = list(example_inputs("unet", models.unet, rows, lat, lat))
        args[1] = torch.tensor(500.0, dtype=torch.float32, device=device)
        return tuple(args)

    return k.calls[target], inputs


def unet_probe_args(doc: str) -> argparse.ArgumentParser:
    """The arguments of a probe on the cache's UNet artifact (`cache_unet`): OUT, --model, --variant, --side, --cache."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--variant", default="compiled", choices=("compiled", "fp8"))
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--cache", type=Path, default=None, help="the compiled artifacts' folder (default: $BCG_CACHE's)")
    return ap


def start_unet_probe(a: argparse.Namespace) -> tuple[Record, tuple | None]:
    """The allocator's settings (before CUDA starts), the run's record, and `cache_unet`'s artifact (None: the record
    says why not), for `unet_probe_args`' arguments."""
    allocator = cuda_allocator()
    cuda = torch.cuda.is_available()
    rec = Record(a.out, variant=a.variant, model=a.model, side=a.side, torch=torch.__version__,
                 gpu=torch.cuda.get_device_name() if cuda else None, allocator=allocator)
    return rec, cache_unet(rec, a.model, a.variant, a.side, a.cache)


def main() -> None:
    ap = unet_probe_args(__doc__)
    ap.add_argument("--call-rows", default="16,4")
    ap.add_argument("--capture-rows", default="8,2")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rec, loaded = start_unet_probe(a)
    if loaded is None:
        return
    call, inputs = loaded

    with torch.no_grad():
        first_cuda, _ = synced(lambda: torch.zeros(1, device=device) + 1)
        rec.put("first_op_s", round(first_cuda, 3))
        calls = {}
        for rows in map(int, a.call_rows.split(",")):
            x = inputs(rows)
            first, groups = profiled(lambda: call(*x))
            second, _ = synced(lambda: call(*x))
            third, _ = synced(lambda: call(*x))
            calls[f"{rows}_rows"] = {"first_s": round(first, 3), "second_s": round(second, 3),
                                     "third_s": round(third, 3), "first_profile": groups}
            rec.put("call", calls)
        if not cuda:
            rec.put("done", True)
            return
        captures = {}
        pool = torch.cuda.graph_pool_handle()
        # every graph kept: a pool dies with its last graph, and a capture into a dead pool's handle trips the
        # allocator's assert (use_count > 0, CUDACachingAllocator.cpp; what this probe hit on 2026-12-04)
        graphs = []
        for rows in map(int, a.capture_rows.split(",")):
            x = inputs(rows)
            got = {}
            for name in ("first", "second"):
                graph = torch.cuda.CUDAGraph()
                graphs.append(graph)
                s, _ = synced(lambda: _capture(graph, pool, call, x))
                got[f"{name}_s"] = round(s, 3)
                replay, _ = synced(graph.replay)
                got[f"{name}_replay_s"] = round(replay, 3)
            captures[f"{rows}_rows"] = got
            rec.put("capture", captures)
    rec.put("done", True)


def _capture(graph: torch.cuda.CUDAGraph, pool, call, x: tuple) -> None:
    with torch.cuda.graph(graph, pool=pool):
        call(*x)


if __name__ == "__main__":
    main()
