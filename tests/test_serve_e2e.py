"""`bcg serve` as a real process on 127.0.0.1 with one CPU worker and the tiny model: a job through the
service gives what `bcg render` gives (and /readyz turns ready once the worker has rendered); kill -9 of
everything mid-job, a restart, and the job completes, pixel-equal, within seconds; SIGTERM drains and exits 0.

The other serve test files start their servers and workers with the helpers here (Server, start_worker,
stop, metric, register, worker_ids)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from storyboard_cli.cli import app
from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render
from storyboard_cli.serve import client

from conftest import ROOT, write_job

pytestmark = pytest.mark.slow
JOB = """version: 1
model: tiny
buckets: [1, 2]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 3}
  - {id: b, prompt: a tower, seed: 7, candidates: 2}
"""
DEADLINE_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root, port):
        self.root, self.port, self.url = root, port, f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self, lease_s=3, gpus="cpu", extra=()):
        self.proc = subprocess.Popen([sys.executable, "-m", "storyboard_cli", "serve", "--root", str(self.root),
                                      "--port", str(self.port), "--gpus", gpus, "--lease-s", str(lease_s),
                                      "--grace-s", "30", *extra], cwd=ROOT, start_new_session=True,
                                     env=dict(os.environ))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the server did not answer within 30 s")

    def job(self, job_id):
        return httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=10).json()

    def wait(self, job_id, until):
        return eventually(lambda: self.job(job_id), until)

    def kill_everything(self):
        stop(self.proc)


def eventually(get, ok, timeout_s=DEADLINE_S, poll_s=0.2):
    """Calls get() until ok(its value) (bounded in time); returns that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {value}")
        time.sleep(poll_s)


def start_worker(url, name, *extra):
    """A `bcg worker` process rendering on the CPU, in its own process group."""
    return subprocess.Popen([sys.executable, "-m", "storyboard_cli", "worker", "--server", url, "--device", "cpu",
                             "--name", name, *extra], cwd=ROOT, start_new_session=True)


def stop(proc):
    """kill -9 of the process's group (the server's: its workers too), if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def metric(url, name, **labels):
    """The sum of /metrics samples named `name` whose labels include `labels`."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    found = [s.value for f in families for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    if not found:
        raise KeyError(name)
    return sum(found)


def register(url, name):
    """The worker id the server issues for `name` (what a test that leases by hand names in its calls)."""
    r = httpx.post(url + "/v1/workers", json={"name": name}, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["worker"]


def worker_ids(url, name):
    """The ids of the registered workers called `name` that the server counts now (from /metrics)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return {s.labels["worker"] for f in families for s in f.samples
            if s.name == "bcg_worker_ready" and s.labels["name"] == name}


def manifest_paths(out):
    return [json.loads(line)["path"] for line in (out / MANIFEST).read_text().splitlines()]


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "root", free_port())
    yield s
    if s.proc and s.proc.poll() is None:
        s.kill_everything()


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_a_job_through_serve_equals_bcg_render_and_sigterm_exits_0(server, tmp_path, tiny_cpu):
    path = write_job(tmp_path, JOB)
    server.start()
    cold = httpx.get(server.url + "/readyz", timeout=10)  # the worker has no model yet: it learns it from a job
    assert cold.status_code == 503 and "worker" in cold.json()["detail"]
    submitted = CliRunner().invoke(app, ["submit", str(path), "--server", server.url, "--wait", "--json"])
    assert submitted.exit_code == 0, submitted.output
    job = json.loads(submitted.stdout)
    assert job["state"] == "succeeded" and len(job["images"]) == 5
    served = server.root / "jobs" / job["id"] / "out"
    ref = render(load_job(path), RenderOptions(out_dir=tmp_path / "ref"), models=tiny_cpu).out_dir
    names = sorted(p.relative_to(ref).as_posix() for p in ref.rglob("*.png"))
    assert names == sorted(p.relative_to(served).as_posix() for p in served.rglob("*.png"))
    for name in names:
        assert np.abs(pixels(served / name) - pixels(ref / name)).max() == 0, name
    records = [json.loads(line) for line in (served / MANIFEST).read_text().splitlines()]
    assert sorted(r["path"] for r in records) == sorted(n for n in names if "/thumbs/" not in n)
    png = httpx.get(job["images"][0]["urls"][0]).content
    assert png == (served / job["images"][0]["outputs"][0]).read_bytes()
    assert httpx.get(job["sheet_url"]).status_code == 200 and httpx.get(job["report_url"]).json()["status"] == "done"

    _check_metrics_after_one_job(server.url, images=5)
    ready = eventually(lambda: httpx.get(server.url + "/readyz", timeout=10), lambda r: r.status_code == 200, 10)
    assert ready.json() == {"ready": True, "workers": 1, "workers_ready": 1}  # its next lease request said so

    again = CliRunner().invoke(app, ["submit", str(path), "--server", server.url, "--wait", "--json"])
    assert all(i["cached"] for i in json.loads(again.stdout)["images"])  # identical images rendered once

    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0
    refused = subprocess.run([sys.executable, "-m", "storyboard_cli", "submit", str(path), "--server", server.url],
                             capture_output=True, text=True)
    assert refused.returncode != 0  # it is gone


RESUME_S = 5.0  # the bound: a restart after kill -9 resumes within 5 s


def test_kill_9_of_everything_mid_job_then_a_restart_completes_the_job(server, tmp_path, tiny_cpu):
    slow = JOB.replace("buckets: [1, 2]", "buckets: [1]").replace("steps: 2", "steps: 10").replace("candidates: 3",
                                                                                                  "candidates: 2")
    path = write_job(tmp_path, slow)
    server.start(lease_s=2)
    r = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 202
    job_id = r.json()["id"]
    server.wait(job_id, lambda j: j["images_by_state"].get("done", 0) >= 1)
    server.kill_everything()  # the server and its worker, mid-job (kill -9 of the process group)

    restarted = time.time()
    server.start()
    job = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
    assert job["state"] == "succeeded"
    after = [e for e in client.events(server.url, job_id, timeout_s=10) if e.data["at"] >= restarted]
    assert [e.kind for e in after].count("running") >= 1, "the job had finished before the kill"
    resumed = next(e.data["at"] for e in after if e.kind == "running") - restarted  # its images leased again
    first_image = next(e.data["at"] for e in after if e.kind == "images") - restarted
    print(f"\nrestart after kill -9: job resumed (leased again) {resumed:.2f} s, first image {first_image:.2f} s "
          "after the restart")
    assert resumed < RESUME_S, f"resumed {resumed:.2f} s after the restart"

    out = server.root / "jobs" / job_id / "out"
    lines = manifest_paths(out)
    assert sorted(lines) == sorted(p for i in job["images"] for p in i["outputs"])  # each image exactly once
    ref = render(load_job(path), RenderOptions(out_dir=tmp_path / "ref"), models=tiny_cpu).out_dir
    assert sorted(p.relative_to(ref).as_posix() for p in ref.glob("*/*.png")) == sorted(lines)
    for name in lines:  # pixel-equal to an uninterrupted render
        assert np.abs(pixels(out / name) - pixels(ref / name)).max() == 0, name
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0


def _check_metrics_after_one_job(url, images):
    """/metrics after one job rendered by one CPU worker: latency histograms filled, counters, the worker
    counted, no GPU figures (none is faked on a CPU)."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}

    def sample(name, suffix, **labels):
        return next(s.value for s in families[name].samples
                    if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert sample("bcg_queue_wait_seconds", "_count", priority="normal") == images
    assert sample("bcg_image_render_seconds", "_count") == images and sample("bcg_image_render_seconds", "_sum") > 0
    assert sample("bcg_job_latency_seconds", "_count") == 1
    assert sample("bcg_job_latency_seconds", "_bucket", le="+Inf") == 1
    assert sample("bcg_batch_seconds", "_count", shape="64x64") >= 3  # buckets [1, 2]: 2 + 1 for a, 2 for b
    assert sample("bcg_images_rendered", "_total") == images and sample("bcg_model_loads", "_total") == 1
    assert sample("bcg_out_of_memory", "_total") == 0 and sample("bcg_image_retries", "_total") == 0
    assert sample("bcg_workers", "") == 1 and sample("bcg_images_per_second", "") > 0
    assert not families["bcg_worker_gpu_memory_bytes"].samples  # a CPU worker: absent, not zero
    assert not families["bcg_worker_gpu_utilization_ratio"].samples


def test_a_worker_warmed_with_a_job_is_ready_before_any_job_and_loads_nothing_for_one(server, tmp_path):
    """`serve --warm JOB`: each local worker loads the job's model and captures its shapes before its first
    lease, so /readyz is 200 with nothing submitted, and that job's images need no model load."""
    path = write_job(tmp_path, JOB)
    server.start(extra=("--warm", str(path)))
    ready = eventually(lambda: httpx.get(server.url + "/readyz", timeout=10), lambda r: r.status_code == 200, 60)
    assert ready.json() == {"ready": True, "workers": 1, "workers_ready": 1}
    submitted = CliRunner().invoke(app, ["submit", str(path), "--server", server.url, "--wait", "--json"])
    assert submitted.exit_code == 0 and json.loads(submitted.stdout)["state"] == "succeeded", submitted.output
    assert metric(server.url, "bcg_model_loads_total") == 0  # loaded before the lease, not for it
    assert metric(server.url, "bcg_images_rendered_total") == 5
