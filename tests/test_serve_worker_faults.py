"""A worker that cannot use its device loses the farm no image: it stops before it registers (one line, exit 2),
`bcg serve` does not restart it forever, and one whose device fails mid-lease gives the lease back (its images keep
their attempts) until it is quarantined. Real `bcg serve` and `bcg worker` processes; the broken device is the real
one (`--device cuda` on a machine without CUDA) or a CUDA error injected into one worker process."""

import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from storyboard_cli.errors import DeviceUnusable
from storyboard_cli.run.oom import OutOfMemoryPolicy
from storyboard_cli.serve.server import QUICK_FAILURES, QUICK_S, Restarts

from conftest import ROOT
from helpers.serve import (MOUNT, YAML, Server, device_fault, eventually, free_port, holds_a_lease, metric,
                           mount_namespace, start_worker, stop, worker_ids)

JOB = """version: 1
model: tiny
buckets: [1, 2]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: %d, candidates: 3}
"""
JOBS = 2  # of 3 images
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the broken device here is a CUDA device that is absent")


def submit_jobs(url):
    ids = []
    for seed in range(JOBS):
        r = httpx.post(url + "/v1/jobs", content=JOB % (seed + 1), headers=YAML, timeout=10)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    return ids


def all_done(server, ids):
    """Waits for the jobs to end; asserts every image rendered, each on its first attempt (a lease given back
    spends none); returns the jobs."""
    jobs = [server.wait(i, lambda j: j["state"] in ("succeeded", "failed", "canceled")) for i in ids]
    images = [image for job in jobs for image in job["images"]]
    assert [j["state"] for j in jobs] == ["succeeded"] * JOBS, [(i["state"], i["reason"]) for i in images]
    assert len(images) == 3 * JOBS and {i["attempts"] for i in images} == {1}, [i["attempts"] for i in images]
    return jobs


@no_cuda
@pytest.mark.slow  # a server with a CPU worker rendering 16 tiny images
def test_a_worker_without_its_device_never_registers_and_serve_does_not_restart_one(tmp_path):
    """`bcg worker --device cuda` here: one line, exit 2, no registration. `bcg serve --gpus 0,cpu`: its GPU worker
    is not started again (one line saying why, with what bcg serve takes), its CPU worker renders every image. With
    --warm too: the device is tried before the model is loaded."""
    log, warm = tmp_path / "serve.log", tmp_path / "warm.yaml"
    warm.write_text(JOB % 99)
    with open(log, "w") as err:
        server = Server(tmp_path / "root", free_port()).start(gpus="0,cpu", stderr=err, extra=("--warm", str(warm)))
    try:
        ids = submit_jobs(server.url)
        gpu = subprocess.Popen([sys.executable, "-m", "storyboard_cli", "worker", "--server", server.url, "--device",
                                "cuda", "--name", "gpu-box"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        all_done(server, ids)
        _, stderr = gpu.communicate(timeout=120)
        assert gpu.returncode == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --device cuda: no CUDA device"), stderr
        assert worker_ids(server.url, "gpu-box") == set()
        time.sleep(3)  # more than the supervisor's restart delay: a worker it restarted would have said so again
        text = log.read_text()
        given_up = [line for line in text.splitlines() if "not started again" in line]
        assert len(given_up) == 1, text
        assert given_up[0].startswith("ERROR ") and "worker local-0 (--gpus 0)" in given_up[0], given_up
        assert "no CUDA device is available here" in given_up[0] and "--gpus cpu" in given_up[0], given_up
        assert "--device" not in given_up[0], given_up  # a hint bcg serve takes
        assert "Traceback" not in text and text.count("no CUDA device") == 1, text
    finally:
        stop(server.proc)


@pytest.mark.slow  # a server, a worker on a full disk of its own, then a healthy worker rendering 6 tiny images
def test_a_worker_whose_own_disk_is_full_gives_its_leases_back_and_the_farm_loses_no_image(tmp_path):
    """`bcg worker --upload --root DIR` with DIR on a tmpfs too small for one PNG (in a mount namespace of its own): a
    full disk of its own is its machine's fault, as a broken device is: each lease goes back (its images keep their
    attempts, none fails) until it is quarantined, and a healthy worker renders them all."""
    prefix = mount_namespace(tmp_path)
    here = tmp_path / "small"
    here.mkdir()
    log, worker_log = tmp_path / "serve.log", tmp_path / "full.log"
    with open(log, "w") as err:
        server = Server(tmp_path / "root", free_port()).start(gpus="none", lease_s=5, stderr=err)
    healthy = None
    with open(worker_log, "w") as err:  # 24 KB: the job file's copy fits, a 64x64 PNG (12 KB) and its temporary not
        full = subprocess.Popen([*prefix, "sh", "-c", MOUNT.format(size="24k"), str(here), sys.executable, "-m",
                                 "storyboard_cli", "worker", "--server", server.url, "--device", "cpu", "--name",
                                 "full", "--upload", "--root", str(here)], cwd=ROOT, start_new_session=True,
                                stderr=err)
    try:
        eventually(lambda: worker_ids(server.url, "full"), bool, 60)  # registered: it takes the first leases
        ids = submit_jobs(server.url)
        assert full.wait(90) == 2  # quarantined
        healthy = start_worker(server.url, "healthy")
        all_done(server, ids)
        assert metric(server.url, "bcg_worker_strikes_total") == 3
        assert metric(server.url, "bcg_images_failed_total") == 0
        lines = worker_log.read_text().strip().splitlines()
        given = [line for line in lines if "given back" in line]
        assert len(given) == 3 and all("this worker's --root is full: disk full" in line for line in given), lines
        assert lines[-1].startswith("error: ") and "is quarantined" in lines[-1], lines
        assert "Traceback" not in worker_log.read_text()
    finally:
        for p in (full, healthy, server.proc):
            if p is not None:
                stop(p)


@pytest.mark.slow  # a server, a CPU worker rendering 16 tiny images and a worker whose device fails
def test_a_worker_whose_device_fails_mid_lease_is_quarantined_and_the_farm_loses_no_image(tmp_path):
    log, worker_log = tmp_path / "serve.log", tmp_path / "broken.log"
    with open(log, "w") as err:
        server = Server(tmp_path / "root", free_port()).start(gpus="none", lease_s=5, stderr=err)
    healthy = None
    with open(worker_log, "w") as err:
        broken = start_worker(server.url, "broken", fault=device_fault(tmp_path / "fault"), stderr=err)
    try:
        eventually(lambda: worker_ids(server.url, "broken"), bool, 60)  # registered: it takes the first leases
        ids = submit_jobs(server.url)
        assert broken.wait(90) == 2  # quarantined: it cannot render here, as a worker that cannot start
        healthy = start_worker(server.url, "healthy")
        all_done(server, ids)
        assert metric(server.url, "bcg_worker_strikes_total") == 3
        assert metric(server.url, "bcg_worker_quarantines_total") == 1
        assert metric(server.url, "bcg_images_failed_total") == 0
        lines = worker_log.read_text().strip().splitlines()
        assert len([line for line in lines if "given back" in line]) == 3, lines
        assert lines[-1].startswith("error: ") and "is quarantined" in lines[-1], lines
        assert "Traceback" not in worker_log.read_text()
        quarantined = [line for line in log.read_text().splitlines() if "quarantined" in line]
        assert len(quarantined) == 1 and "CUDA error" in quarantined[0], log.read_text()
    finally:
        for p in (broken, healthy, server.proc):
            if p is not None:
                stop(p)


def test_a_worker_that_cannot_reach_its_server_says_so_once_and_keeps_trying(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with open(tmp_path / "worker.log", "w") as err:
        worker = start_worker(url, "waiting", stderr=err)
    try:
        text = eventually(lambda: (tmp_path / "worker.log").read_text(), lambda t: "cannot reach" in t, 60)
        time.sleep(2)  # more retries: still that one line
        assert worker.poll() is None
        lines = (tmp_path / "worker.log").read_text().strip().splitlines()
        assert len(lines) == 1 and f"cannot reach {url}" in lines[0] and "retrying" in lines[0], text
    finally:
        stop(worker)


# a batch that waits for the test's word before it renders (the worker holds its lease meanwhile)
HELD_BATCH = """import os, time
from storyboard_cli.run.batch import BatchRunner

_run = BatchRunner.run_batch


def _held(self, *args, **kwargs):
    open(os.environ["BCG_TEST_GO"] + ".held", "w").close()  # the worker has its lease: it renders
    while not os.path.exists(os.environ["BCG_TEST_GO"]):
        time.sleep(0.05)
    return _run(self, *args, **kwargs)


BatchRunner.run_batch = _held
"""
OLD_RETRIES_S = 1 + 2 + 4 + 8 + 10  # how long a worker tried to complete a lease before it gave up, until 2026-12-03


@pytest.mark.slow  # a server killed while its CPU worker renders, started again half a minute later
def test_a_batch_rendered_while_its_server_is_down_lands_when_the_server_is_back(tmp_path, monkeypatch):
    """A server restarted (an upgrade, a crash) after its worker finished a batch: the worker (one that uploads its
    PNGs) keeps trying to upload them and complete the lease until the server answers, and the server, which does not
    hold its downtime against the lease, takes them. Nothing is rendered twice."""
    fault = tmp_path / "held"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(HELD_BATCH)
    go = tmp_path / "go"
    monkeypatch.setenv("BCG_TEST_GO", str(go))
    server = Server(tmp_path / "root", free_port()).start(gpus="none")
    with open(tmp_path / "worker.log", "w") as err:
        worker = start_worker(server.url, "patient", "--upload", "--root", str(tmp_path / "elsewhere"),
                              fault=fault, stderr=err)
    try:
        r = httpx.post(server.url + "/v1/jobs", content=JOB % 1, headers=YAML, timeout=10)
        job = r.json()["id"]
        server.wait(job, lambda j: j["state"] == "running")  # leased: the batch waits for the word
        # and the worker has the lease: the server marks the job running before its answer reaches the worker, and a
        # kill between the two left the worker asking for a lease, with none to render (one CI run in three)
        eventually(lambda: (tmp_path / "go.held").exists(), bool, 60)
        server.kill_everything()  # kill -9 of the server alone: the worker is in its own group
        time.sleep(3.5)  # three heartbeats (every second: --lease-s 3) fail while the batch waits
        go.touch()
        log = tmp_path / "worker.log"
        eventually(log.read_text, lambda t: "the server cannot be reached" in t, 60)  # rendered, the server gone
        time.sleep(OLD_RETRIES_S + 2)  # down longer than a worker used to try
        assert worker.poll() is None
        server.start(gpus="none")
        done = server.wait(job, lambda j: j["state"] in ("succeeded", "failed"))
        images = done["images"]
        assert done["state"] == "succeeded" and {i["attempts"] for i in images} == {1}, images
        assert metric(server.url, "bcg_image_retries_total") == 0
        assert metric(server.url, "bcg_lease_expiries_total") == 0
        text = log.read_text()
        assert "done once the server answered again" in text, text
        failed = [line for line in text.splitlines() if "heartbeat of lease" in line and " failed: " in line]
        assert len(failed) == 1, text  # one line for the outage, not one per beat
    finally:
        stop(worker)
        server.kill_everything()


def test_the_supervisor_stops_after_exit_2_or_quick_failures_in_a_row():
    assert Restarts().why_not(2, 1000.0) == "it cannot render here (exit 2)"
    slow = Restarts()
    assert all(slow.why_not(1, QUICK_S + 1) is None for _ in range(2 * QUICK_FAILURES))  # a long run between each
    quick = Restarts()
    assert [quick.why_not(1, 0.5) is None for _ in range(QUICK_FAILURES)] == [True] * (QUICK_FAILURES - 1) + [False]
    interrupted = Restarts()
    for _ in range(QUICK_FAILURES - 1):
        interrupted.why_not(1, 0.5)
    assert interrupted.why_not(137, QUICK_S + 1) is None and interrupted.why_not(1, 0.5) is None  # not in a row


@pytest.mark.parametrize("error,device", [("CUDA error: an illegal memory access was encountered", True),
                                          ("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx", True),
                                          ("cannot identify image file 'x.png'", False)])
def test_a_cuda_error_stops_the_render_as_the_devices_and_any_other_fails_its_batch(error, device):
    """A CUDA error is the device's (sticky: every later batch would fail too), not the batch's images'."""
    failed = []

    class Runner:
        def lora_problem(self, batch):
            return None

        def run_batch(self, batch, fallback, upcoming=None):
            raise RuntimeError(error)

        def decode(self, latents):
            return latents

    sink = SimpleNamespace(fail=lambda items, reason: failed.append((items, reason)))
    batch = SimpleNamespace(size=1, items=["image"], key=SimpleNamespace(label="64x64"))
    policy = OutOfMemoryPolicy(Runner(), sink)
    if device:
        with pytest.raises(DeviceUnusable, match="the device failed: " + error.split(" ")[0]):
            policy.process(batch, (1,))
        assert failed == []
    else:
        policy.process(batch, (1,))
        assert failed == [(["image"], f"RuntimeError: {error}")]


def test_a_lease_call_waits_for_its_server_until_it_answers_or_the_worker_is_asked_to_stop(monkeypatch):
    from storyboard_cli.serve import worker as w

    monkeypatch.setattr(w, "_pause", lambda seconds, stop: None)
    stop, calls = w._Stop(), []

    def unreachable():
        calls.append(1)
        if len(calls) == 40:  # SIGTERM while the server is still down
            stop.requested = True
        raise httpx.ConnectError("[Errno 111] Connection refused")

    with pytest.raises(httpx.ConnectError):
        w._answered(unreachable, w._Retry(1.0, stop), "completing lease l-1")
    assert len(calls) == 40  # tried until the stop (five tries, until 2026-12-03)
    answers = iter([httpx.ConnectError("refused")] * 12 + [True])

    def back():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert w._answered(back, w._Retry(1.0, w._Stop()), "completing lease l-1") is True  # the 13th try
    refused = httpx.HTTPStatusError("507", request=httpx.Request("PUT", "http://x"), response=httpx.Response(507))

    def full():
        calls.append(1)
        raise refused

    calls.clear()
    with pytest.raises(httpx.HTTPStatusError):  # an answer, not an outage: never tried again
        w._answered(full, w._Retry(1.0, w._Stop()), "uploading a.png of lease l-1")
    assert len(calls) == 1


def test_failed_heartbeats_are_one_line_per_outage(caplog):
    from storyboard_cli.serve import worker as w

    refused = httpx.ConnectError("[Errno 111] Connection refused")
    answers = [refused] * 5 + [True, True] + [refused] * 3 + [True]

    class Client:
        calls = 0

        def heartbeat(self, lease_id, beat):
            answer = answers[min(self.calls, len(answers) - 1)]
            self.calls += 1
            if isinstance(answer, Exception):
                raise answer
            return answer

    client, lease, hot = Client(), SimpleNamespace(lease="l-1", ttl=0.03), SimpleNamespace(ready=True, models=None)
    with caplog.at_level("WARNING", logger="storyboard_cli.serve.worker"):
        with w.Heartbeat(client, lease, "w-1", hot) as beat:
            eventually(lambda: client.calls, lambda n: n > len(answers), 10, poll_s=0.02)
    lines = [r.getMessage().split(":")[0] for r in caplog.records]
    assert lines == ["heartbeat of lease l-1 failed", "heartbeat of lease l-1 answered again"] * 2, lines
    assert not beat.lost


@pytest.mark.slow  # a server, a worker whose render hangs, then a healthy worker: 6 tiny images
def test_a_worker_whose_render_hangs_exits_and_another_renders_its_images(tmp_path):
    """A worker whose batch never returns (its device hung: no error reaches the main thread) renews its lease no
    longer than --stall-s after the render's last sign of progress: one line that says so, exit 75. Its lease
    expires and a healthy worker renders every image, those of the hung lease on their second attempt. On the code
    before, the hung worker renewed its lease for as long as it hung, and the healthy worker got nothing."""
    log = tmp_path / "hung.log"
    server = Server(tmp_path / "root", free_port()).start(gpus="none", lease_s=3)
    healthy = None
    with open(log, "w") as err:
        hung = start_worker(server.url, "hung", "--stall-s", "4", fault=holds_a_lease(tmp_path / "hold"), stderr=err)
    try:
        eventually(lambda: worker_ids(server.url, "hung"), bool, 60)  # registered: it takes the first lease
        ids = submit_jobs(server.url)
        started = time.monotonic()
        assert hung.wait(60) == 75
        waited = time.monotonic() - started
        said = log.read_text()
        assert said.count("no progress for") == 1 and "--stall-s 4" in said and "exits (status 75)" in said, said
        assert "the last: batch (0 of" in said, said  # what it was doing: the batch it began
        healthy = start_worker(server.url, "healthy")
        jobs = [server.wait(i, lambda j: j["state"] in ("succeeded", "failed", "canceled")) for i in ids]
        images = [image for job in jobs for image in job["images"]]
        assert [j["state"] for j in jobs] == ["succeeded"] * JOBS, [(i["state"], i["reason"]) for i in images]
        attempts = sorted(i["attempts"] for i in images)
        assert attempts == [1] * (3 * JOBS - 2) + [2] * 2, attempts  # buckets [1, 2]: the hung lease held two
        assert metric(server.url, "bcg_lease_expiries_total") == 1
        assert waited < 4 + 30, waited  # the stall, plus its heartbeat's period and loading on a loaded machine
    finally:
        for p in (hung, healthy, server.proc):
            if p is not None:
                stop(p)


@pytest.mark.slow  # a server whose local CPU worker hangs in its first batch
def test_serve_starts_its_local_worker_again_once_its_render_stalled(tmp_path):
    """`bcg serve --stall-s` reaches its local workers: one whose batch never returns exits 75 that long after the
    batch began, and the server starts it again, each said in one line."""
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        server = Server(tmp_path / "root", free_port()).start(gpus="cpu", lease_s=3, extra=["--stall-s", "3"],
                                                              stderr=err, fault=holds_a_lease(tmp_path / "hold"))
    try:
        r = httpx.post(server.url + "/v1/jobs", content=JOB % 1, headers=YAML, timeout=10)
        assert r.status_code == 202, r.text
        said = eventually(log.read_text, lambda t: "exited with 75; starting it again" in t, 120)
        assert "no progress for" in said and "--stall-s 3)" in said, said
    finally:
        stop(server.proc)


def test_a_render_that_goes_on_past_stall_s_in_all_is_not_stalled_and_only_the_render_is_watched():
    """The stall is the time since the render's last sign of progress, not the lease's age: a render whose batches
    keep coming runs on past --stall-s; one that stops is stalled once, and its lease no longer renewed; the calls
    to the server before and after the render (downloads, uploads waiting for it) are not watched."""
    from storyboard_cli.serve import worker as w

    class Client:
        beats = 0

        def heartbeat(self, lease_id, beat):
            self.beats += 1
            return True

    client, stalls = Client(), []
    lease, hot = SimpleNamespace(lease="l-1", ttl=0.06), SimpleNamespace(ready=True, models=None)
    pulse = w.Pulse()
    with w.Heartbeat(client, lease, "w-1", hot, pulse, stall_s=0.3, on_stall=lambda: stalls.append(client.beats)):
        time.sleep(0.6)  # before the render (its inputs downloaded): not watched
        with pulse.watch():
            for _ in range(10):  # 1 s of batches, one every 0.1 s
                time.sleep(0.1)
                pulse(SimpleNamespace(kind="batch", done=1, total=4))
        time.sleep(0.6)  # after it (its PNGs uploaded): not watched
        assert stalls == []
        with pulse.watch():
            pulse(SimpleNamespace(kind="batch", done=2, total=4))
            eventually(lambda: stalls, bool, 10, poll_s=0.02)
            time.sleep(0.3)  # five periods more: no beat, no second stall
    assert len(stalls) == 1 and client.beats == stalls[0], (stalls, client.beats)
    assert pulse.last == "batch (2 of 4 images delivered)"


# the server's clock set off from the machine's by the seconds its test writes into BCG_TEST_STEP (read every 0.05 s):
# NTP stepping a freshly booted machine's clock, or an operator setting it
STEPPED_CLOCK = """import os, threading, time

_real, _sleep, _offset = time.time, time.sleep, [0.0]


def _watch():
    while True:
        try:
            with open(os.environ["BCG_TEST_STEP"]) as f:
                _offset[0] = float(f.read())
        except (OSError, ValueError):
            pass
        _sleep(0.05)


threading.Thread(target=_watch, daemon=True).start()
time.time = lambda: _real() + _offset[0]
"""


@pytest.mark.slow  # a server whose clock steps an hour forward, then two back, while workers hold leases
def test_a_step_of_the_servers_clock_neither_expires_a_live_lease_nor_keeps_a_dead_workers(tmp_path, monkeypatch):
    """The machine's clock set an hour forward while a worker renders a batch: its lease does not expire (the image
    renders once, on its first attempt). Then set two hours back while a worker killed mid-batch holds a lease: that
    lease expires within --lease-s as ever, and the other worker renders its image."""
    one = JOB.replace("candidates: 3", "candidates: 1")
    clock, step = tmp_path / "clock", tmp_path / "step"
    clock.mkdir()
    (clock / "sitecustomize.py").write_text(STEPPED_CLOCK)
    monkeypatch.setenv("BCG_TEST_STEP", str(step))
    server = Server(tmp_path / "root", free_port()).start(gpus="none", fault=clock)
    workers = []
    try:
        for name in ("steady", "killed"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "sitecustomize.py").write_text(HELD_BATCH)
            monkeypatch.setenv("BCG_TEST_GO", str(tmp_path / f"{name}.go"))
            workers.append(start_worker(server.url, name, fault=tmp_path / name))
            ids = eventually(lambda: worker_ids(server.url, name), bool, 60)
            job = httpx.post(server.url + "/v1/jobs", content=one % len(workers), headers=YAML, timeout=10).json()
            eventually(lambda: (tmp_path / f"{name}.go.held").exists(), bool, 60)  # its batch waits
            if name == "steady":
                steady = ids
                step.write_text("3600")  # an hour forward, heartbeats and sweeps meanwhile
                time.sleep(2)
                (tmp_path / "steady.go").touch()
                done = server.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
                assert done["state"] == "succeeded" and done["images"][0]["attempts"] == 1, done
                assert metric(server.url, "bcg_lease_expiries_total") == 0
                for worker in steady:  # the next job goes to the next worker
                    assert httpx.post(f"{server.url}/v1/workers/{worker}/drain", timeout=10).status_code == 200
            else:
                step.write_text("-3600")  # two hours back, then the worker holding the lease is killed
                stop(workers[-1])
                for worker in steady:
                    assert httpx.post(f"{server.url}/v1/workers/{worker}/resume", timeout=10).status_code == 200
                done = eventually(lambda: server.job(job["id"]), lambda j: j["state"] in ("succeeded", "failed"), 30)
                assert done["state"] == "succeeded" and done["images"][0]["attempts"] == 2, done
                assert done["images"][0]["worker"] in steady, done
                assert metric(server.url, "bcg_lease_expiries_total") == 1
    finally:
        for p in workers:
            stop(p)
        server.kill_everything()


@pytest.mark.slow  # a bcg worker against a server whose queue cannot be written (its disk full to the last byte)
def test_a_worker_whose_server_cannot_lease_for_a_full_disk_says_so_once_and_asks_again(tmp_path):
    """The server answers a lease request 507 (its disk so full that its queue cannot record the request): the worker
    says so in one line, not as a server it cannot reach, asks again at its backoff, and says once that the server
    answers again when it leases (here: nothing to do)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asks, full = [], [True]
    problem = {"type": "about:blank", "title": "insufficient storage", "status": 507,
               "detail": "the server's disk is full: nothing of this request was kept; free space on the server, then "
                         "retry"}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/workers":
                status, body = 201, {"worker": "w-1", "name": "w", "lease_s": 3}
            else:
                asks.append(self.path)
                status, body = (507, problem) if full[0] else (204, None)
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/problem+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log = tmp_path / "worker.log"
    with open(log, "w") as err:
        worker = start_worker(f"http://127.0.0.1:{httpd.server_port}", "w", stderr=err)
    try:
        eventually(lambda: len(asks), lambda n: n >= 3, 60)  # refused, and asked again
        full[0] = False  # space freed
        n = len(asks)
        eventually(lambda: len(asks), lambda k: k > n + 2, 30)
        assert worker.poll() is None
        text = log.read_text()
        said = [line for line in text.splitlines() if "disk is full" in line]
        assert len(said) == 1 and "asking again" in said[0] and "cannot reach" not in text, text
        assert text.count("answers again") == 1, text
    finally:
        stop(worker)
        httpd.shutdown()


# a worker whose every PNG write into the job folders is refused for its user's quota (the server's disk has room)
QUOTA = """import errno
from storyboard_cli.folder import sink


def _over_quota(target, data):
    raise OSError(errno.EDQUOT, "Disk quota exceeded")


sink.atomic_write = _over_quota
"""


@pytest.mark.slow  # a server, a worker over its quota on the shared folders, then a healthy worker: 6 tiny images
def test_a_worker_over_its_quota_on_the_shared_folders_takes_strikes_and_the_farm_goes_on(tmp_path):
    """A worker on the server's folders cannot write a PNG for want of space (its user's quota) while the server's
    own disk has room: each completion sends its images back with their attempts and says disk_full, which the
    server counts as a strike against that worker, not as its own disk full: it keeps leasing, quarantines the
    worker at the third, and a healthy worker renders every image on its first attempt."""
    (tmp_path / "quota").mkdir()
    (tmp_path / "quota" / "sitecustomize.py").write_text(QUOTA)
    log, worker_log = tmp_path / "serve.log", tmp_path / "quota.log"
    with open(log, "w") as err:
        server = Server(tmp_path / "root", free_port()).start(gpus="none", lease_s=5, stderr=err,
                                                              extra=["--min-free-mb", "1"])
    healthy = None
    with open(worker_log, "w") as err:
        over = start_worker(server.url, "over", fault=tmp_path / "quota", stderr=err)
    try:
        eventually(lambda: worker_ids(server.url, "over"), bool, 60)  # registered: it takes the first leases
        ids = submit_jobs(server.url)
        assert over.wait(90) == 2  # quarantined
        assert metric(server.url, "bcg_leases_held") == 0  # the farm was never held
        healthy = start_worker(server.url, "healthy")
        all_done(server, ids)
        assert metric(server.url, "bcg_worker_strikes_total") == 3
        assert metric(server.url, "bcg_images_failed_total") == 0
        said = worker_log.read_text()
        assert said.count("the server's job folders took no more PNGs") == 3 and "Disk quota exceeded" in said, said
        assert log.read_text().count("a strike against the worker") == 3, log.read_text()
    finally:
        for p in (over, healthy, server.proc):
            if p is not None:
                stop(p)
