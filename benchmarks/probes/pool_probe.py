"""Where a graph's pool growth comes from: sdxl-random (fp16) graphs of step kinds at one shape, captured one after
another into the runner's shared pool, each with the allocator's history on; per capture, its seconds, whether it
warmed up, the pool's growth, and every new segment the allocator made during it with the Python frames that asked
for it (the tensors that did not fit the blocks earlier graphs left free). The allocator's settings come from
PYTORCH_CUDA_ALLOC_CONF, so two processes compare two settings.

    python benchmarks/probes/pool_probe.py OUT.json [--batch 8] [--side 1024] [--order write,read,cond-write,cond-read]

Kinds: full (today's step), write / read (DeepCache's full / shallow step, branch 0), cond, cond-write, cond-read
(the conditional rows alone).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import graph_runner
from storyboard_cli.models.loader import cuda_allocator, load_sdxl
from storyboard_cli.steps import StepKind

KINDS = {"full": StepKind(), "write": StepKind(True, "write", 0), "read": StepKind(True, "read", 0),
         "cond": StepKind(False), "cond-write": StepKind(False, "write", 0), "cond-read": StepKind(False, "read", 0)}
OURS = ("storyboard_cli", "diffusers")


def _frames(entry: dict) -> list[str]:
    """The innermost frames of the project's and diffusers' code that asked for an allocation."""
    frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in entry.get("frames", [])
              if any(o in f["filename"] for o in OURS)]
    return frames[:4]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--order", default="write,read,cond-write,cond-read")
    args = ap.parse_args()
    models = load_sdxl("sdxl-random", "sdxl-random", "cuda", torch.float16)
    shape = Shape(args.batch, args.side, args.side, False)
    runner = graph_runner(models, [shape], compile="off")
    rec = {"alloc_conf": cuda_allocator(), "shape": shape.label, "captures": []}
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    for name in args.order.split(","):
        key = runner.shape_key(*shape, KINDS[name])
        seen = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        t0 = time.perf_counter()
        runner.graph(key)
        seconds = time.perf_counter() - t0
        snap = torch.cuda.memory._snapshot()
        trace = snap["device_traces"][torch.cuda.current_device()][seen:]
        new = [{"mb": round(e["size"] / 2**20, 1), "frames": _frames(e)} for e in trace
               if e["action"] == "segment_alloc"]
        big = sorted((e for e in trace if e["action"] == "alloc"), key=lambda e: -e["size"])[:6]
        st = runner.stats[key]
        rec["captures"].append({
            "kind": name, "label": key.label, "state": st.state, "reason": st.reason, "seconds": round(seconds, 3),
            "capture_s": round(st.capture_s, 3), "warmup": st.warmup, "pool_mb": round(st.pool_mb, 1),
            "new_segments": new, "new_segment_mb": round(sum(n["mb"] for n in new), 1),
            "largest_allocs": [{"mb": round(e["size"] / 2**20, 1), "frames": _frames(e)} for e in big],
            "segments": len(snap["segments"]), "reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1)})
        print(f"{name:<11} {st.state:<6} warmup={st.warmup!s:<5} {st.capture_s:.3f}s pool +{st.pool_mb:.0f} MB; "
              f"{len(new)} new segments {sum(n['mb'] for n in new):.0f} MB", flush=True)
        for n in new:
            print(f"    {n['mb']:>8.1f} MB  {' < '.join(n['frames'][:3])}", flush=True)
    torch.cuda.memory._record_memory_history(enabled=None)
    rec["pool_mb"] = round(sum(c["pool_mb"] for c in rec["captures"]), 1)
    print(f"pool in all: {rec['pool_mb']:.0f} MB ({rec['alloc_conf']})")
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
