"""Workers without the server's filesystem: a worker whose root differs renders into its own copy of the
job folder and uploads the PNGs, their manifest lines and the report with the result; the server stores them
where a worker on a shared filesystem would have written them. The upload protocol through TestClient, then
a real server and a real `bcg worker --upload` on the tiny model."""

import json

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from storyboard_cli.folder.layout import INDEX, MANIFEST, REPORT_JSON
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render
from storyboard_cli.serve.api import Settings, create_app
from storyboard_cli.serve.wire import LeasedJob
from storyboard_cli.serve.worker import WorkerOptions, place

from conftest import write_job
from helpers.serve import Server, free_port, pixels, start_worker, stop

JOB = """version: 1
model: tiny
buckets: [1, 2]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 2}
  - {id: b, prompt: a tower, seed: 7, candidates: 1}
"""
OCTETS = {"Content-Type": "application/octet-stream"}
YAML = {"Content-Type": "application/yaml"}


def test_a_worker_renders_in_place_only_when_it_sees_the_servers_own_job_file(tmp_path):
    served = write_job(tmp_path, JOB)
    job = LeasedJob(path=str(served), out_dir=str(tmp_path / "out"), job_file="job.yaml", job_text=JOB)
    here = place("j1", job, WorkerOptions("http://s", root=tmp_path / "w"))
    assert not here.upload and here.out_dir == tmp_path / "out"
    forced = place("j1", job, WorkerOptions("http://s", root=tmp_path / "w", upload=True))
    assert forced.upload and forced.out_dir == (tmp_path / "w" / "jobs" / "j1" / "out").resolve()
    assert forced.job_file.read_text() == JOB
    elsewhere = place("j1", job.model_copy(update={"path": "/nowhere/job.yaml"}),
                      WorkerOptions("http://s", root=tmp_path / "w"))
    assert elsewhere.upload  # the server's folder is not visible here
    served.write_text(JOB + "# edited\n")
    assert place("j1", job, WorkerOptions("http://s", root=tmp_path / "w")).upload  # another file at that path


def test_uploads_are_confined_to_the_lease_and_dropped_once_it_is_lost(tmp_path):
    t = [0.0]
    app = create_app(Settings(tmp_path / "root", lease_s=10), clock=lambda: t[0])
    with TestClient(app) as c:
        job = c.post("/v1/jobs", content=JOB, headers=YAML).json()
        worker = c.post("/v1/workers", json={"name": "w"}).json()["worker"]
        lease = c.post("/v1/leases", json={"worker": worker}).json()
        assert lease["jobs"][job["id"]]["job_text"] == JOB and lease["jobs"][job["id"]]["job_file"] == "job.yaml"
        mine = lease["images"][0]["outputs"][0]
        url = f"/v1/leases/{lease['lease']}/files/{job['id']}/"
        mine_ = {"worker": worker}  # the lease's holder names itself
        other = c.post("/v1/workers", json={"name": "other"}).json()["worker"]
        assert c.put(url + mine, content=b"png", headers=OCTETS, params={"worker": other}).status_code == 403
        assert c.put(url + mine, content=b"png", headers=OCTETS).status_code == 422  # an older worker: names none
        assert c.put(url + mine, content=b"png", headers=OCTETS, params=mine_).status_code == 200
        out = tmp_path / "root" / "jobs" / job["id"] / "out"
        assert (out / mine).read_bytes() == b"png"
        for foreign in ("b/b_c0_s7.png", "../job.yaml", MANIFEST, "a/../../job.yaml"):
            r = c.put(url + foreign, content=b"x", headers=OCTETS, params=mine_)
            assert r.status_code in (404, 422), foreign
        assert (tmp_path / "root" / "jobs" / job["id"] / "job.yaml").read_text() == JOB
        assert c.put(f"/v1/leases/{lease['lease']}/files/other/{mine}", content=b"x", headers=OCTETS,
                     params=mine_).status_code == 422
        line = {"path": mine, "shot": "a"}
        for manifest in ({job["id"]: [{"path": "b/x.png"}]}, {"other": [line]}):
            bad = c.post(f"/v1/leases/{lease['lease']}/complete",
                         json={"worker": worker, "done": [], "manifest": manifest})
            assert bad.status_code == 422
        t[0] = 100.0  # the lease expires
        assert c.put(url + mine, content=b"late", headers=OCTETS, params=mine_).status_code == 410
        late = c.post(f"/v1/leases/{lease['lease']}/complete",
                      json={"worker": worker, "done": [lease["images"][0]["id"]], "manifest": {job["id"]: [line]}})
        assert late.status_code == 410 and not (out / MANIFEST).exists()
        assert (out / mine).read_bytes() == b"png"


@pytest.mark.slow  # a server and a rendering worker process: 8-14 s on 2 cores
def test_a_worker_with_another_root_uploads_what_a_shared_worker_would_write(tmp_path, tiny_cpu):
    path = write_job(tmp_path, JOB)
    server = Server(tmp_path / "root", free_port())
    server.start(lease_s=10, gpus="none")
    worker = start_worker(server.url, "remote", "--upload", "--root", str(tmp_path / "elsewhere"))
    try:
        job_id = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(), headers=YAML).json()["id"]
        job = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed"))
        assert job["state"] == "succeeded"
        served = server.root / "jobs" / job_id / "out"
        ref = render(load_job(path), RenderOptions(out_dir=tmp_path / "ref"), models=tiny_cpu).out_dir
        names = sorted(p.relative_to(ref).as_posix() for p in ref.glob("*/*.png"))
        assert names == sorted(p.relative_to(served).as_posix() for p in served.glob("*/*.png"))
        for name in names:
            assert np.abs(pixels(served / name) - pixels(ref / name)).max() == 0, name
        lines = [json.loads(x) for x in (served / MANIFEST).read_text().splitlines()]
        assert sorted(r["path"] for r in lines) == names
        ref_lines = {r["path"]: r for r in map(json.loads, (ref / MANIFEST).read_text().splitlines())}
        assert all(r["sha256"] == ref_lines[r["path"]]["sha256"] for r in lines)
        assert (served / INDEX).is_file() and json.loads((served / REPORT_JSON).read_text())["status"] == "done"
        copy = (tmp_path / "elsewhere" / "jobs" / job_id / "out").resolve()
        assert sorted(p.relative_to(copy).as_posix() for p in copy.glob("*/*.png")) == names  # rendered there

        again = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(), headers=YAML).json()["id"]
        twin = server.wait(again, lambda j: j["state"] in ("succeeded", "failed"))
        assert twin["state"] == "succeeded" and all(i["cached"] for i in twin["images"])  # twins fetched over HTTP
        for name in names:
            assert np.abs(pixels(server.root / "jobs" / again / "out" / name) - pixels(ref / name)).max() == 0
    finally:
        stop(worker)
        server.kill_everything()
