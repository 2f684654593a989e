"""The server's disk full, for real: `bcg serve` runs with its --root on an 8 MB tmpfs mounted in a mount namespace of
its own (unshare), the test filling it through /proc/<pid>/root. A job, an input file and a worker's upload that do not
fit are each a 507 problem+json that says the disk is full, and leave nothing half-written; below --min-free-mb the
server takes no new job or file and /readyz says why; /metrics shows the free bytes and the refusals."""

import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

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
    floor = httpx.post(s.url + "/v1/jobs", content=ONE_IMAGE_JOB, headers=YAML, timeout=10)
    _full(floor)
    assert "MB free" in floor.json()["detail"] and "--min-free-mb" in floor.json()["detail"]
    ready = httpx.get(s.url + "/readyz", timeout=10)  # the upload refused: no batch is leased either
    assert ready.status_code == 503 and ready.json()["title"] == "disk full", ready.text
    assert "no batch is leased until" in ready.json()["detail"] and "MB free" in ready.json()["detail"]
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


# four candidates in one batch, each PNG about 640 KB (512x512 of the tiny model's noise)
FOUR_LARGE = """version: 1
model: tiny
defaults: {steps: 2, size: 512x512}
shots:
  - {id: a, prompt: a castle, candidates: 4, seed: 1}
"""


def _paused_with_a_worker(tmp_path, kind):
    """`bcg serve` (--lease-s 10, --min-free-mb 1) with its --root on a 16 MB tmpfs and a `bcg worker` ("w": on the
    shared folders, or uploading from a root of its own) in one mount namespace, the worker registered and the queue
    paused: (the server, its root, the worker's log). `server.inside`: the root as the server sees it."""
    import shlex
    import sys

    from helpers.serve import worker_ids

    prefix = mount_namespace(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    s = Server(root, free_port())
    worker_log = tmp_path / "worker.log"
    worker = [sys.executable, "-m", "storyboard_cli", "worker", "--server", s.url, "--device", "cpu", "--name", "w",
              *(["--upload", "--root", str(tmp_path / "elsewhere")] if kind == "upload" else [])]
    # the tmpfs, then the worker in the background and the server in the foreground: one namespace, one disk
    both = f'mount -t tmpfs -o size=16m tmpfs "$0" && {{ {shlex.join(worker)} 2>{shlex.quote(str(worker_log))} & }}' \
           ' && exec "$@"'
    with open(tmp_path / "serve.log", "w") as err:
        s.start(lease_s=10, gpus="none", prefix=[*prefix, "sh", "-c", both, str(root)], extra=["--min-free-mb", "1"],
                stderr=err)
    s.inside = f"/proc/{s.proc.pid}/root{root}"
    try:
        eventually(lambda: worker_ids(s.url, "w"), bool, 60)
        assert httpx.post(s.url + "/v1/queue/pause", timeout=10).status_code == 200
    except BaseException:
        s.kill_everything()
        raise
    return s, root, worker_log


@pytest.mark.slow  # a server and a worker in a mount namespace, four 512x512 images rendered twice
@pytest.mark.parametrize("kind", ["shared", "upload"])
def test_a_disk_that_fills_mid_batch_fails_no_image_and_the_job_ends_once_space_is_freed(tmp_path, kind, tiny_cpu):
    """`bcg serve` and a `bcg worker` in one mount namespace, the server's --root on a 16 MB tmpfs. The disk fills
    (1 MB left) while the worker renders a batch of four 640 KB PNGs: the first lands, the second cannot be written
    (shared: the worker writes into the server's job folder, ENOSPC; upload: the server's 507). The images that did
    not land go back to the queue with their attempts, none fails, the worker takes no strike, and no batch is
    leased until space is freed (/readyz and /metrics say so); once the operator frees it, the job ends with each
    PNG the pixels `bcg render` writes."""
    import numpy as np

    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render

    from helpers.serve import pixels

    s, root, worker_log = _paused_with_a_worker(tmp_path, kind)
    try:
        job = httpx.post(s.url + "/v1/jobs", content=FOUR_LARGE, headers=YAML, timeout=10).json()
        _fill(s, leave=MB)  # room for one PNG of the batch, not two
        assert httpx.post(s.url + "/v1/queue/resume", timeout=10).status_code == 200

        images = eventually(lambda: s.job(job["id"])["images"],  # the batch's lease ended
                            lambda ims: {i["state"] for i in ims} & {"done", "failed"} and
                            all(i["state"] != "leased" for i in ims), 120)
        assert all(i["state"] in ("done", "queued") for i in images), images  # none failed
        assert metric(s.url, "bcg_leases_held") == 1
        landed = [i for i in images if i["state"] == "done"]
        assert len(landed) == 1 and landed[0]["candidate"] == 0, images  # the PNG that fitted counts
        assert all(i["attempts"] == 0 for i in images if i["state"] == "queued"), images  # given back, not spent
        time.sleep(2)  # held: no batch is leased while the disk is full
        assert [i["state"] for i in s.job(job["id"])["images"]] == [i["state"] for i in images]
        ready = httpx.get(s.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "no batch is leased" in ready.json()["detail"], ready.text
        assert metric(s.url, "bcg_images_failed_total") == 0 and metric(s.url, "bcg_worker_strikes_total") == 0

        os.unlink(f"{s.inside}/filler")  # the operator frees space: the batch is leased again and lands
        done = s.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
        assert done["state"] == "succeeded", done
        assert metric(s.url, "bcg_leases_held") == 0 and metric(s.url, "bcg_images_failed_total") == 0
        assert all(i["attempts"] == 1 for i in done["images"]), done["images"]  # each rendered once that counted
        served = {p.name: pixels(p) for p in Path(f"{s.inside}/jobs/{job['id']}/out/a").glob("*.png")}
        if kind == "upload":  # the uploading worker's copy keeps no PNG, sent or not
            eventually(lambda: list((tmp_path / "elsewhere" / "jobs").rglob("*.png")), lambda left: not left, 20)
    finally:
        s.kill_everything()
    path = tmp_path / "four.yaml"
    path.write_text(FOUR_LARGE)
    ref = render(load_job(path), RenderOptions(out_dir=tmp_path / "ref"), models=tiny_cpu).out_dir
    assert sorted(served) == sorted(p.name for p in (ref / "a").glob("*.png")) and len(served) == 4
    assert all(np.array_equal(served[name], pixels(ref / "a" / name)) for name in served)
    wrote = worker_log.read_text()
    assert "the server's job folders took no more PNGs" in wrote and "Traceback" not in wrote, wrote
    assert ("disk full: cannot write" if kind == "shared" else "the server's disk is full") in wrote, wrote
    logged = (tmp_path / "serve.log").read_text()
    assert logged.count("no batch is leased until") == 1 and logged.count("batches are leased again") == 1, logged


def _raising(e):
    """A function that raises `e`, whatever it is called with."""

    def call(*args, **kwargs):
        raise e

    return call


def _two_leased(c):
    """A job of two images submitted to the app `c` (a TestClient), and leased by a worker "w": (the job, the
    worker's id, the lease)."""
    job = c.post("/v1/jobs", content=ONE_IMAGE_JOB.replace("seed: 1", "seed: 1, candidates: 2"), headers=YAML).json()
    worker = c.post("/v1/workers", json={"name": "w"}).json()["worker"]
    lease = c.post("/v1/leases", json={"worker": worker}).json()
    assert len(lease["images"]) == 2
    return job, worker, lease


def test_a_completion_whose_lines_cannot_be_written_sends_its_images_back_and_holds_the_leases(tmp_path, monkeypatch):
    """The server cannot append a completion's manifest lines (ENOSPC): a 507, nothing recorded, the lease's images
    back in the queue with their attempts; no batch is leased until a megabyte more than then is free (the floor's
    worth, --min-free-mb 1), and then the same images are."""
    import errno

    from fastapi.testclient import TestClient

    from storyboard_cli.serve import disk, folders
    from storyboard_cli.serve.api import Settings, create_app

    free = [100 * MB]
    monkeypatch.setattr(disk.Disk, "free", lambda self: free[0])
    app = create_app(Settings(tmp_path / "root", lease_s=10, min_free_mb=1), clock=lambda: 0.0)
    with TestClient(app) as c:
        job, worker, lease = _two_leased(c)

        monkeypatch.setattr(folders, "record", _raising(OSError(errno.ENOSPC, "No space left on device")))
        free[0] = MB // 2
        r = c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": worker})
        assert r.status_code == 507 and "disk is full" in r.json()["detail"], r.text
        images = c.get(f"/v1/jobs/{job['id']}").json()["images"]
        assert [(i["state"], i["attempts"]) for i in images] == [("queued", 0)] * 2
        assert c.post("/v1/leases", json={"worker": worker}).status_code == 204  # held
        assert "no batch is leased until" in c.get("/readyz").json()["detail"]
        free[0] = MB // 2 + MB - 1
        assert c.post("/v1/leases", json={"worker": worker}).status_code == 204  # not yet a megabyte more
        free[0] = MB // 2 + MB
        again = c.post("/v1/leases", json={"worker": worker})
        assert again.status_code == 200 and [i["id"] for i in again.json()["images"]] == [i["id"] for i in images]


def test_a_completion_whose_lines_a_read_only_folder_refuses_holds_the_leases_until_it_is_writable(tmp_path,
                                                                                                    monkeypatch):
    """The server cannot append a completion's manifest lines because the job's folder turned read-only (EROFS): a
    507 that says so, nothing recorded, the lease's images back in the queue with their attempts; no batch is leased
    while the server cannot write that folder, whatever the free space, and the same images are once it can."""
    import errno

    from fastapi.testclient import TestClient

    from storyboard_cli.job import preflight
    from storyboard_cli.serve import folders
    from storyboard_cli.serve.api import Settings, create_app

    read_only = [False]
    real_access = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: not (read_only[0] and "/jobs/" in f"{p}/") and
                        real_access(p, mode))
    app = create_app(Settings(tmp_path / "root", lease_s=10, min_free_mb=1), clock=lambda: 0.0)
    with TestClient(app) as c:
        job, worker, lease = _two_leased(c)

        monkeypatch.setattr(folders, "record", _raising(OSError(errno.EROFS, "Read-only file system")))
        read_only[0] = True
        r = c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": worker})
        assert r.status_code == 507 and "cannot write under its root (Read-only file system)" in r.json()["detail"]
        images = c.get(f"/v1/jobs/{job['id']}").json()["images"]
        assert [(i["state"], i["attempts"]) for i in images] == [("queued", 0)] * 2
        assert c.post("/v1/leases", json={"worker": worker}).status_code == 204  # held
        assert "cannot write its job folders" in c.get("/readyz").json()["detail"]
        read_only[0] = False
        again = c.post("/v1/leases", json={"worker": worker})
        assert again.status_code == 200 and [i["id"] for i in again.json()["images"]] == [i["id"] for i in images]


def test_a_workers_full_disk_the_server_does_not_see_is_a_strike_not_a_hold(tmp_path, monkeypatch):
    """A worker on the shared folders says a PNG could not be written for want of space while the server's disk has
    more than --min-free-mb free (a quota of its own user, another filesystem at that path): its images not named go
    back with their attempts, the farm goes on leasing, and the worker takes a strike (quarantined at the third);
    under the floor the same report holds every lease instead."""
    from fastapi.testclient import TestClient

    from storyboard_cli.serve import disk
    from storyboard_cli.serve.api import Settings, create_app

    free = [100 * MB]
    monkeypatch.setattr(disk.Disk, "free", lambda self: free[0])
    app = create_app(Settings(tmp_path / "root", lease_s=10, min_free_mb=1), clock=lambda: 0.0)
    with TestClient(app) as c:
        job = c.post("/v1/jobs", content=ONE_IMAGE_JOB, headers=YAML).json()
        worker = c.post("/v1/workers", json={"name": "w"}).json()["worker"]
        for strike in (1, 2, 3):
            lease = c.post("/v1/leases", json={"worker": worker}).json()
            r = c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": worker, "disk_full": "disk full"})
            assert r.status_code == 200, r.text
            assert c.get(f"/v1/jobs/{job['id']}").json()["images"][0]["attempts"] == 0
            assert c.get("/metrics").text.count(f"bcg_worker_strikes_total {float(strike)}") == 1
        assert c.post("/v1/leases", json={"worker": worker}).status_code == 403  # quarantined
        other = c.post("/v1/workers", json={"name": "v"}).json()["worker"]
        lease = c.post("/v1/leases", json={"worker": other}).json()
        free[0] = MB // 2  # under the floor: the server's disk is full, the farm holds
        r = c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": other, "disk_full": "disk full"})
        assert r.status_code == 200 and c.post("/v1/leases", json={"worker": other}).status_code == 204
        assert "bcg_worker_strikes_total 3.0" in c.get("/metrics").text


def test_a_completion_names_disk_full_only_when_it_happened():
    """A worker's completion carries `disk_full` only when a PNG could not be written: otherwise its body is the one
    a server from before the field takes (a farm upgraded worker by worker, its server last)."""
    import json

    from storyboard_cli.serve.lease_session import Outcome

    plain = Outcome(done=[1])
    assert "disk_full" not in json.loads(plain.completion("w").model_dump_json(exclude_unset=True))
    full = Outcome(done=[1], disk_full="disk full: cannot write a.png")
    assert json.loads(full.completion("w").model_dump_json(exclude_unset=True))["disk_full"] == full.disk_full


# six candidates in batches of two: three leases
SIX_IN_THREE = """version: 1
model: tiny
buckets: [2]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, candidates: 6, seed: 1}
"""


def _jobs_mode(server, root, mode):
    """The job folders (root/jobs) made read-only, or writable again, in the server's mount namespace: a bind mount
    of them remounted (a file system remounted read-only after an I/O error, an NFS export turned read-only)."""
    jobs = f"{root}/jobs"
    bind = f"mount --bind {jobs} {jobs} && " if mode == "ro" else ""
    subprocess.run(["nsenter", "-t", str(server.proc.pid), "-m", "sh", "-c", f"{bind}mount -o remount,bind,{mode} "
                    f"{jobs}"], check=True, capture_output=True, timeout=30)


@pytest.mark.slow  # a server and a worker in a mount namespace, six tiny images
@pytest.mark.parametrize("kind", ["shared", "upload"])
def test_job_folders_turned_read_only_fail_no_image_and_the_job_ends_once_they_are_writable(tmp_path, kind):
    """`bcg serve` and a `bcg worker` in one mount namespace; the job folders turn read-only before the job's batches
    are leased. The worker (shared: it cannot write the server's folder; upload: the server cannot write what it
    sends) sends the images back with their attempts, takes no strike, and no batch is leased while the server cannot
    write there (/readyz says so); once they are writable again the job ends, every image on its first attempt. On
    the code before, each image failed at its first attempt (shared) or the uploads were answered 500 (upload)."""
    s, root, worker_log = _paused_with_a_worker(tmp_path, kind)
    try:
        job = httpx.post(s.url + "/v1/jobs", content=SIX_IN_THREE, headers=YAML, timeout=10).json()
        _jobs_mode(s, root, "ro")
        assert httpx.post(s.url + "/v1/queue/resume", timeout=10).status_code == 200

        eventually(lambda: metric(s.url, "bcg_leases_held"), lambda n: n == 1, 60)  # a lease's images came back
        images = eventually(lambda: s.job(job["id"])["images"], lambda ims: all(i["state"] == "queued" for i in ims),
                            30)
        assert all(i["attempts"] == 0 for i in images), images  # given back, not spent
        ready = httpx.get(s.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["title"] == "job folders not writable", ready.text
        assert "cannot write its job folders" in ready.json()["detail"], ready.text
        assert "read-only file system" in ready.json()["detail"], ready.text
        assert metric(s.url, "bcg_images_failed_total") == 0 and metric(s.url, "bcg_worker_strikes_total") == 0

        _jobs_mode(s, root, "rw")  # the operator makes them writable again: the job ends
        done = s.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
        assert done["state"] == "succeeded", [(i["state"], i["reason"]) for i in done["images"]]
        assert all(i["attempts"] == 1 for i in done["images"]), done["images"]
        assert metric(s.url, "bcg_leases_held") == 0 and metric(s.url, "bcg_images_failed_total") == 0
        assert len(list(Path(f"/proc/{s.proc.pid}/root{root}/jobs/{job['id']}/out/a").glob("*.png"))) == 6
    finally:
        s.kill_everything()
    logged = (tmp_path / "serve.log").read_text()
    assert logged.count("the server cannot write its job folders") == 1, logged
    assert logged.count("batches are leased again: the server can write") == 1 and "Traceback" not in logged, logged
    assert "Traceback" not in worker_log.read_text(), worker_log.read_text()


def _fill_to_the_last_byte(server):
    """A file of the operator's that takes every byte left on the server's disk."""
    fd = os.open(f"{server.inside}/filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


TWO_IN_TWO = """version: 1
model: tiny
buckets: [1]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, candidates: 2, seed: 1}
"""


@pytest.mark.slow  # a server on an 8 MB tmpfs, an uploading worker whose batches take 3 s, two tiny images
def test_a_queue_disk_full_to_the_last_byte_for_longer_than_lease_s_loses_no_lease_nor_registration(tmp_path):
    """The server's disk full to the last byte (its queue cannot record a heartbeat) for three times --lease-s while a
    worker renders: the worker is not forgotten and its lease does not expire (the time the queue could not be
    written counts against no lease, as a server's downtime does not); its completion, refused meanwhile, is sent
    again until it lands; once space is freed the job ends, each image on its first attempt, the worker never
    registered again. On the code before, the worker was forgotten (404: it registered again) and its lease
    expired, the image's attempt spent."""
    from helpers.serve import slow_batches, start_worker, stop

    lease_s = 3
    prefix = mount_namespace(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    s = Server(root, free_port())
    s.start(lease_s=lease_s, gpus="none", prefix=[*prefix, "sh", "-c", MOUNT.format(size=f"{TMPFS_MB}m"), str(root)],
            extra=["--min-free-mb", "1"])
    s.inside = f"/proc/{s.proc.pid}/root{root}"
    log = tmp_path / "worker.log"
    worker = None
    try:
        with open(log, "w") as err:
            worker = start_worker(s.url, "w", "--upload", "--root", str(tmp_path / "copies"),
                                  fault=slow_batches(tmp_path / "slow", 3), stderr=err)
        job = httpx.post(s.url + "/v1/jobs", content=TWO_IN_TWO, headers=YAML, timeout=10).json()
        eventually(lambda: s.job(job["id"])["images"], lambda ims: any(i["state"] == "leased" for i in ims), 60)
        _fill_to_the_last_byte(s)
        time.sleep(3 * lease_s)
        os.unlink(f"{s.inside}/filler")
        done = s.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
        assert done["state"] == "succeeded", [(i["state"], i["reason"]) for i in done["images"]]
        assert [i["attempts"] for i in done["images"]] == [1, 1], done["images"]
        assert metric(s.url, "bcg_lease_expiries_total") == 0
        said = log.read_text()
        assert "registering again" not in said and "Traceback" not in said, said
    finally:
        if worker is not None:
            stop(worker)
        s.kill_everything()
