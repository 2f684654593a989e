"""One job on every worker that asks, against real `bcg serve` and `bcg worker` processes on the tiny model: a
40-image job over 3 workers started at different times (each late one while the first is paused; one killed with -9
mid-job) gives exactly what `bcg render` gives (pixels, one manifest line per image, the report's totals); the late
workers get its batches and render at the same time as the first; then, with two jobs queued at once, the urgent one ends first and the other ends too."""

import json
import os
import signal
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from storyboard_cli.folder.layout import MANIFEST, REPORT_JSON
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render
from storyboard_cli.serve import client

from conftest import write_job
from helpers.serve import (Server, eventually, free_port, holds_a_lease, slow_batches, start_worker, stop,
                           worker_ids)

JOB = """version: 1
model: tiny
buckets: [1, 2]
defaults: {steps: 4, size: 96x96, candidates: 4}
shots:
""" + "".join(f"  - {{id: s{n:02d}, prompt: panel {n} of the lighthouse, seed: {100 + n}}}\n" for n in range(10))
SMALL = """version: 1
model: tiny
name: NAME
buckets: [2]
defaults: {steps: 2, size: 64x64, candidates: 2}
shots:
""" + "".join(f"  - {{id: p{n}, prompt: page {n}, seed: {n}}}\n" for n in range(4))
FINAL = ("succeeded", "failed", "canceled")
DEADLINE_S = 240  # three workers loading the model at once on a loaded 2-core machine


def post(url, text, priority="normal"):
    r = httpx.post(f"{url}/v1/jobs", params={"priority": priority}, content=text,
                   headers={"Content-Type": "application/yaml"}, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def leases(url, job_id):
    """Each completed lease of the job: (worker, start, end) from its event stream (`running`, then `images`)."""
    start, spans = {}, []
    for e in client.events(url, job_id, timeout_s=30):
        if e.kind == "running":
            start[e.data["lease"]] = (e.data["worker"], e.data["at"])
        elif e.kind == "images" and e.data.get("lease") in start:
            worker, t0 = start.pop(e.data["lease"])
            spans.append((worker, t0, e.data["at"]))
    return spans


@pytest.mark.slow
def test_one_job_over_three_workers_joining_at_different_times_one_killed_equals_bcg_render(tmp_path, tiny_cpu,
                                                                                           monkeypatch):
    server = Server(tmp_path / "root", free_port()).start(lease_s=3, gpus="none")
    monkeypatch.setenv("BCG_LOG", "info")  # the workers' logs: what a failure to take a lease shows
    workers = []
    try:
        job_id = post(server.url, JOB)
        workers.append(_start_logged(server.url, "first", tmp_path))
        server.wait(job_id, lambda j: j["images_by_state"].get("done", 0) >= 1)  # the first batch is in
        # each late worker joins while the first is paused (SIGSTOP: its lease expires and goes back to the queue),
        # so the job still has batches for it however long its start takes on a loaded machine
        os.killpg(workers[0].pid, signal.SIGSTOP)
        # its first batch waits for its -9: rendering 0.04 s batches, it had drained the job before the test could kill
        # it, and the late worker found nothing to lease
        doomed = _start_logged(server.url, "doomed", tmp_path, fault=holds_a_lease(tmp_path / "doomed"))
        workers.append(doomed)
        _takes_a_lease(server.url, job_id, "doomed", tmp_path)
        os.killpg(doomed.pid, signal.SIGKILL)  # mid-job, holding a lease: it expires and goes back to the queue
        # the second's batches take a second longer: it cannot drain the job's 0.04 s batches before the first,
        # resumed, leases again (on a loaded machine that took it 5 s, and the two never rendered at once)
        workers.append(_start_logged(server.url, "second", tmp_path, fault=slow_batches(tmp_path / "second", 1.0)))
        _takes_a_lease(server.url, job_id, "second", tmp_path)
        os.killpg(workers[0].pid, signal.SIGCONT)  # the first and the second render the rest side by side
        done = eventually(lambda: server.job(job_id), lambda j: j["state"] in FINAL, timeout_s=DEADLINE_S)
        assert done["state"] == "succeeded", done
        spans = leases(server.url, job_id)
        report = tmp_path / "root" / "jobs" / job_id / "out" / REPORT_JSON  # rebuilt once more after the job's end
        eventually(lambda: json.loads(report.read_text()) if report.is_file() else {},
                   lambda r: r.get("status") == "done", 30)
    finally:
        for w in workers:
            stop(w)
        server.kill_everything()

    by_worker = {}
    for worker, t0, t1 in spans:
        by_worker.setdefault(worker, []).append((t0, t1))
    assert len(by_worker) >= 2, by_worker  # the late workers got the job's batches
    overlapping = [(a, b) for wa, sa in by_worker.items() for wb, sb in by_worker.items() if wa < wb
                   for a in sa for b in sb if a[0] < b[1] and b[0] < a[1]]
    assert overlapping, spans  # two workers rendered batches of the one job at the same time

    out = tmp_path / "root" / "jobs" / job_id / "out"
    ref = tmp_path / "ref"
    path = write_job(tmp_path, JOB)
    assert render(load_job(path), RenderOptions(out_dir=ref), models=tiny_cpu).rendered == 40
    pngs = sorted(p.relative_to(ref) for p in ref.rglob("*.png") if "thumbs" not in p.parts)
    assert sorted(p.relative_to(out) for p in out.rglob("*.png") if "thumbs" not in p.parts) == pngs
    for rel in pngs:
        assert np.array_equal(np.asarray(Image.open(out / rel)), np.asarray(Image.open(ref / rel))), rel
    lines = [json.loads(line)["path"] for line in (out / MANIFEST).read_text().splitlines()]
    assert sorted(lines) == sorted(p.as_posix() for p in pngs)  # one line per image, exactly once
    served, rendered = json.loads((out / REPORT_JSON).read_text()), json.loads((ref / REPORT_JSON).read_text())
    assert served["status"] == rendered["status"] == "done"
    assert served["images_rendered"] == rendered["images_rendered"] == 40 and served["images_failed"] == 0
    assert sum(b["images"] for b in served["buckets"]) == 40
    assert {w["host"] for w in served["workers"]} >= set(by_worker) - {"?"}
    assert (out / "index.html").is_file()


def _start_logged(url, name, folder, fault=None):
    """start_worker with its stderr in `folder`/`name`.log (see `_takes_a_lease`)."""
    with open(folder / f"{name}.log", "wb") as log:
        return start_worker(url, name, fault=fault, stderr=log)


def _takes_a_lease(url, job_id, name, folder):
    """Waits until the worker called `name` has leased a batch of the job; on a timeout, says what the server and
    the worker's log (`folder`/`name`.log, `_start_logged`) show."""
    worker = eventually(lambda: worker_ids(url, name), bool, timeout_s=120).pop()
    try:
        eventually(lambda: _leased_by(url, job_id), lambda seen: worker in seen, timeout_s=120)
    except AssertionError as e:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
        log = folder / f"{name}.log"
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"
        raise AssertionError(f"{name} ({worker}; registered now: {sorted(worker_ids(url, name))}) took no lease: {e}; "
                             f"the job's images: {job.get('images_by_state')}; its log:\n{tail}") from None


def _leased_by(url, job_id):
    """The workers that have leased the job's batches so far (its event stream read up to now)."""
    seen = set()
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=httpx.Timeout(10, read=1.0)) as r:
        try:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    data = json.loads(line[5:])
                    if "worker" in data and "lease" in data:
                        seen.add(data["worker"])
        except httpx.ReadTimeout:  # the stream waits for new events: what came so far is enough
            pass
    return seen


@pytest.mark.slow
def test_two_jobs_queued_at_once_over_three_workers_the_urgent_one_ends_first_and_nothing_starves(tmp_path):
    server = Server(tmp_path / "root", free_port()).start(lease_s=5, gpus="none")
    workers = [start_worker(server.url, f"w{n}") for n in range(3)]
    try:
        warm = post(server.url, SMALL.replace("NAME", "warm"))  # every worker has its model loaded
        server.wait(warm, lambda j: j["state"] in FINAL)
        for w in workers:
            os.killpg(w.pid, signal.SIGSTOP)  # both jobs queued before any worker asks again
        normal = post(server.url, SMALL.replace("NAME", "normal") + "".join(
            f"  - {{id: q{n}, prompt: more {n}, seed: {50 + n}}}\n" for n in range(8)))
        urgent = post(server.url, SMALL.replace("NAME", "urgent"), priority="urgent")
        time.sleep(0.5)
        for w in workers:
            os.killpg(w.pid, signal.SIGCONT)
        ends = {}
        for job_id in (urgent, normal):
            j = server.wait(job_id, lambda j: j["state"] in FINAL)
            assert j["state"] == "succeeded", j
            ends[job_id] = j["finished"]
        assert ends[urgent] < ends[normal]
    finally:
        for w in workers:
            stop(w)
        server.kill_everything()
