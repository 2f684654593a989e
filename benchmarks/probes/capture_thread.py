"""Can a graph be captured while the GPU runs the batch before (issue 41, docs/PERFORMANCE.md 2026-12-03)? The host
thread is held in a loop's replays until the GPU is about one replay from the loop's end (the launch queue is full:
`overlap_trace.py`), so a capture queued after the loop on that thread runs when the loop has all but ended. This
probe captures on a second thread instead, while the first replays (`CUDAGraph.replay` lets go of the GIL).

    python benchmarks/probes/capture_thread.py OUT.json [--model sdxl-random] [--side 1024] [--rows 8] [--steps 30]
        [--repeats 3]

On the UNet at `--side` (eager modules, fp16, cuDNN; the product's allocator settings), graph A at `--rows` is
captured first; then, each mode `--repeats` times, a new graph B at half the rows, on inputs of its own:
  alone   the replays of A with nothing beside them (the loop's own seconds)
  after   `--steps` replays of A queued on the main thread, then B captured there (thread-local mode, own stream)
  between B captured on the main thread between A's second replay and its third (the engine's `between` pieces)
  thread  B captured on a second thread while the main thread queues the replays of A
  warm    the same, B's two warm-up steps on that thread first (on a side stream: its GPU work beside the loop's)
B is warmed up on an idle GPU beforehand in every mode but `warm`, so that only the capture is timed. The second thread
is one long-lived thread that has run the UNet once before (its cuDNN and cuBLAS handles are its own, and a handle
made during a capture invalidates it: the first run of this probe, 2026-12-03). Each row: the
capture's host seconds, whether A's loop was still running when the capture ended (`hid`), the loop's GPU seconds
against `alone`; in `alone`, a Python counter's rate on a second thread while the main thread replays, against its
rate beside an idle main thread (the GIL)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from storyboard_cli.models.loader import cuda_allocator, load_sdxl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    allocator = cuda_allocator()
    unet = load_sdxl(a.model, None, "cuda", torch.float16).unet
    lat = a.side // 8
    ctx, pooled = unet.config.cross_attention_dim, (unet.config.projection_class_embeddings_input_dim
                                                   - 6 * unet.config.addition_time_embed_dim)

    def inputs(rows: int) -> dict:  # drawn on the CPU: a failed capture leaves the CUDA generator unusable
        def r(*shape: int) -> torch.Tensor:
            return torch.randn(*shape).to("cuda", torch.float16)
        return {"x": r(rows, 4, lat, lat), "c": r(rows, 77, ctx), "p": r(rows, pooled),
                "ids": torch.tensor([[a.side, a.side, 0, 0, a.side, a.side]] * rows, device="cuda",
                                    dtype=torch.float16),
                "t": torch.tensor(500.0, device="cuda")}

    def step(v: dict) -> None:
        out = unet(v["x"], v["t"], v["c"], added_cond_kwargs={"text_embeds": v["p"], "time_ids": v["ids"]}).sample
        v["x"].copy_(v["x"] - 1e-3 * out)

    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()

    def warm(v: dict) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                step(v)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(v: dict, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, float]:
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.no_grad():
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                step(v)
            finally:
                g.capture_end()
        return g, time.perf_counter() - t0

    A = inputs(a.rows)
    warm(A)
    graph_a, a_capture_s = capture(A, torch.cuda.Stream())
    torch.cuda.synchronize()

    def loop(between=None, mark=None) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """The replays of A queued from the main thread (`mark` recorded and `between` run after the second); returns
        the loop's start and end events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(a.steps):
            graph_a.replay()
            if i == 1 and between is not None:
                mark.record()
                between()
        end.record()
        return start, end

    beside_thread = ThreadPoolExecutor(max_workers=1)  # the second thread, its handles made outside any capture
    beside_thread.submit(warm, inputs(1)).result()
    rows = []
    counting = {"on": False, "n": 0}

    def counter() -> None:
        while counting["on"]:
            counting["n"] += 1

    counting.update(on=True, n=0)  # the counter's rate with the main thread idle
    tc = threading.Thread(target=counter)
    tc.start()
    time.sleep(0.5)
    counting["on"] = False
    tc.join()
    idle_rate = round(counting["n"] / 500, 1)
    for mode in ("alone", "after", "between", "thread", "warm") * a.repeats:
        B = inputs(max(1, a.rows // 2))
        if mode != "warm":
            warm(B)
        row: dict = {"mode": mode}
        recording = torch.cuda.Stream()
        counting.update(on=mode == "alone", n=0)  # the GIL while the main thread replays, nothing else beside
        tc = threading.Thread(target=counter)
        done: dict = {}
        t0 = time.perf_counter()
        tc.start()
        if mode in ("thread", "warm"):
            def beside() -> None:
                try:
                    captured_beside()
                except Exception as e:  # noqa: BLE001 - the row says why
                    done["error"] = f"{type(e).__name__}: {e}"[:300]

            def captured_beside() -> None:
                if mode == "warm":
                    w0 = time.perf_counter()
                    with torch.cuda.stream(recording), torch.no_grad():
                        for _ in range(2):
                            step(B)
                    done["warmup_s"] = time.perf_counter() - w0
                done["graph"], done["capture_s"] = capture(B, recording)
                done["at"] = time.perf_counter() - t0
            tb = beside_thread.submit(beside)

        def between() -> None:
            done["graph"], done["capture_s"] = capture(B, recording)
            done["at"] = time.perf_counter() - t0
            done["queued"] = not end_of_two.query()  # replays were still queued when the capture ended

        end_of_two = torch.cuda.Event()
        start, end = loop(between, end_of_two) if mode == "between" else loop()
        if mode == "between":
            row["hid"] = done.pop("queued")
        row["replays_queued_s"] = round(time.perf_counter() - t0, 3)
        if mode == "after":
            done["graph"], done["capture_s"] = capture(B, recording)
            done["at"] = time.perf_counter() - t0
            row["hid"] = not end.query()  # the loop still ran when the capture ended
        if mode in ("thread", "warm"):
            tb.result()
            if "error" in done:
                row["error"] = done["error"]
            else:
                row["hid"] = not end.query() or done["at"] < row["replays_queued_s"]
        count_window = time.perf_counter() - t0
        counting["on"] = False
        tc.join()
        end.synchronize()
        row["loop_gpu_s"] = round(start.elapsed_time(end) / 1000, 3)
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        if mode == "alone":
            row["counter_per_ms"] = round(counting["n"] / (count_window * 1000), 1)
        if "at" in done:
            row["capture_s"] = round(done["capture_s"], 3)
            if "warmup_s" in done:
                row["warmup_s"] = round(done["warmup_s"], 3)
            row["capture_ended_at_s"] = round(done["at"], 3)
            done["graph"].replay()  # the graph B works
            torch.cuda.synchronize()
        rows.append(row)
        print(row, flush=True)
    a.out.write_text(json.dumps({"allocator": allocator, "torch": torch.__version__,
                                 "device": torch.cuda.get_device_name(), "model": a.model, "side": a.side,
                                 "rows": a.rows, "steps": a.steps, "a_capture_s": round(a_capture_s, 3),
                                 "counter_per_ms_idle": idle_rate,
                                 "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
