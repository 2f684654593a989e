"""The server's --root as given (the default `bcg-serve` is relative): started again on the same folder from another
working directory, or with another spelling of it, its queued jobs render and its finished jobs' files are served.
Real `bcg serve` processes and the server's own worker."""

import hashlib
import sqlite3
from contextlib import closing

import httpx
import pytest

from storyboard_cli.serve.store import DB

from helpers.serve import ONE_IMAGE_JOB, YAML, Server, eventually, free_port, register


PNG = b"\x89PNG\r\n\x1a\n as a worker left it"


@pytest.fixture
def folders(tmp_path):
    """`a/` (the root's parent, where the server first starts) and `b/` (another working directory)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    return tmp_path / "a", tmp_path / "b"


def _submit(url, seed):
    r = httpx.post(url + "/v1/jobs", content=ONE_IMAGE_JOB.replace("seed: 1", f"seed: {seed}"), headers=YAML,
                   timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _complete_by_hand(server, root):
    """Leases the next batch and completes it with PNGs written where a worker would have (the test's bytes: what
    is checked is that the server finds and serves them); {job: its image's output path}."""
    worker = register(server.url, "t")
    lease = httpx.post(server.url + "/v1/leases", json={"worker": worker}, timeout=10).json()
    lines = {}
    for image in lease["images"]:
        png = root / "jobs" / image["job"] / "out" / image["outputs"][0]
        png.parent.mkdir(parents=True)
        png.write_bytes(PNG)
        lines[image["job"]] = [{"path": image["outputs"][0], "sha256": hashlib.sha256(PNG).hexdigest()}]
    r = httpx.post(f"{server.url}/v1/leases/{lease['lease']}/complete",
                   json={"worker": worker, "done": [i["id"] for i in lease["images"]], "manifest": lines}, timeout=10)
    assert r.status_code == 200, r.text
    return {job: lines[job][0]["path"] for job in lines}


def _legacy(db, job_id, folder):
    """The row as bcg wrote it before paths were stored relative to the root: `folder` is the root's path as the
    server then took it (relative to its working directory, or absolute)."""
    db.execute("UPDATE jobs SET path = ?, out_dir = ? WHERE id = ?",
               (f"{folder}/jobs/{job_id}/job.yaml", f"{folder}/jobs/{job_id}/out", job_id))


@pytest.mark.slow
def test_a_relative_root_served_again_from_another_working_directory(folders):
    """Started in `a/` with `--root bcg-serve`, then in `b/` with `--root ../a/bcg-serve`: the queued jobs render
    and the finished jobs' files are served, and so are the rows of a queue written before paths were stored
    relative to the root (relative to the old working directory, or absolute), which are repaired."""
    a, b = folders
    server = Server(a / "bcg-serve", free_port())
    try:
        server.start(gpus="none", cwd=a, root="bcg-serve")
        done = [_submit(server.url, seed) for seed in (1, 2)]
        outputs = {}
        while len(outputs) < len(done):  # one lease, or one per job: as the scheduler batches them
            outputs.update(_complete_by_hand(server, a / "bcg-serve"))
        assert server.job(done[0])["state"] == server.job(done[1])["state"] == "succeeded"
        pngs = [outputs[j] for j in done]
        queued = [_submit(server.url, seed) for seed in (3, 4)]
        server.kill_everything()
        with closing(sqlite3.connect(a / "bcg-serve" / DB)) as db, db:
            _legacy(db, done[1], a / "bcg-serve")
            _legacy(db, queued[1], "bcg-serve")

        server.start(gpus="cpu", cwd=b, root="../a/bcg-serve")  # another cwd, another spelling of the root
        for job_id in queued:
            job = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
            assert job["state"] == "succeeded", job["images"][0]["reason"]
            pngs.append(job["images"][0]["outputs"][0])
        for job_id, png in zip(done + queued, pngs):
            r = httpx.get(f"{server.url}/v1/jobs/{job_id}/files/{png}", timeout=10)
            assert r.status_code == 200 and r.content.startswith(b"\x89PNG"), (job_id, r.text)
            report = eventually(lambda: httpx.get(f"{server.url}/v1/jobs/{job_id}/files/report.json", timeout=10),
                                lambda r: r.status_code == 200, 30)  # rebuilt off the request path
            assert report.json()["images_rendered"] == 1
    finally:
        if server.proc.poll() is None:
            server.kill_everything()
    with closing(sqlite3.connect(a / "bcg-serve" / DB)) as db:
        rows = sorted(db.execute("SELECT id, path, out_dir FROM jobs"))
    assert rows == sorted((j, f"jobs/{j}/job.yaml", f"jobs/{j}/out") for j in done + queued)
