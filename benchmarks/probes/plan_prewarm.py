"""Whether the libraries' plans for new rows, made ahead by engine/kernels/plans.py, take the setup out of a compiled
UNet's first call at those rows (issue 41: a capture beside a loop pays that setup in one piece).

In a fresh process, the cache's UNet artifact of `--variant` at `--side`: its first call at `--warm` rows under the
recorder (the library calls it notes), then, each timed on the host to the GPU's end:
  A  the first call at --plain-rows (no plans ahead), and its second call
  B  the plans made ahead for --ahead-rows (each recorded call at those rows: host s, GPU s), then the first call
     there and its second
  C  the same at the second of --ahead-rows
  D  the first call at the second of --plain-rows (no plans ahead), and its second
A and D bracket the rows' setup without the plans; B and C with them. Also a capture at --capture-rows after its
plans (no warm-up there) against one at rows with none.

    python benchmarks/probes/plan_prewarm.py OUT.json [--variant compiled] [--side 1024] [--warm 2]
        [--plain-rows 4,12] [--ahead-rows 6,16] [--capture-rows 8,10] [--cache DIR]
    python benchmarks/probes/plan_prewarm.py /tmp/p.json --model tiny --side 128 --cache DIR   # CPU: the calls only
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shape_setup import _capture, start_unet_probe, synced, unet_probe_args  # noqa: E402

from storyboard_cli.engine.kernels.plans import Recorder  # noqa: E402


def first_and_second(call, inputs, rows: int) -> dict:
    x = inputs(rows)
    first, _ = synced(lambda: call(*x))
    second, _ = synced(lambda: call(*x))
    return {"first_s": round(first, 3), "second_s": round(second, 3), "setup_s": round(first - second, 3)}


def ahead(recorded, rows: int) -> dict:
    """Each recorded call made at `rows`: host seconds of the lot, and the GPU's."""
    cuda = torch.cuda.is_available()
    calls = [c.at(rows) for c in recorded]
    if cuda:
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    if cuda:
        start.record()
    t0 = time.perf_counter()
    each = []
    for c in calls:
        t = time.perf_counter()
        c.run()
        each.append(time.perf_counter() - t)
    host = time.perf_counter() - t0
    if cuda:
        end.record()
        torch.cuda.synchronize()
    return {"calls": len(calls), "host_s": round(host, 3), "longest_call_ms": round(1000 * max(each, default=0), 1),
            "gpu_ms": round(start.elapsed_time(end), 2) if cuda else None}


def main() -> None:
    ap = unet_probe_args(__doc__)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--plain-rows", default="4,12")
    ap.add_argument("--ahead-rows", default="6,16")
    ap.add_argument("--capture-rows", default="8,10")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    rec, loaded = start_unet_probe(a)
    if loaded is None:
        return
    call, inputs = loaded
    plain, ahead_rows = list(map(int, a.plain_rows.split(","))), list(map(int, a.ahead_rows.split(",")))
    with torch.no_grad():
        x = inputs(a.warm)
        with Recorder(a.warm) as recorder:
            s, _ = synced(lambda: call(*x))
        recorded = recorder.recorded()
        rec.put("warm", {"rows": a.warm, "s": round(s, 3), "recorded": len(recorded),
                         "ops": dict(collections.Counter(c.op for c in recorded))})
        rec.put("A_plain", {"rows": plain[0], **first_and_second(call, inputs, plain[0])})
        for name, rows in (("B_ahead", ahead_rows[0]), ("C_ahead", ahead_rows[1])):
            made = ahead(recorded, rows)
            rec.put(name, {"rows": rows, "ahead": made, **first_and_second(call, inputs, rows)})
        rec.put("D_plain", {"rows": plain[1], **first_and_second(call, inputs, plain[1])})
        if cuda:
            pool, graphs, captures = torch.cuda.graph_pool_handle(), [], {}
            for name, rows in zip(("plain", "ahead"), map(int, a.capture_rows.split(","))):
                got = {"rows": rows}
                if name == "ahead":
                    got["ahead"] = ahead(recorded, rows)
                x = inputs(rows)
                graph = torch.cuda.CUDAGraph()
                graphs.append(graph)
                s, _ = synced(lambda: _capture(graph, pool, call, x))
                got["capture_s"] = round(s, 3)
                captures[name] = got
                rec.put("capture", captures)
    rec.put("done", True)


if __name__ == "__main__":
    main()
