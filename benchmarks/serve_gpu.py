"""The render service's GPU figures that docs/SERVE.md leaves for later: a warm server starts a job within
1 s of its submission, `bcg serve` renders at >= 0.95x the steady images/s of `bcg render`, two GPUs at
>= 1.85x one. Three phases; each writes RESULTS/<phase>.json after each of its measurements and prints one
summary line when it ends, so a phase stopped by its limit loses only itself:

- render: job J (--images images of one size: 4 shots, fixed seeds) through `bcg render` on the first GPU:
  the process's wall time, the report's stages, images/s over the wall and steady (the report's wall less
  its load and capture stages).
- serve1: `bcg serve` with one worker on the first GPU. J first (the worker loads the model and captures the
  shapes), then J2 (J with other seeds, so dedup copies nothing): seconds from the POST's answer to J2's first
  lease, and J2's images/s from its submission to its success, against the render phase's steady images/s.
- serve2: one worker on each of the first two GPUs. A warm-up job per worker (submitted together, again until
  every worker has loaded the model), then one copy of J per worker with new seeds, submitted together: their
  images/s against serve1's J2. A job's batches are leased one at a time (one writer per job folder), so a
  single job keeps one worker busy: last, one job alone on the two workers, to show the rate it gets.

Lease and end times are the server's (its events' `at`, this machine's clock). Each phase has its deadline
(--deadline-s): when it passes (or on SIGTERM), the phase stops with a message naming what it waited for, the
server's process group is killed, and the script exits 1. A comparison reads the earlier phase from this run,
or from its JSON in RESULTS when it ran before with the same settings.

    python benchmarks/serve_gpu.py --gpus 0,1 --model sdxl-random --out RESULTS [--images 32] [--steps 20]
    python benchmarks/serve_gpu.py --gpus cpu,cpu --model tiny --images 8 --steps 2 --size 256x256 --out /tmp/sg
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.errors import StoryboardError
from storyboard_cli.folder.layout import REPORT_JSON, REPORT_MD, read_report
from storyboard_cli.serve import client
from storyboard_cli.serve.schedule import END, JobState

PHASES = ("render", "serve1", "serve2")
PROMPTS = ("the keeper climbs the lighthouse stairs", "storm waves hit the rocks", "a fishing boat in heavy rain",
           "wide shot of the harbour at night")  # J's shots, each with images / 4 candidates
SEEDS_PER_SET = 100_000  # shot i of seed set s starts at s * SEEDS_PER_SET + 1000 * (i + 1)
J, J2, J3, J4, WARM = 1, 2, (3, 4), 5, 10  # seed sets: J, J2, the serve2 pair, one job alone, warm-ups from 10
WARM_ROUNDS = 3
START_TARGET_S, SERVE_TARGET, TWO_GPU_TARGET = 1.0, 0.95, 1.85
STOP_GRACE_S = 20.0  # a clean drain on SIGTERM (idle workers), then the process group is killed


class Missed(Exception):
    """A phase's deadline passed."""


class Stopped(Missed):
    """SIGTERM: this phase stops, and the phases after it do not run."""


class Failed(Exception):
    """A phase's run did not give what it measures (a render's exit status, a job that failed)."""


@dataclass(frozen=True)
class Bench:
    gpus: tuple[str, ...]
    model: str
    images: int
    steps: int
    size: str
    compile: str
    deadline_s: float
    out: Path
    work: Path

    def settings(self) -> dict:
        """What a phase's figures depend on: an earlier phase's JSON is compared only when they match."""
        return {"model": self.model, "images": self.images, "steps": self.steps, "size": self.size,
                "compile": self.compile}

    def job(self, seed_set: int) -> str:
        """Job J with the seeds of `seed_set`: 4 shots of images/4 candidates, one size, buckets default."""
        shots = "".join(f"  - {{id: s{i + 1}, prompt: {json.dumps(p)}, candidates: {self.images // len(PROMPTS)}, "
                        f"seed: {seed_set * SEEDS_PER_SET + 1000 * (i + 1)}}}\n" for i, p in enumerate(PROMPTS))
        return (f"version: 1\nname: serve-bench\nmodel: {json.dumps(self.model)}\n"
                f"defaults: {{steps: {self.steps}, size: {self.size}, guidance: 5.0, sampler: euler}}\n"
                f"shots:\n{shots}")


class Deadline:
    """A phase's time limit (SIGALRM), and what it waits for now, which the message names. SIGTERM stops the
    phase the same way."""

    def __init__(self, seconds: float):
        self.seconds, self.what = seconds, "nothing yet"

    def __enter__(self) -> Deadline:
        signal.signal(signal.SIGALRM, self._ring)
        signal.signal(signal.SIGTERM, self._term)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def waiting_for(self, what: str) -> None:
        self.what = what

    def _ring(self, signum, frame) -> None:
        raise Missed(f"deadline of {self.seconds:g} s passed while waiting for {self.what}")

    def _term(self, signum, frame) -> None:
        raise Stopped(f"stopped by SIGTERM while waiting for {self.what}")


@contextmanager
def shielded():
    """Cleanup that neither the deadline nor SIGTERM may cut short."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGALRM, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process's group (started with start_new_session), whatever of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def write_job(folder: Path, label: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}.yaml"
    path.write_text(text)
    return path


def save(b: Bench, rec: dict) -> None:
    path = b.out / f"{rec['phase']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(path)


def earlier(b: Bench, phase: str, results: dict[str, dict]) -> dict | None:
    """The phase's record from this run, or from RESULTS when it ran there before with the same settings."""
    if phase in results:
        return results[phase]
    try:
        rec = json.loads((b.out / f"{phase}.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if rec.get("complete") and rec.get("settings") == b.settings() else None


def ratio(value: float, against: dict | None, path: tuple[str, ...], target: float | None) -> dict | None:
    """`value` over the figure at `path` in an earlier phase's record (None without one); `met` is None
    without a target."""
    if against is None:
        return None
    base = against
    for key in path:
        base = base[key]
    return {"against": base, "of": f"{against['phase']} {'.'.join(path)}, started {against['started']}",
            "ratio": round(value / base, 3), "target": target,
            "met": None if target is None else value / base >= target}


# ---------------------------------------------------------------- render


def render_phase(b: Bench, rec: dict, clock: Deadline) -> str:
    folder = b.work / "render"
    job, out = write_job(folder, "J", b.job(J)), folder / "out"
    env = dict(os.environ)
    argv = [sys.executable, "-m", "storyboard_cli", "render", str(job), "--out", str(out), "--compile", b.compile,
            "--quiet"]
    if b.gpus[0] == "cpu":
        argv += ["--device", "cpu"]
    else:
        env["CUDA_VISIBLE_DEVICES"] = b.gpus[0]
        argv += ["--device", "cuda"]
    rec["command"] = argv
    clock.waiting_for("`bcg render` of job J to exit")
    t0 = time.perf_counter()
    with open(b.out / "render.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            with shielded():
                kill_group(proc)
    wall = time.perf_counter() - t0
    report = read_report(out)
    if rc != 0 or report is None or report["images_rendered"] != b.images:
        got = f"{report['images_rendered']} images rendered" if report else "no report"
        raise Failed(f"`bcg render` exited {rc} with {got} (of {b.images}); see render.log")
    for name in (REPORT_JSON, REPORT_MD):
        shutil.copyfile(out / name, b.out / f"render-{name}")
    stages = report["stages_s"]
    rendering = report["wall_s"] - stages["load"] - stages["capture"]
    rec.update(process_wall_s=round(wall, 3), report_wall_s=report["wall_s"], stages_s=stages,
               device=report["device"], engine=report["engine"], dtype=report["dtype"],
               peak_memory_mb=report["peak_memory_mb"], buckets=report["buckets"],
               images_per_s=round(b.images / wall, 4), report_images_per_s=report["images_per_s"],
               steady_images_per_s=round(b.images / rendering, 4))
    return (f"render: {b.images} images in {wall:.1f} s (process), report {report['wall_s']:.1f} s (load "
            f"{stages['load']:.1f}, capture {stages['capture']:.1f}): {rec['images_per_s']:.3f} images/s over the "
            f"wall, {rec['steady_images_per_s']:.3f} steady")


# ---------------------------------------------------------------- serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> tuple[str, dict[str, float]]:
    """/metrics as text, and each sample name's value summed over its labels (counters, histogram sums and
    counts, gauges)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return text, values


class Server:
    """`bcg serve` in its own process group, its output (and its workers') in RESULTS/<phase>-server.log; its
    pid in RESULTS/<phase>-server.pid while it runs, for the shell wrapper to kill what a killed script left."""

    def __init__(self, b: Bench, phase: str, gpus: tuple[str, ...]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.pidfile = b.out / f"{phase}-server.log", b.out / f"{phase}-server.pid"
        self.argv = [sys.executable, "-m", "storyboard_cli", "serve", "--root", str(b.work / phase / "root"),
                     "--port", str(self.port), "--gpus", ",".join(gpus), "--compile", b.compile]
        model = Path(b.model).expanduser()
        if model.exists():  # a local model must lie under the server's folders
            self.argv += ["--allow-dir", str(model.resolve().parent)]
        self.exit_code: int | None = None

    def __enter__(self) -> Server:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pidfile.write_text(f"{self.proc.pid}\n")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with shielded():
            if exc_type is None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # the drain: idle workers stop, the server exits 0
                try:
                    self.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            self.exit_code = self.proc.poll()
            kill_group(self.proc)
            self.pidfile.unlink(missing_ok=True)

    def wait_healthy(self, clock: Deadline) -> float:
        """Seconds until /healthz answers 200."""
        clock.waiting_for(f"{self.url}/healthz")
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"`bcg serve` exited {self.proc.returncode} before answering: see {self.log.name}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)


def follow(url: str, view: dict, answered: float, label: str, clock: Deadline, live: bool) -> dict:
    """One submitted job followed through its events to its end: when its first image was leased (the
    server's clock), when it ended, which workers leased its batches; `live`: followed from its submission,
    so `start_seen_s` (when this script saw the first lease) is true."""
    clock.waiting_for(f"job {label} ({view['id']}) to end")
    workers: list[str] = []
    first_lease = seen = end = None
    for event in client.events(url, view["id"]):
        if event.kind == "running":
            workers.append(event.data["worker"])
            if first_lease is None:
                first_lease, seen = event.data["at"], time.time()
        elif event.kind == END:
            end = event.data["at"]
    job = client.get_job(url, view["id"])
    if job["state"] != JobState.SUCCEEDED or first_lease is None or end is None:
        reasons = sorted({i["reason"] for i in job["images"] if i["reason"]})
        raise Failed(f"job {label} ({view['id']}) ended {job['state']}: {'; '.join(reasons) or 'no reason given'}")
    return {"label": label, "id": view["id"], "images": len(job["images"]),
            "cached": sum(i["cached"] for i in job["images"]), "submitted": view["submitted"], "answered": answered,
            "first_lease": first_lease, "end": end, "start_s": round(first_lease - answered, 4),
            "start_seen_s": round(seen - answered, 4) if live else None, "seconds": round(end - view["submitted"], 4),
            "leases_by_worker": dict(Counter(workers))}


def run_jobs(b: Bench, folder: Path, url: str, jobs: list[tuple[str, int]], workers: int, clock: Deadline) -> dict:
    """Copies of J (label, seed set), each POSTed as soon as the one before is answered, then each followed to
    its end: their images/s from the first POST to the last end, and how busy the workers were (their batches'
    seconds, from /metrics, over the workers' time)."""
    paths = [write_job(folder, label, b.job(seed_set)) for label, seed_set in jobs]
    clock.waiting_for(f"{url}/metrics")
    before = scrape(url)[1]
    posted = time.time()
    answers = []
    for path in paths:
        clock.waiting_for(f"the answer to the POST of {path.name}")
        answers.append((client.submit(path, url), time.time(), path.stem))
    followed = [follow(url, view, answered, label, clock, live=i == 0)
                for i, (view, answered, label) in enumerate(answers)]
    clock.waiting_for(f"{url}/metrics")
    after = scrape(url)[1]
    images = sum(f["images"] for f in followed)
    seconds = max(f["end"] for f in followed) - posted
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
             ("bcg_batch_seconds_sum", "bcg_batch_seconds_count", "bcg_images_rendered_total",
              "bcg_images_cached_total", "bcg_model_loads_total")}
    return {"jobs": followed, "images": images, "seconds": round(seconds, 4),
            "images_per_s": round(images / seconds, 4),
            "images_per_s_from_submitted": round(images / (max(f["end"] for f in followed)
                                                          - min(f["submitted"] for f in followed)), 4),
            "batches": int(delta["bcg_batch_seconds_count"]),
            "batch_seconds": round(delta["bcg_batch_seconds_sum"], 4),
            "busy_fraction": round(delta["bcg_batch_seconds_sum"] / (workers * seconds), 4),
            "rendered": int(delta["bcg_images_rendered_total"]), "cached": int(delta["bcg_images_cached_total"]),
            "model_loads": int(delta["bcg_model_loads_total"])}


def warm_up(b: Bench, folder: Path, url: str, workers: int, clock: Deadline) -> dict:
    """J itself (and with more workers, one copy of J per worker, other seeds), submitted together, again until
    every worker has loaded the model (a worker that started late may find every job taken)."""
    t0, rounds = time.time(), []
    for r in range(WARM_ROUNDS):
        sets = [J if (r, w) == (0, 0) else WARM + r * workers + w for w in range(workers)]
        labels = ["J" if s == J else f"W{r}{w}" for w, s in enumerate(sets)]
        rounds.append(run_jobs(b, folder, url, list(zip(labels, sets)), workers, clock))
        loads = sum(x["model_loads"] for x in rounds)
        if loads >= workers:
            return {"rounds": rounds, "seconds": round(time.time() - t0, 3), "model_loads": loads}
    raise Failed(f"{workers} workers but {loads} model loads after {WARM_ROUNDS} warm-up rounds: see the server log")


def serve_phase(b: Bench, rec: dict, clock: Deadline, results: dict[str, dict]) -> str:
    phase = rec["phase"]
    gpus = b.gpus[:1] if phase == "serve1" else b.gpus[:2]
    folder = b.work / phase / "jobs"
    with Server(b, phase, gpus) as server:
        rec.update(command=server.argv, gpus=list(gpus))
        try:
            rec["healthy_after_s"] = round(server.wait_healthy(clock), 3)
            rec["warm_up"] = warm_up(b, folder, server.url, len(gpus), clock)
            save(b, rec)
            if phase == "serve1":
                m = rec["J2"] = run_jobs(b, folder, server.url, [("J2", J2)], 1, clock)
                start = m["jobs"][0]["start_s"]
                rec["start"] = {"seconds": start, "target": START_TARGET_S, "met": start <= START_TARGET_S}
                render = earlier(b, "render", results)
                rec["against_render"] = ratio(m["images_per_s"], render, ("steady_images_per_s",), SERVE_TARGET)
            else:
                m = rec["J3"] = run_jobs(b, folder, server.url, [(f"J3{'ab'[i]}", s) for i, s in enumerate(J3)],
                                         len(gpus), clock)
                one = earlier(b, "serve1", results)
                rec["against_serve1"] = ratio(m["images_per_s"], one, ("J2", "images_per_s"), TWO_GPU_TARGET)
                save(b, rec)
                m = rec["one_job"] = run_jobs(b, folder, server.url, [("J4", J4)], len(gpus), clock)
                rec["one_job_against_serve1"] = ratio(m["images_per_s"], one, ("J2", "images_per_s"), None)
        finally:
            try:
                (b.out / f"{phase}-metrics.txt").write_text(scrape(server.url)[0])
            except httpx.HTTPError as e:
                rec["metrics_error"] = str(e)
    rec["server_exit"] = server.exit_code
    return serve_summary(rec)


def serve_summary(rec: dict) -> str:
    def versus(c: dict | None, what: str) -> str:
        if c is None:
            return f"(no {what} to compare)"
        return f"= {c['ratio']:.3f}x {what} (target >= {c['target']:g}: {'met' if c['met'] else 'MISSED'})"

    w = rec["warm_up"]
    head = f"{rec['phase']}: warm-up {w['seconds']:.1f} s ({len(w['rounds'])} round(s), {w['model_loads']} model loads)"
    if rec["phase"] == "serve1":
        m, s = rec["J2"], rec["start"]
        return (f"{head}; J2 first lease {s['seconds']:.3f} s after the answer (target <= {s['target']:g} s: "
                f"{'met' if s['met'] else 'MISSED'}); {m['images']} images in {m['seconds']:.2f} s: "
                f"{m['images_per_s']:.3f} images/s, workers busy {m['busy_fraction']:.0%} "
                f"{versus(rec['against_render'], 'render steady')}")
    m, one, alone = rec["J3"], rec["one_job"], rec["one_job_against_serve1"]
    return (f"{head}; J3 (2 jobs) {m['images']} images in {m['seconds']:.2f} s: {m['images_per_s']:.3f} images/s, "
            f"workers busy {m['busy_fraction']:.0%} {versus(rec['against_serve1'], 'serve1 J2')}; one job alone: "
            f"{one['images_per_s']:.3f} images/s ({alone['ratio'] if alone else '?'}x serve1 J2), leases by worker "
            f"{one['jobs'][0]['leases_by_worker']}")


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None) -> tuple[Bench, list[str], bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", required=True, help="GPU indices or cpu, comma-separated: render and serve1 use the "
                                                 "first, serve2 the first two (0,1 or cpu,cpu)")
    p.add_argument("--model", default="sdxl-random")
    p.add_argument("--out", type=Path, required=True, help="RESULTS: the phases' JSON, logs and /metrics")
    p.add_argument("--images", type=int, default=32, help="images of job J, a multiple of 4 (default 32: four "
                                                          "batches of 8)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--compile", default="off", choices=("auto", "on", "off"),
                   help="for every render and worker (default off: no background builds while timing)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="each phase's limit")
    p.add_argument("--work", type=Path, help="job folders and queues (default: a temporary folder, removed)")
    a = p.parse_args(argv)
    gpus = tuple(g.strip() for g in a.gpus.split(",") if g.strip())
    phases = [s.strip() for s in a.phases.split(",") if s.strip()]
    if a.images < len(PROMPTS) or a.images % len(PROMPTS):
        p.error(f"--images must be a positive multiple of {len(PROMPTS)}")
    if unknown := [s for s in phases if s not in PHASES]:
        p.error(f"unknown phase(s) {', '.join(unknown)}: use {', '.join(PHASES)}")
    if a.deadline_s <= 0:
        p.error("--deadline-s must be positive")
    if not gpus or ("serve2" in phases and len(gpus) < 2):
        p.error("--gpus: serve2 needs two entries (0,1 or cpu,cpu)")
    work = a.work or Path(tempfile.mkdtemp(prefix="serve-gpu-"))
    a.out.mkdir(parents=True, exist_ok=True)
    b = Bench(gpus, a.model, a.images, a.steps, a.size, a.compile, a.deadline_s, a.out.resolve(), work.resolve())
    return b, phases, a.work is None


def main(argv: list[str] | None = None) -> int:
    b, phases, temporary = parse(argv)
    results: dict[str, dict] = {}
    failed = []
    try:
        for phase in phases:
            rec = {"phase": phase, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": b.settings(),
                   "complete": False}
            try:
                with Deadline(b.deadline_s) as clock:
                    line = render_phase(b, rec, clock) if phase == "render" else serve_phase(b, rec, clock, results)
            except (Missed, Failed, StoryboardError, httpx.HTTPError, OSError) as e:
                rec["error"] = f"{e.__class__.__name__}: {e}"
                save(b, rec)
                failed.append(phase)
                print(f"{phase}: FAILED: {rec['error']}", flush=True)
                if isinstance(e, Stopped):
                    break
                continue
            rec["complete"] = True
            save(b, rec)
            results[phase] = rec
            print(line, flush=True)
    finally:
        if temporary:
            shutil.rmtree(b.work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
