"""How many graph replays can the host queue before a launch blocks, and does CUDA's launch-queue scale change it
(issue 41, docs/PERFORMANCE.md 2026-12-06, thirty-fifth session)? A render's loop queues a replay, then runs a piece of
host work (the next batch's kernel loads, warm-up, capture, prompts) while the GPU runs what is queued: a piece longer
than the GPU time queued ahead of it leaves the GPU idle. The trace of 2026-12-02 found the launch queue full after
about one replay of the UNet's step (about 1,900 kernels).

    python benchmarks/probes/queue_probe.py OUT.json [--kernels 1900] [--steps-ms 30,230] [--replays 12]
        [--scales default,2x,4x] [--pieces-ms 0,100,300]

Each scale runs in a fresh process with CUDA_SCALE_LAUNCH_QUEUES set to it (`default`: unset) before CUDA starts.
There a graph of `--kernels` kernels is captured whose replay takes about each of `--steps-ms` (small elementwise
kernels and enough 4096² fp16 matmuls), and for each:
  launch_ms   the host's ms in each of `--replays` back-to-back `replay()` calls (a blocked launch takes about a step)
  queued      how many replays were queued before the first launch that blocked (over half a step)
  loop        per piece length P of `--pieces-ms`: the loop of bcg's runner before the thirty-fifth session (two
              replays queued, then a piece after each replay; the piece a host sleep of P ms), its GPU wall from the
              first replay's start to the last one's end, against the replays' own GPU time (`idle_ms`: the GPU idle
              under the pieces)
  paced       the same pieces (one fewer than the replays) run by today's loop (engine/graph/pace.py `Pace`:
              while four replays are queued, or after a launch that waited), the pieces left after its last replay
              (`left`: how many)"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def child(kernels: int, steps_ms: list[float], replays: int, pieces_ms: list[float]) -> dict:
    import torch

    from storyboard_cli.engine.graph.pace import Pace

    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    small = torch.zeros(256, device=dev)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.mm(a, b)
    end.record()
    torch.cuda.synchronize()
    mm_ms = start.elapsed_time(end) / 20
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mm_ms": round(mm_ms, 4),
           "scale": os.environ.get("CUDA_SCALE_LAUNCH_QUEUES", "default"), "steps": []}
    c = torch.empty_like(a)
    for target in steps_ms:
        mms = max(1, round(target / mm_ms))
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):  # a warm-up outside the capture
            small.add_(1.0)
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        every = max(1, (kernels - mms) // mms)
        with torch.cuda.graph(graph, stream=stream):
            done = 0
            for k in range(kernels - mms):
                small.add_(1.0)
                if k % every == 0 and done < mms:
                    torch.mm(a, b, out=c)
                    done += 1
            for _ in range(mms - done):
                torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        step_ms = start.elapsed_time(end)
        launch = []
        for _ in range(replays):
            t = time.perf_counter()
            graph.replay()
            launch.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        blocked = next((i for i, ms in enumerate(launch) if ms > step_ms / 2), None)
        loops = []
        for piece in pieces_ms:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            first.record()
            t = time.perf_counter()
            for i in range(replays):
                graph.replay()
                if i + 1 >= 2 and piece:
                    time.sleep(piece / 1e3)
            host_s = time.perf_counter() - t
            last.record()
            torch.cuda.synchronize()
            wall = first.elapsed_time(last)
            loops.append({"piece_ms": piece, "gpu_wall_ms": round(wall, 2), "idle_ms": round(wall - replays * step_ms, 2),
                          "host_ms": round(host_s * 1e3, 2)})
        paced = []
        for piece in pieces_ms:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            pace, between = Pace(True), iter([lambda: time.sleep(piece / 1e3)] * (replays - 1))
            first.record()
            for _ in range(replays):
                pace.replay(graph)
                between = pace.run(between)
            last.record()
            left = 0 if between is None else len(list(between))  # the pieces the loop would run after its end
            torch.cuda.synchronize()
            wall = first.elapsed_time(last)
            paced.append({"piece_ms": piece, "gpu_wall_ms": round(wall, 2), "idle_ms": round(wall - replays * step_ms, 2),
                          "left": left})
        out["steps"].append({"target_ms": target, "kernels": kernels, "matmuls": mms, "step_ms": round(step_ms, 3),
                             "launch_ms": [round(x, 3) for x in launch], "queued": blocked, "loop": loops,
                             "paced": paced})
        del graph
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--kernels", type=int, default=1900)
    ap.add_argument("--steps-ms", default="30,230")
    ap.add_argument("--replays", type=int, default=12)
    ap.add_argument("--scales", default="default,2x,4x")
    ap.add_argument("--pieces-ms", default="0,100,300")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    steps = [float(x) for x in a.steps_ms.split(",")]
    pieces = [float(x) for x in a.pieces_ms.split(",")]
    if a.child:
        a.out.write_text(json.dumps(child(a.kernels, steps, a.replays, pieces), indent=1))
        return
    rows = []
    for scale in a.scales.split(","):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_SCALE_LAUNCH_QUEUES"}
        if scale != "default":
            env["CUDA_SCALE_LAUNCH_QUEUES"] = scale
        part = a.out.with_suffix(f".{scale}.json")
        done = subprocess.run([sys.executable, __file__, str(part), "--child", "--kernels", str(a.kernels),
                               "--steps-ms", a.steps_ms, "--replays", str(a.replays), "--pieces-ms", a.pieces_ms],
                              env=env, timeout=600)
        rows.append(json.loads(part.read_text()) if done.returncode == 0 and part.is_file()
                    else {"scale": scale, "failed": done.returncode})
        part.unlink(missing_ok=True)
        for step in rows[-1].get("steps", []):
            print(f"{scale:8s} step {step['step_ms']:7.2f} ms  queued before a blocked launch: {step['queued']}  "
                  + "  ".join(f"piece {x['piece_ms']:.0f} ms: idle {x['idle_ms']:.0f} ms" for x in step["loop"])
                  + "  paced: " + "  ".join(f"{x['piece_ms']:.0f} ms: idle {x['idle_ms']:.0f} ms, {x['left']} left"
                                            for x in step["paced"]), flush=True)
    a.out.write_text(json.dumps({"runs": rows}, indent=1))


if __name__ == "__main__":
    main()
