"""A render farm's first week on one machine's CPU: real `bcg serve` and `bcg worker` processes on the tiny model
(docs/PERFORMANCE.md, forty-seventh session). Run from the project root:

    PYTHONPATH=tests python benchmarks/probes/farm_probe.py soak [N]       # N jobs one after another (default 60)
    PYTHONPATH=tests python benchmarks/probes/farm_probe.py switch [N]     # N jobs queued at once (default 30)
    PYTHONPATH=tests python benchmarks/probes/farm_probe.py idle [N]       # N idle workers polling (default 64)
    PYTHONPATH=tests python benchmarks/probes/farm_probe.py restart [N]    # N queued jobs, then a restart (2000)
    PYTHONPATH=tests python benchmarks/probes/farm_probe.py hires          # a hires job, both kinds of worker

  soak     one worker renders N jobs in turn, a LoRA job, a ControlNet job and an IP-Adapter job with two nets by
           turns; every 6 jobs the server's and the worker's resident memory (MB), open files and threads, and at
           the end the model loads (`bcg_model_loads_total`)
  switch   N jobs with and without a ControlNet by turns, submitted before they render: the model loads
  idle     N registered workers asking for a lease every 0.5 s on an empty queue (threads of this process): the
           calls a second, the server's CPU and the calls' p50 and p99
  restart  N one-image jobs submitted (8 at once), the server killed and started again: the seconds until
           /healthz answers, then one call each of the job list, the queue, /metrics and a lease
  hires    tests/test_hires.py's job (two shots with a hires pass) on a worker on the server's folders, then on one
           with its own --root (--upload), --lease-s 10: the seconds to the end, the leases that expired
Each prints one JSON line per figure set. The folders go under a fresh temporary directory."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from helpers.serve import ONE_IMAGE_JOB, YAML, Server, free_port, metric, start_worker, stop

JOBS = Path(__file__).resolve().parents[2] / "jobs"
DONE = ("succeeded", "failed", "canceled")


def job(i: int, kinds: int = 3) -> str:
    """The i-th job of a turn of `kinds`: a LoRA job, a ControlNet job, an IP-Adapter job with two nets."""
    head = f"version: 1\nmodel: tiny\ndefaults: {{steps: 2, size: 64x64}}\n"
    k = i % kinds
    if k == 0:
        return (head + f"loras: {{mei: {JOBS}/loras/mei.safetensors}}\nshots:\n"
                f"  - {{id: p{i}, prompt: a castle {i}, seed: {i}, candidates: 2, lora: {{mei: 0.{i % 9 + 1}}}}}\n")
    if k == 1:
        return (head + "controlnet: tiny\nshots:\n"
                f"  - {{id: c{i}, prompt: a tower {i}, seed: {i}, candidates: 3, "
                f"control: {{image: {JOBS}/control/hero_pose.png, scale: 0.{i % 9 + 1}}}}}\n")
    return (head + "ip_adapter: tiny\ncontrolnets: {pose: tiny, depth: tiny}\nshots:\n"
            f"  - id: r{i}\n    prompt: mei {i}\n    seed: {i}\n"
            f"    reference: {{image: {JOBS}/refs/mei.png, scale: 0.5}}\n    control:\n"
            f"      - {{net: pose, image: {JOBS}/control/mei_pose.png, scale: 0.8}}\n"
            f"      - {{net: depth, image: {JOBS}/control/window_depth.png, scale: 0.5}}\n")


def proc(pid: int) -> list[int] | None:
    """[resident MB, open files, threads] of a process."""
    try:
        rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))
        return [rss // 1024, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))]
    except (OSError, StopIteration):
        return None


def cpu_s(pid: int) -> float:
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def submit(url: str, text: str) -> str:
    r = httpx.post(url + "/v1/jobs", content=text, headers=YAML, timeout=60)
    r.raise_for_status()
    return r.json()["id"]


def wait(url: str, job_id: str) -> str:
    while (state := httpx.get(f"{url}/v1/jobs/{job_id}", timeout=60).json()["state"]) not in DONE:
        time.sleep(0.05)
    return state


def soak(folder: Path, n: int) -> None:
    server = Server(folder / "root", free_port()).start(lease_s=30, gpus="none", extra=("--allow-dir", str(JOBS)))
    worker = start_worker(server.url, "soak")
    try:
        t0 = time.time()
        for i in range(n):
            state = wait(server.url, submit(server.url, job(i)))
            if state != "succeeded" or i % 6 == 0 or i == n - 1:
                print(json.dumps({"job": i, "state": state, "s": round(time.time() - t0, 1),
                                  "server": proc(server.proc.pid), "worker": proc(worker.pid)}), flush=True)
        print(json.dumps({"jobs": n, "model_loads": metric(server.url, "bcg_model_loads_total")}))
    finally:
        stop(worker)
        server.kill_everything()


def switch(folder: Path, n: int) -> None:
    server = Server(folder / "root", free_port()).start(lease_s=30, gpus="none", extra=("--allow-dir", str(JOBS)))
    worker = start_worker(server.url, "switch")
    try:
        t0 = time.time()
        ids = [submit(server.url, job(3 * i + i % 2)) for i in range(n)]  # LoRA and ControlNet jobs by turns
        states = [wait(server.url, i) for i in ids]
        print(json.dumps({"jobs": n, "succeeded": states.count("succeeded"), "s": round(time.time() - t0, 1),
                          "model_loads": metric(server.url, "bcg_model_loads_total")}))
    finally:
        stop(worker)
        server.kill_everything()


def idle(folder: Path, n: int, seconds: float = 15.0) -> None:
    server = Server(folder / "root", free_port()).start(lease_s=60, gpus="none", extra=("--max-workers", str(n)))
    ids = [httpx.post(server.url + "/v1/workers", json={"name": f"w{i}"}).json()["worker"] for i in range(n)]
    done, latencies = threading.Event(), []

    def poll(worker: str) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not done.is_set():
                t = time.perf_counter()
                client.post("/v1/leases", json={"worker": worker, "ready": True})
                latencies.append(time.perf_counter() - t)
                time.sleep(0.5)

    threads = [threading.Thread(target=poll, args=(w,), daemon=True) for w in ids]
    for t in threads:
        t.start()
    try:
        time.sleep(3)
        c0, n0, t0 = cpu_s(server.proc.pid), len(latencies), time.time()
        time.sleep(seconds)
        c1, n1, t1 = cpu_s(server.proc.pid), len(latencies), time.time()
        done.set()
        ms = sorted(latencies[n0:n1])
        print(json.dumps({"workers": n, "calls_per_s": round((n1 - n0) / (t1 - t0)),
                          "server_cpu_pct": round(100 * (c1 - c0) / (t1 - t0)),
                          "p50_ms": round(1000 * ms[len(ms) // 2], 1),
                          "p99_ms": round(1000 * ms[int(len(ms) * .99)], 1)}))
    finally:
        done.set()
        server.kill_everything()


def restart(folder: Path, n: int) -> None:
    server = Server(folder / "root", free_port())
    options = dict(lease_s=60, gpus="none", extra=("--max-queue-images", str(max(n, 1000))))
    server.start(**options)
    try:
        t = time.time()
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda i: submit(server.url, ONE_IMAGE_JOB.replace("seed: 1", f"seed: {i}")), range(n)))
        figures = {"jobs": n, "submitted_s": round(time.time() - t, 1)}
        server.kill_everything()
        t = time.time()
        server.start(**options)
        figures["restart_to_healthz_s"] = round(time.time() - t, 2)
        worker = httpx.post(server.url + "/v1/workers", json={"name": "w"}).json()["worker"]
        for name, call in (("list_50_ms", lambda: httpx.get(server.url + "/v1/jobs?limit=50", timeout=60)),
                           ("queue_ms", lambda: httpx.get(server.url + "/v1/queue", timeout=60)),
                           ("metrics_ms", lambda: httpx.get(server.url + "/metrics", timeout=60)),
                           ("lease_ms", lambda: httpx.post(server.url + "/v1/leases", json={"worker": worker},
                                                           timeout=60))):
            t = time.time()
            call().raise_for_status()
            figures[name] = round(1000 * (time.time() - t))
        print(json.dumps(figures))
    finally:
        server.kill_everything()


def hires(folder: Path, n: int) -> None:
    text = (Path(__file__).resolve().parents[2] / "tests" / "test_hires.py").read_text()
    job_text = text.split('RENDER = """')[1].split('"""')[0]
    for kind, extra in (("shared", ()), ("upload", ("--upload", "--root", str(folder / "elsewhere")))):
        server = Server(folder / kind, free_port()).start(lease_s=10, gpus="none")
        worker = start_worker(server.url, kind, *extra)
        try:
            t0 = time.time()
            state = wait(server.url, submit(server.url, job_text))
            print(json.dumps({"worker": kind, "state": state, "s": round(time.time() - t0, 1),
                              "lease_expiries": metric(server.url, "bcg_lease_expiries_total"),
                              "images_rendered": metric(server.url, "bcg_images_rendered_total")}), flush=True)
        finally:
            stop(worker)
            server.kill_everything()


if __name__ == "__main__":
    what = sys.argv[1]
    runs = {"soak": (soak, 60), "switch": (switch, 30), "idle": (idle, 64), "restart": (restart, 2000),
            "hires": (hires, 1)}
    run, default = runs[what]
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), int(sys.argv[2]) if len(sys.argv) > 2 else default)
