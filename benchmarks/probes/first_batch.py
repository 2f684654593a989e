"""A render's first batch in a fresh process, two ways: its setup before its loop, or beside its own first steps.

In the bench job (e)'s first batch exposes 1.05-1.16 s before its loop, which nothing runs beside: the 8 x 1024²
UNet's artifact load, its warm-up at 2 rows and its capture at 16 rows, where the libraries' setup at new rows
(cuDNN's attention and convolution plans, paid once per process and shape: shape_setup.py) falls
(docs/PERFORMANCE.md, thirty-seventh session). This measures, on the cache's UNet artifact of `--variant` at `--side`,
loaded as a render loads it, in a process that has run nothing else, `--steps` steps at `--rows` rows from the first
call to the last step's end:

  ahead   as the graph runner runs a first batch today: a warm-up call at 2 rows (synced), the graph captured at
          `--rows`, then every step a replay
  beside  the first `--direct` steps called on the artifact outside any graph, queued; the graph captured while
          the GPU runs them (on torch's capture stream, thread-local, no sync: as the runner captures beside a loop),
          then the other steps replays

Run each mode in a process of its own (`--mode`): the setup is per process. The record has the wall, the host seconds
of each stage, and where the beside mode's capture began and ended against its direct steps' GPU end.

    python benchmarks/probes/first_batch.py OUT.json --mode ahead|beside [--variant compiled|fp8] [--side 1024]
        [--rows 16] [--steps 30] [--direct 2] [--model sdxl-random] [--cache DIR]
    python benchmarks/probes/first_batch.py /tmp/b.json --mode beside --model tiny --side 128 --cache DIR   # CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_scout import Record  # noqa: E402
from shape_setup import cache_unet  # noqa: E402

from storyboard_cli.models.loader import cuda_allocator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", required=True, choices=("ahead", "beside"))
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--variant", default="compiled", choices=("compiled", "fp8"))
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--direct", type=int, default=2, help="beside: the steps called outside the graph")
    ap.add_argument("--cache", type=Path, default=None, help="the compiled artifacts' folder (default: $BCG_CACHE's)")
    a = ap.parse_args()
    allocator = cuda_allocator()  # the product's settings, before CUDA starts
    cuda = torch.cuda.is_available()
    rec = Record(a.out, mode=a.mode, variant=a.variant, model=a.model, side=a.side, rows=a.rows, steps=a.steps,
                 direct=a.direct if a.mode == "beside" else 0, torch=torch.__version__,
                 gpu=torch.cuda.get_device_name() if cuda else None, allocator=allocator)
    loaded = cache_unet(rec, a.model, a.variant, a.side, a.cache)
    if loaded is None:
        return
    call, inputs = loaded

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    x = inputs(a.rows)
    small = inputs(2)
    sync()
    stages: dict[str, float] = {}
    with torch.no_grad():
        if not cuda:  # the CPU: the calls only (a smoke test of this script)
            start = time.perf_counter()
            for _ in range(a.steps):
                call(*x)
            rec.put("wall_s", round(time.perf_counter() - start, 3))
            rec.put("done", True)
            return
        pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        if a.mode == "ahead":
            call(*small)  # the runner's warm-up: lazy inits outside the graph, at the small rows
            sync()
            stages["warmup_s"] = time.perf_counter() - start
            t1 = time.perf_counter()
            with torch.cuda.graph(graph, pool=pool):
                call(*x)
            stages["capture_s"] = time.perf_counter() - t1
            replays = a.steps
        else:
            done = torch.cuda.Event()
            t1 = time.perf_counter()
            for i in range(a.direct):
                call(*x)
                if i == 0:
                    stages["first_direct_host_s"] = time.perf_counter() - t1
            done.record()
            stages["direct_host_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            # a stream of its own (torch.cuda.graph makes its default capture stream at its first use, and a capture
            # on the default stream is refused); recorded, not run: no wait needed
            with torch.cuda.stream(torch.cuda.Stream()):
                graph.capture_begin(pool, capture_error_mode="thread_local")
                try:
                    call(*x)
                finally:
                    graph.capture_end()
            stages["capture_s"] = time.perf_counter() - t2
            rec.put("direct_done_at_capture_end", done.query())  # False: the capture hid behind the direct steps
            replays = a.steps - a.direct
        t3 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        sync()
        stages["replays_s"] = time.perf_counter() - t3
        rec.put("wall_s", round(time.perf_counter() - start, 3))
        rec.put("stages", {name: round(s, 3) for name, s in stages.items()})
        # a second run of the same steps, every setup done: what the first paid beyond it
        start = time.perf_counter()
        for _ in range(a.steps):
            graph.replay()
        sync()
        rec.put("replays_only_s", round(time.perf_counter() - start, 3))
    rec.put("done", True)


if __name__ == "__main__":
    main()
