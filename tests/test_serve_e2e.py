"""`bcg serve` as a real process on 127.0.0.1 with one CPU worker and the tiny model: a job through the
service gives what `bcg render` gives (and /readyz turns ready once the worker has rendered); kill -9 of
everything mid-job, a restart, and the job completes, pixel-equal, within seconds; SIGTERM drains and exits 0."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from storyboard_cli.cli import app
from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render
from storyboard_cli.serve import client

from conftest import write_job
from helpers.serve import eventually, manifest_paths, metric, pixels

JOB = """version: 1
model: tiny
buckets: [1, 2]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 3}
  - {id: b, prompt: a tower, seed: 7, candidates: 2}
"""
@pytest.mark.slow
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
    deduplicated = json.loads(again.stdout)
    assert all(i["cached"] for i in deduplicated["images"])  # identical images rendered once
    report = eventually(lambda: httpx.get(deduplicated["report_url"]).json(), lambda r: r.get("status") == "done", 10)
    assert (report["images_rendered"], report["images_cached"]) == (0, 5)  # copied, not rendered
    markdown = httpx.get(deduplicated["report_url"].replace("report.json", "report.md")).text
    assert "- 0 rendered, 5 cached (copied from identical images rendered before), 0 skipped" in markdown

    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0
    refused = subprocess.run([sys.executable, "-m", "storyboard_cli", "submit", str(path), "--server", server.url],
                             capture_output=True, text=True)
    assert refused.returncode != 0  # it is gone


RESUME_S = 5.0  # the bound: a restart after kill -9 resumes within 5 s (1.96-2.56 s measured on an idle
# 2-core machine, docs/PERFORMANCE.md). Of that time, the server's start and its worker's imports (torch, diffusers)
# are the machine's speed: on a CI machine whose other test worker renders beside them they took 5.3-11 s. So the
# server's own share is asserted at the bound: from the new worker's registration to the interrupted job's
# images leased again (the old lease expired, the job dispatched at the worker's first request). The whole restart
# is printed against the bound and asserted at STALL_S, far above any load seen, so that a restart that hangs fails.
STALL_S = 30.0


@pytest.mark.slow
def test_kill_9_of_everything_mid_job_then_a_restart_completes_the_job(server, tmp_path, tiny_cpu):
    # 5 images of 6 steps, one a batch: killed as the first lands, with the worker's id read before, so that nothing
    # but a poll stands between them (a CI run whose cores were busy once saw the job end before the kill)
    slow = JOB.replace("buckets: [1, 2]", "buckets: [1]").replace("steps: 2", "steps: 6")
    path = write_job(tmp_path, slow)
    server.start(lease_s=2)
    killed = eventually(lambda: {w["id"] for w in httpx.get(server.url + "/v1/workers", timeout=10).json()["workers"]},
                        bool, poll_s=0.05)  # its worker, registered before any job
    r = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 202
    job_id = r.json()["id"]
    eventually(lambda: server.job(job_id), lambda j: j["images_by_state"].get("done", 0) >= 1, poll_s=0.05)
    server.kill_everything()  # the server and its worker, mid-job (kill -9 of the process group)

    restarted = time.time()
    server.start()
    eventually(lambda: {w["id"] for w in httpx.get(server.url + "/v1/workers", timeout=10).json()["workers"]} - killed,
               bool, poll_s=0.05)  # the new worker asked for its id
    registered = time.time() - restarted
    job = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
    assert job["state"] == "succeeded"
    after = [e for e in client.events(server.url, job_id, timeout_s=10) if e.data["at"] >= restarted]
    assert [e.kind for e in after].count("running") >= 1, "the job had finished before the kill"
    resumed = next(e.data["at"] for e in after if e.kind == "running") - restarted  # its images leased again
    first_image = next(e.data["at"] for e in after if e.kind == "images") - restarted
    print(f"\nrestart after kill -9: job resumed (leased again) {resumed:.2f} s (bound {RESUME_S:.0f} s), its worker "
          f"registered {registered:.2f} s, first image {first_image:.2f} s after the restart")
    assert resumed - registered < RESUME_S, f"leased again {resumed - registered:.2f} s after the worker registered"
    assert resumed < STALL_S, f"resumed {resumed:.2f} s after the restart"

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


@pytest.mark.slow
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
