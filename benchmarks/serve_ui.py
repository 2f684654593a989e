"""The queue page's two numbers, on this machine's CPU (docs/SERVE.md, "The queue page"):

- `page`: the page (/ui) in headless Chromium, loaded until it is live (its stream open) and shows its first page of
  jobs, with `--jobs` jobs in the queue (default 1000: the page reads 50 at a time); and GET /v1/jobs alone.
- `stream`: the global event stream carrying `--rate` events per second (default 100: each a priority change, written
  through the API as a client would) to `--streams` readers for `--seconds`, while /healthz is asked every 50 ms: the
  events each reader received per second and /healthz's p50, p99 and worst.

    python benchmarks/serve_ui.py OUT.json [--jobs 1000] [--rate 100] [--seconds 20] [--streams 4]

A `bcg serve --gpus none` on a free port and a fresh root (no worker: nothing renders; the jobs stay queued) runs for
the whole measure and is stopped after it. One JSON record: the figures, the command, the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
JOB = "version: 1\nmodel: tiny\ndefaults: {{steps: 2, size: 64x64}}\nshots:\n  - {{id: a, prompt: shot {i}, seed: 1}}\n"
PAGE_LOADS = 7
HEALTH_EVERY_S = 0.05
WRITERS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, jobs: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "storyboard_cli", "serve", "--root", str(root), "--port", str(port),
                             "--gpus", "none", "--max-queue-images", str(jobs + 10)], cwd=ROOT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the server did not answer within 60 s")


def fill(url: str, jobs: int) -> tuple[list[str], float]:
    """`jobs` one-image jobs submitted (4 at a time); their ids and the seconds it took."""
    t0 = time.perf_counter()

    def one(i: int) -> str:
        r = httpx.post(url + "/v1/jobs", content=JOB.format(i=i), timeout=60,
                       headers={"Content-Type": "application/yaml", "X-Job-Filename": f"shot-{i}.yaml"})
        r.raise_for_status()
        return r.json()["id"]

    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(one, range(jobs)))
    return ids, time.perf_counter() - t0


def quantiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"n": len(s), "p50_ms": round(1000 * s[len(s) // 2], 2), "p99_ms": round(1000 * s[int(len(s) * 0.99)], 2),
            "max_ms": round(1000 * s[-1], 2)}


def page_load(url: str) -> dict:
    """Seconds from navigation to the page live with its first page of jobs, PAGE_LOADS times (the first cold)."""
    from playwright.sync_api import sync_playwright

    api = []
    for _ in range(20):
        t0 = time.perf_counter()
        httpx.get(url + "/v1/jobs", timeout=30).raise_for_status()
        api.append(time.perf_counter() - t0)
    loads = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for _ in range(PAGE_LOADS):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(url + "/ui")
            page.wait_for_selector('#conn[data-state="live"]', timeout=60_000)
            page.wait_for_selector("#jobs tbody tr:nth-child(50)", timeout=60_000)
            loads.append(time.perf_counter() - t0)
            rows = page.locator("#jobs tbody tr").count()
            page.close()
        browser.close()
    return {"rows": rows, "loads_s": [round(s, 3) for s in loads], "median_s": round(statistics.median(loads), 3),
            "worst_s": round(max(loads), 3), "api_jobs_page": quantiles(api)}


def stream(url: str, ids: list[str], rate: float, seconds: float, readers: int) -> dict:
    """`rate` events a second written (priority changes), `readers` streams following, /healthz probed."""
    stop = threading.Event()
    received = [0] * readers
    health: list[float] = []
    last = httpx.get(url + "/v1/queue", timeout=30).json()["last_event"]

    def read(k: int) -> None:
        with httpx.Client(timeout=None) as client:
            with client.stream("GET", f"{url}/v1/events?after={last}") as r:
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        received[k] += 1
                    if stop.is_set():
                        return

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                client.get(url + "/healthz").raise_for_status()
                health.append(time.perf_counter() - t0)
                time.sleep(max(HEALTH_EVERY_S - (time.perf_counter() - t0), 0))

    threads = [threading.Thread(target=read, args=(k,), daemon=True) for k in range(readers)]
    threads.append(threading.Thread(target=probe, daemon=True))
    for t in threads:
        t.start()
    time.sleep(1.0)  # the readers connected
    written, t0, priorities = [0] * WRITERS, time.perf_counter(), ("urgent", "normal", "bulk")

    def write(k: int) -> None:  # a client's changes, WRITERS of them at once: one alone waits on each answer
        with httpx.Client(timeout=30) as client:
            while (elapsed := time.perf_counter() - t0) < seconds:
                if written[k] < elapsed * rate / WRITERS:
                    n = written[k] * WRITERS + k
                    client.patch(f"{url}/v1/jobs/{ids[n % len(ids)]}", json={"priority": priorities[n % 3]}
                                 ).raise_for_status()
                    written[k] += 1
                else:
                    time.sleep(0.002)

    writers = [threading.Thread(target=write, args=(k,)) for k in range(WRITERS)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    written = sum(written)
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # the last events delivered
    stop.set()
    return {"events_written": written, "events_per_s_written": round(written / wall, 1),
            "events_per_s_received": [round(n / wall, 1) for n in received], "readers": readers,
            "every_event_received": all(n == written for n in received), "healthz": quantiles(health)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(Path(tmp) / "root", args.jobs)
        try:
            ids, fill_s = fill(url, args.jobs)
            record = {"command": " ".join(["python", "benchmarks/serve_ui.py", *sys.argv[1:]]),
                      "jobs": args.jobs, "fill_s": round(fill_s, 1), "load_before": os.getloadavg(),
                      "cpus": os.cpu_count(), "page": page_load(url),
                      "stream": stream(url, ids, args.rate, args.seconds, args.streams),
                      "load_after": os.getloadavg()}
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
