"""`bcg serve` as a process: its own lease sweep requeues a stopped worker's batch with nobody calling;
start-up errors (a damaged, foreign or read-only queue, a port in use, a public address without a token) are
one line and exit 2 before any banner; an IPv6 host is bracketed in the banner and in its local workers' URL;
`bcg submit --wait` names each failed image and exits 3."""

import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import httpx
import pytest

from storyboard_cli.serve import client
from storyboard_cli.serve.server import ServeOptions, local_url, worker_command
from storyboard_cli.serve.store import DB, Store

from conftest import ROOT, write_job
from helpers.serve import eventually, free_port, metric, register, start_worker, stop

BANNER = "bcg serve:"
SLOW_JOB = """version: 1
model: tiny
buckets: [4]
defaults: {steps: 20, size: 256x256}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 4}
"""
LEASE_S = 3.0
SWEEP_BOUND_S = 15.0  # the lease (3 s) plus a sweep (every 0.75 s), with room for a loaded 2-core machine


@pytest.mark.slow
def test_the_server_requeues_a_stopped_workers_batch_with_no_worker_calling(server, tmp_path):
    server.start(lease_s=LEASE_S, gpus="none")
    worker = start_worker(server.url, "only")
    try:
        r = httpx.post(server.url + "/v1/jobs", content=write_job(tmp_path, SLOW_JOB).read_bytes(),
                       headers={"Content-Type": "application/yaml"}, timeout=30)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        server.wait(job_id, lambda j: any(i["state"] == "leased" for i in j["images"]))
        os.killpg(worker.pid, signal.SIGSTOP)  # alive but silent: no heartbeat, no lease request, no completion
        stopped = time.time()
        job = eventually(lambda: server.job(job_id), lambda j: j["images_by_state"] == {"queued": 4}, SWEEP_BOUND_S)
        print(f"\nrequeued {time.time() - stopped:.2f} s after the worker stopped (--lease-s {LEASE_S:g})")
        assert job["state"] == "queued" and all(i["attempts"] == 1 for i in job["images"])
        assert metric(server.url, "bcg_lease_expiries_total") == 1
    finally:
        stop(worker)  # kill -9 reaches a stopped process
    assert httpx.post(f"{server.url}/v1/jobs/{job_id}/cancel", timeout=10).status_code == 200  # ends its stream
    events = list(client.events(server.url, job_id, timeout_s=10))
    lost = [e for e in events if e.kind == "lease_lost"]
    assert len(lost) == 1 and sorted(lost[0].data["requeued"]) == sorted(i["id"] for i in job["images"])
    assert stopped + LEASE_S - 1 <= lost[0].data["at"] <= stopped + SWEEP_BOUND_S
    assert [e.kind for e in events][-1] == "end" and events[-1].data["state"] == "canceled"


def _corrupt(root):
    (root / DB).write_bytes(bytes(range(256)) * 64)


def _foreign(root):
    with closing(sqlite3.connect(root / DB)) as db:
        db.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
        db.commit()


def _read_only_file(root):
    Store(root).close()
    (root / DB).chmod(0o444)


def _read_only_folder(root):
    Store(root).close()
    root.chmod(0o555)


def _port_in_use(root):
    pass  # the test holds the port


@pytest.mark.slow
@pytest.mark.parametrize("setup, extra, says", [
    (_corrupt, (), "is damaged or not a SQLite database"),
    (_foreign, (), "is not a bcg queue but another program's SQLite database (tables: photos)"),
    (_read_only_file, (), "is read-only (mode 444)"),
    (_read_only_folder, (), "is read-only: the queue"),
    (_port_in_use, (), "the port is in use"),
    (None, ("--host", "0.0.0.0"), "--host 0.0.0.0 is not loopback: set a token"),
], ids=["corrupt", "foreign", "read-only-file", "read-only-folder", "port-in-use", "public-without-token"])
def test_a_start_up_error_is_one_line_and_exit_2_before_any_banner(tmp_path, setup, extra, says):
    root = tmp_path / "root"
    root.mkdir()
    if setup:
        setup(root)
    before = (root / DB).read_bytes() if (root / DB).exists() else None
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1] if setup is _port_in_use else free_port()
        try:
            run = subprocess.run([sys.executable, "-m", "storyboard_cli", "serve", "--root", str(root), "--port",
                                  str(port), "--gpus", "none", *extra], cwd=ROOT, capture_output=True, text=True,
                                 timeout=120)
        finally:
            root.chmod(0o755)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], run.stderr
    assert "Traceback" not in run.stderr and BANNER not in run.stderr + run.stdout
    if before is not None:  # the queue as it was: never deleted, overwritten or stamped
        assert (root / DB).read_bytes() == before
        if setup is not _foreign:
            assert str(root / DB) in lines[0] and "only record of the jobs" in lines[0]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_host_is_bracketed_for_the_banner_and_the_local_workers(tmp_path):
    """The local worker reaches the server at http://[::1]:PORT (unbracketed, it crashed and was restarted
    forever), with the worker token in its environment (the client token opens no worker route)."""
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://[::1]:{port}"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "storyboard_cli", "serve", "--root", str(tmp_path / "root"),
                                 "--port", str(port), "--gpus", "cpu", "--host", "::1", "--token", "t", "--worker-token",
                                 "w"], cwd=ROOT,
                                start_new_session=True, stderr=stderr)
    try:
        eventually(lambda: _workers(url), lambda n: n == 1, 90, 0.5)  # registered over [::1], with its token
        said = log.read_text()
        assert f"{BANNER} {url} (docs at {url}/docs)" in said and "exited with" not in said, said  # never restarted
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        stop(proc)


def _workers(url):
    try:
        return metric(url, "bcg_workers")
    except httpx.HTTPError:
        return None


def test_the_local_workers_url_and_token():
    """An unspecified address is reached through its family's loopback; the workers get the worker token
    (else the client token) in their environment."""
    assert local_url(("0.0.0.0", 8188)) == "http://127.0.0.1:8188"
    assert local_url(("::", 8188, 0, 0)) == "http://[::1]:8188"
    assert local_url(("::1", 8188, 0, 0)) == "http://[::1]:8188"
    assert local_url(("10.1.2.3", 8188)) == "http://10.1.2.3:8188"
    opts = ServeOptions(root=ROOT, token="client", worker_token="worker")
    assert worker_command("http://[::1]:8188", "cpu", opts)[1]["BCG_WORKER_TOKEN"] == "worker"
    fallback = ServeOptions(root=ROOT, token="client")
    assert worker_command("http://[::1]:8188", "cpu", fallback)[1]["BCG_WORKER_TOKEN"] == "client"
    argv = worker_command("http://[::1]:8188", "cpu", opts)[0]
    assert argv[argv.index("--server") + 1] == "http://[::1]:8188" and argv[argv.index("--stall-s") + 1] == "600"
    argv = worker_command("http://[::1]:8188", "cpu", ServeOptions(root=ROOT, stall_s=2.5))[0]
    assert argv[argv.index("--stall-s") + 1] == "2.5"


JOB = """version: 1
model: tiny
buckets: [4]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 2}
  - {id: b, prompt: a tower, seed: 7}
"""


@pytest.mark.slow
def test_submit_wait_names_each_failed_image_and_exits_3(server, tmp_path):
    """A worker (here, its HTTP calls) fails one image of three: `bcg submit --wait` prints that image's
    shot, candidate and reason on one line before its summary, and exits as `bcg render` would."""
    server.start(gpus="none")
    submit = subprocess.Popen([sys.executable, "-m", "storyboard_cli", "submit", str(write_job(tmp_path, JOB)),
                               "--server", server.url, "--wait"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        worker = register(server.url, "hand")
        lease = eventually(lambda: httpx.post(server.url + "/v1/leases", json={"worker": worker}, timeout=10),
                           lambda r: r.status_code == 200, 60).json()
        images = {(i["id"]): i for i in lease["images"]}
        assert len(images) == 3
        tower = next(i["id"] for i in server.job(lease["job"])["images"] if i["shot"] == "b")
        done = [i for i in images if i != tower]
        out_dir = server.root / "jobs" / lease["job"] / "out"
        lines = []
        for i in done:  # what a worker writes: each PNG, and its manifest line with the completion
            path = images[i]["outputs"][0]
            (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
            (out_dir / path).write_bytes(b"png " + path.encode())
            lines.append({"path": path, "sha256": hashlib.sha256(b"png " + path.encode()).hexdigest()})
        r = httpx.post(f"{server.url}/v1/leases/{lease['lease']}/complete",
                       json={"worker": worker, "done": done, "cached": [],
                             "failed": {str(tower): "out of memory\nat 64x64"},
                             "manifest": {lease["job"]: lines}}, timeout=10)
        assert r.status_code == 200, r.text
        out, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 3, err
    lines = err.strip().splitlines()
    assert lines[-2] == "failed: shot b candidate 0: out of memory at 64x64"
    assert lines[-1].startswith("failed: 2 images done, 1 failed -> ")
    assert out.strip() == lease["job"] and "Traceback" not in err
