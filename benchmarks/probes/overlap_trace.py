"""Where the host waits and the GPU idles between a render's batches: why a batch's inputs are not hidden behind the
batch before (docs/PERFORMANCE.md, issue 41, "The inputs are not hidden").

    python benchmarks/probes/overlap_trace.py micro OUT.json
        what blocks the host while another stream is busy: a pinned host allocation (new and cached), a device
        allocation on a side stream (bcg's allocator settings), a pageable copy on a side stream
    python benchmarks/probes/overlap_trace.py job OUT.json [--parts e_bcg_compiled,f_bcg_fp8] [--warmups rows]
        `bcg bench jobs/bench.yaml --parts PARTS` with the batch path traced: each call's host seconds (run_batch,
        the prompts' encoding, sample, the first-replay check, start_decode, flush; the text encoders, the graphs'
        prepare, kernel loads, captures before and beside the loop, each PNG's encode and write and its
        thumbnail, the contact sheet's updates, the files' drain and close) and the GPU's (each batch's inputs
        ready, its check, its first replay, its loop's end; the text encoders', prepare's and each capture's span),
        on one clock.
        `--warmups rows`: a compiled graph skips its warm-up where an earlier one ran the same variant, size and
        ControlNets at other rows.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch

T0 = time.perf_counter()
TRACE: list[dict] = []
REF: dict = {}  # the current render's reference event and its host time


def now() -> float:
    return time.perf_counter() - T0


def event() -> torch.cuda.Event | None:
    """A timing event recorded on the current stream; None on the CPU, and inside a graph's capture (the runner's
    `step` is what a capture records: an event recorded there is the graph's, and querying it is an error)."""
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def gpu_s(e) -> float | None:
    """A reached event on the host clock (the render's reference event was recorded on an idle GPU)."""
    if e is None or not REF or not e.query():
        return None
    return round(REF["host"] + REF["event"].elapsed_time(e) / 1000, 4)


# ---------------------------------------------------------------- micro


def micro(out: Path) -> None:
    from storyboard_cli.models.loader import cuda_allocator

    allocator = cuda_allocator()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t) / 20
    n = max(1, int(0.5 / per_mm))  # about 0.5 s of work
    side = torch.cuda.Stream()
    keep = []
    cached = torch.empty(48 << 20, dtype=torch.uint8, pin_memory=True)
    del cached  # a 64 MB block in the host cache now
    pageable = torch.empty(16 << 20, dtype=torch.uint8)

    def on_side(fn):
        def run():
            with torch.cuda.stream(side):
                keep.append(fn())
        return run

    ops = {
        "nothing": lambda: None,
        "pinned alloc, new size (25 MB)": lambda: keep.append(torch.empty(25 << 20, dtype=torch.uint8, pin_memory=True)),
        "pinned alloc, cached size (48 MB)": lambda: keep.append(torch.empty(48 << 20, dtype=torch.uint8,
                                                                              pin_memory=True)),
        "device alloc on a side stream, new 600 MB": on_side(lambda: torch.empty(600 << 20, dtype=torch.uint8,
                                                                                 device="cuda")),
        "device alloc on a side stream, new 1.2 GB": on_side(lambda: torch.empty(1200 << 20, dtype=torch.uint8,
                                                                                 device="cuda")),
        "pageable copy to the device on a side stream (16 MB)": on_side(lambda: pageable.to("cuda")),
        "a new stream": lambda: keep.append(torch.cuda.Stream()),
    }
    rows = []
    for name, op in ops.items():
        for repeat in range(2):
            torch.cuda.synchronize()
            start = event()
            for _ in range(n):
                torch.mm(a, a, out=c)
            busy = event()
            t0 = time.perf_counter()
            op()
            host_ms = (time.perf_counter() - t0) * 1000
            blocked = busy.query()  # the busy stream's work had ended when the call returned
            torch.cuda.synchronize()
            rows.append({"op": name, "repeat": repeat, "host_ms": round(host_ms, 2), "busy_ms": round(
                start.elapsed_time(busy), 1), "waited_for_the_busy_stream": blocked})
            print(rows[-1], flush=True)
            if name.startswith("device alloc"):
                keep.clear()
    out.write_text(json.dumps({"allocator": allocator, "torch": torch.__version__, "rows": rows}, indent=1))


# ---------------------------------------------------------------- the job, traced


def traced(owner, name: str, label: str, with_events: bool = False):
    """Wraps owner.name: each call's host span (and, `with_events`, a CUDA event at entry and exit) into TRACE. A
    name the code no longer has is said in TRACE once, not an error: the rest of the trace still runs."""
    fn = getattr(owner, name, None)
    if fn is None:
        TRACE.append({"what": f"not traced: {getattr(owner, '__name__', owner)}.{name} is gone", "host_in": 0.0})
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        row = {"what": label, "host_in": round(now(), 4)}
        if with_events:
            row["_ev_in"] = event()
        try:
            return fn(*args, **kwargs)
        finally:
            row["host_out"] = round(now(), 4)
            if with_events:
                row["_ev_out"] = event()
            TRACE.append(row)

    setattr(owner, name, wrapper)


def install(warmups: str) -> None:
    import storyboard_cli.engine.conditioning as conditioning_mod
    import storyboard_cli.engine.graph.check as check_mod
    import storyboard_cli.engine.graph.runner as runner_mod
    import storyboard_cli.folder.sink as sink
    import storyboard_cli.run.batch as batch
    import storyboard_cli.run.oom as oom
    import storyboard_cli.run.render as render_mod
    from storyboard_cli.engine.graph.keys import Warmed
    from storyboard_cli.engine.streams import Lanes
    from storyboard_cli.engine.variants import PLAIN

    original_render = render_mod.render

    def render(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            REF.update(event=event(), host=now())
            torch.cuda.synchronize()
        TRACE.append({"what": "render", "host_in": round(now(), 4)})
        try:
            return original_render(*args, **kwargs)
        finally:
            TRACE.append({"what": "render end", "host_in": round(now(), 4)})
            finish_rows()

    render_mod.render = render
    traced(batch.BatchRunner, "run_batch", "run_batch")
    traced(batch, "conditioning", "encode prompts")
    traced(batch.BatchRunner, "make_inputs", "make inputs")  # in its run_batch, or beside the loop before (ahead)
    traced(batch.BatchRunner, "start_decode", "start_decode")
    traced(Lanes, "to_host", "to_host")
    traced(oom.OutOfMemoryPolicy, "flush", "flush")
    traced(runner_mod, "first_replay", "check", with_events=True)
    # a batch's lead (its loop's entry to its second step's replay: (f)'s leads were 2.15 s beyond a replay each,
    # twenty-fifth session): the graphs planned, the check on its first step and the step outside the graph in it
    traced(runner_mod.GraphRunner, "_plan_graphs", "plan graphs", with_events=True)
    traced(runner_mod, "first_step", "first-step check", with_events=True)
    traced(runner_mod, "first_step_of_part", "first-step check, first images", with_events=True)
    # within it: the reference step's host time (its launches, a library's setup at its rows) against its GPU time,
    # and the comparison's wait (the forty-second session moved the check beside the loop and lost: which one to cut)
    traced(runner_mod.GraphRunner, "part_step", "check's reference step", with_events=True)
    traced(check_mod, "_compare", "check's comparison", with_events=True)
    traced(runner_mod.GraphRunner, "step", "step outside graph", with_events=True)
    traced(runner_mod.GraphRunner, "sample", "sample", with_events=True)
    # what can stay exposed at a render's start and end (the (f) job's 1.55 s outside denoising, twenty-third session)
    traced(conditioning_mod, "encode_text", "text encoders", with_events=True)
    traced(runner_mod.GraphRunner, "prepare", "prepare", with_events=True)
    traced(runner_mod.GraphRunner, "_bind", "kernel load")
    traced(runner_mod.GraphRunner, "_capture", "capture", with_events=True)
    traced(runner_mod.GraphRunner, "_warm_beside", "warm-up beside")
    traced(runner_mod.GraphRunner, "_capture_beside", "capture beside")
    traced(runner_mod, "make", "plan ahead")  # a library call made at a graph's rows before its capture (plans.py)
    traced(sink.OutputSink, "_land", "PNG encode+write")  # its thumbnail's too (`thumbnail`, within it)
    traced(sink.ContactSheet, "thumb", "thumbnail")
    traced(sink.OutputSink, "drain", "drain the files")
    traced(sink.OutputSink, "close", "close: the files' tail")  # the render's exposed `save`
    traced(sink.ContactSheet, "update", "contact sheet")
    original_finish = batch.BatchRunner.finish

    def finish(self, d):
        out = original_finish(self, d)
        t = d.done.timing
        if t is not None:
            TRACE.append({"what": "batch", "bucket": t.bucket, "host_in": gpu_s(t.start.event),
                          "inputs_host_s": round(t.inputs_s, 4), "gpu_inputs_ready": gpu_s(t.ready.event),
                          "gpu_loop_queued_from": gpu_s(t.start.event), "gpu_loop_end": gpu_s(t.end.event),
                          "gpu_before_end": gpu_s(t.before.event) if t.before else None,
                          "gpu_decode_start": gpu_s(d.start.event) if d.start else None,
                          "gpu_decode_end": gpu_s(d.end.event) if d.end else None})
            TRACE[-1]["host_in"] = TRACE[-1]["host_in"] or round(now(), 4)
        return out

    batch.BatchRunner.finish = finish
    if warmups == "rows":
        def covers(self, other) -> bool:  # rows need not match for a compiled variant: one artifact for all rows
            same = (self.variant, self.height, self.width) == (other.variant, other.height, other.width)
            rows = self.rows == other.rows or self.variant != PLAIN
            return same and rows and self.whole >= other.whole and not other.control & ~self.control
        Warmed.covers = covers


def finish_rows() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for row in TRACE:
        for k in ("_ev_in", "_ev_out"):
            if k in row:
                row[k.replace("_ev", "gpu")] = gpu_s(row.pop(k))


def job(out: Path, parts: str, warmups: str) -> None:
    install(warmups)
    from storyboard_cli.cli import main

    sys.argv = ["bcg", "bench", "jobs/bench.yaml", "--parts", parts, "--results", str(out.parent / "trace-bench")]
    if not torch.cuda.is_available():
        sys.argv.append("--quick")  # a smoke run on the CPU
    try:
        main()
    except SystemExit as e:
        print("bench exit", e.code, flush=True)
    finally:
        finish_rows()
        TRACE.sort(key=lambda r: r.get("host_in") or 0)
        out.write_text(json.dumps({"parts": parts, "warmups": warmups, "trace": TRACE}, indent=0))
        summary(TRACE)


def summary(trace: list[dict]) -> None:
    """Per batch: where the GPU idled between the loop before and this one's first replay, and the host's spans."""
    for row in trace:
        if row["what"] == "render":
            print(f"-- render at {row['host_in']:.2f}")
        elif row["what"] in ("batch",):
            print(f"   batch {row['bucket']}: inputs {row['inputs_host_s']:.3f} s host; GPU: before-loop end "
                  f"{row['gpu_before_end']}, inputs ready {row['gpu_inputs_ready']}, loop queued-from "
                  f"{row['gpu_loop_queued_from']}, loop end {row['gpu_loop_end']}, decode {row['gpu_decode_start']}"
                  f"-{row['gpu_decode_end']}")
        else:
            extra = "".join(f" {k}={row[k]}" for k in ("gpu_in", "gpu_out") if k in row)
            print(f"   {row['what']:<15} host {row['host_in']:.3f}-{row.get('host_out', 0):.3f}"
                  f" ({row.get('host_out', row['host_in']) - row['host_in']:.3f} s){extra}")


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    if mode == "micro":
        micro(out)
    else:
        job(out, args.get("--parts", "e_bcg_compiled,f_bcg_fp8"), args.get("--warmups", "same"))
