"""The server's disk full, for real: `bcg serve` runs with its --root on an 8 MB tmpfs mounted in a mount namespace of
its own (unshare), the test filling it through /proc/<pid>/root. A job, an input file and a worker's upload that do not
fit are each a 507 problem+json that says the disk is full, and leave nothing half-written; below --min-free-mb the
server takes no new job or file and /readyz says why; /metrics shows the free bytes and the refusals."""

import hashlib
import os
import shutil
import subprocess
import threading

import httpx
import pytest

from storyboard_cli.serve import client

from conftest import ROOT
from helpers.serve import (MOUNT, ONE_IMAGE_JOB, YAML, Server, eventually, free_port, metric, mount_namespace,
                           register)

MB = 1 << 20
TMPFS_MB = 8


@pytest.fixture
def full_server(tmp_path):
    prefix = mount_namespace(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    s = Server(root, free_port())
    s.start(lease_s=30, gpus="none", prefix=[*prefix, "sh", "-c", MOUNT.format(size=f"{TMPFS_MB}m"), str(root)],
            extra=["--min-free-mb", "1", "--max-job-kb", "4096"])
    s.inside = f"/proc/{s.proc.pid}/root{root}"  # the root as the server sees it: on its tmpfs
    yield s
    s.kill_everything()


def _free(server):
    st = os.statvfs(server.inside)
    return st.f_bavail * st.f_frsize


def _fill(server, leave):
    """A file of the operator's that leaves `leave` bytes free on the server's disk."""
    filler = f"{server.inside}/filler"
    size = (os.path.getsize(filler) if os.path.exists(filler) else 0) + _free(server) - leave
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * size)


def _full(r):
    assert r.status_code == 507 and r.headers["content-type"] == "application/problem+json", (r.status_code, r.text)
    problem = r.json()
    assert problem["title"] == "insufficient storage" and "the server's disk is full" in problem["detail"], problem
    assert "/" not in problem["detail"].replace("server's", "") and "Errno" not in problem["detail"]


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.mark.slow
def test_a_full_disk_is_a_507_that_leaves_nothing_half_written(full_server):
    s = full_server
    job = httpx.post(s.url + "/v1/jobs", content=ONE_IMAGE_JOB, headers=YAML, timeout=10).json()
    worker = register(s.url, "w")
    lease = httpx.post(s.url + "/v1/leases", json={"worker": worker}, timeout=10).json()
    png = lease["images"][0]["outputs"][0]
    before = _files(s.inside)

    _fill(s, leave=MB + MB // 2)  # above the 1 MB floor: each request below is taken, and its write fails
    blob = os.urandom(3 * MB)
    _full(httpx.put(f"{s.url}/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=blob,
                    headers={"Content-Type": "application/octet-stream"}, timeout=30))
    padded = ONE_IMAGE_JOB + "# " + "x" * (3 * MB) + "\n"  # a job of 3 MB
    _full(httpx.post(s.url + "/v1/jobs", content=padded, headers=YAML, timeout=30))
    _full(httpx.put(f"{s.url}/v1/leases/{lease['lease']}/files/{job['id']}/{png}", content=os.urandom(3 * MB),
                    params={"worker": worker}, headers={"Content-Type": "application/octet-stream"}, timeout=30))
    assert _files(s.inside) == sorted(before + ["filler"])  # no job folder, no temporary file, no partial PNG

    _fill(s, leave=MB // 2)  # under the floor: refused before anything is written, and not ready
    _full(httpx.post(s.url + "/v1/jobs", content=ONE_IMAGE_JOB, headers=YAML, timeout=10))
    ready = httpx.get(s.url + "/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json()["title"] == "disk full", ready.text
    assert "MB free" in ready.json()["detail"] and "--min-free-mb" in ready.json()["detail"]
    assert metric(s.url, "bcg_root_free_bytes") < MB
    assert metric(s.url, "bcg_disk_full_total") == 4

    os.unlink(f"{s.inside}/filler")  # the operator frees space: the server takes jobs again
    assert httpx.post(s.url + "/v1/jobs", content=ONE_IMAGE_JOB.replace("seed: 1", "seed: 2"), headers=YAML,
                      timeout=10).status_code == 202
    assert httpx.get(s.url + "/readyz", timeout=10).json()["title"] == "no ready worker"
    assert metric(s.url, "bcg_root_free_bytes") > (TMPFS_MB - 2) * MB


CONTROL_JOB = """version: 1
model: tiny
controlnet: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, control: {image: pose.png}}
"""
GRACE_S = 1.0


def _put(url, data):
    return httpx.put(f"{url}/v1/blobs/{hashlib.sha256(data).hexdigest()}", content=data,
                     headers={"Content-Type": "application/octet-stream"}, timeout=30)


def _has(url, data):
    return httpx.get(f"{url}/v1/blobs/{hashlib.sha256(data).hexdigest()}", timeout=10).status_code == 200


@pytest.mark.slow
def test_input_files_are_capped_and_those_no_job_names_are_collected(server, tmp_path):
    """--max-blobs-gb caps the stored input files (507 naming the option); a file no job names is removed after
    --blob-grace-s, one a job names is kept; a restart removes what an upload cut short by kill -9 left."""
    server.start(gpus="none", extra=["--blob-grace-s", str(GRACE_S), "--max-blobs-gb", "0.00001"])  # 10.7 KB
    shutil.copy(ROOT / "jobs" / "control" / "hero_pose.png", tmp_path / "pose.png")  # 3.6 KB
    (tmp_path / "job.yaml").write_text(CONTROL_JOB)
    job = client.submit(tmp_path / "job.yaml", server.url)  # uploads pose.png, names it in `inputs:`
    pose = (tmp_path / "pose.png").read_bytes()
    unused, more = os.urandom(4000), os.urandom(4000)
    assert _put(server.url, unused).status_code == 201
    over = _put(server.url, more)  # 3.6 + 4 + 4 KB: past the cap
    assert over.status_code == 507 and "--max-blobs-gb" in over.json()["detail"], over.text
    assert metric(server.url, "bcg_blobs_bytes") == len(pose) + len(unused)

    eventually(lambda: metric(server.url, "bcg_blobs_collected_total"), lambda n: n == 1, timeout_s=30)
    assert not _has(server.url, unused)  # collected after its grace
    assert _has(server.url, pose) and job["state"] == "queued"  # the job names it: kept
    assert _put(server.url, more).status_code == 201  # room again
    assert metric(server.url, "bcg_blobs_bytes") == len(pose) + len(more)

    # kill -9 while an upload streams: its temporary file stays behind, and the next start removes it
    stalled = threading.Event()

    def stalling():
        yield b"x" * 1000
        stalled.wait(30)

    digest = hashlib.sha256(b"never sent whole").hexdigest()
    threading.Thread(target=lambda: _quietly(httpx.put, f"{server.url}/v1/blobs/{digest}", content=stalling(),
                                             timeout=30), daemon=True).start()
    tmp = server.root / "blobs" / "tmp"
    eventually(lambda: list(tmp.iterdir()), bool, timeout_s=30)
    server.kill_everything()
    stalled.set()
    assert list(tmp.iterdir())
    server.start(gpus="none")
    assert not list(tmp.iterdir())


def _quietly(call, *args, **kw):
    try:
        call(*args, **kw)
    except httpx.HTTPError:  # the server was killed mid-request
        pass
