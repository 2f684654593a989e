"""Workers without the server's filesystem: a worker whose root differs renders into its own copy of the
job folder and uploads the PNGs, their manifest lines and the report with the result; the server stores them
where a worker on a shared filesystem would have written them. The upload protocol through TestClient, then
a real server and a real `bcg worker --upload` on the tiny model."""

import json
import time

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
from helpers.serve import Server, eventually, free_port, pixels, start_worker, stop

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
        assert sorted(p.name for p in copy.iterdir()) == ["a", "b"]  # rendered there,
        assert not list(copy.rglob("*.png"))  # and each PNG removed once sent

        again = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(), headers=YAML).json()["id"]
        twin = server.wait(again, lambda j: j["state"] in ("succeeded", "failed"))
        assert twin["state"] == "succeeded" and all(i["cached"] for i in twin["images"])  # twins fetched over HTTP
        for name in names:
            assert np.abs(pixels(server.root / "jobs" / again / "out" / name) - pixels(ref / name)).max() == 0
        assert not list((tmp_path / "elsewhere").rglob("*.png"))  # neither the copies nor the twins downloaded
    finally:
        stop(worker)
        server.kill_everything()


def test_a_workers_store_is_trimmed_least_recently_used_first_and_keeps_what_it_is_told(tmp_path):
    import os

    from storyboard_cli.serve.blobs import BlobStore

    store = BlobStore(tmp_path / "w")
    old, kept, mid, new = (store.put(bytes([i]) * 1000) for i in range(4))
    for age, digest in enumerate((new, mid, kept, old)):  # old: used longest ago
        os.utime(store.path(digest), (1000 - 100 * age, 1000 - 100 * age))
    store.path(old, ".png")  # a named link goes with its blob
    os.utime(store.path(old), (600, 600))
    assert store.trim(4000, set()) == ([], 0)  # within the bound: nothing
    assert store.trim(2000, {kept}) == ([old, mid], 2000)  # kept is older than mid, but named
    assert not store.has(old) and not list(store.dir.glob(f"*/{old}*")) and store.used() == 2000
    assert store.trim(0, {kept, new}) == ([], 0) and store.has(kept) and store.has(new)
    assert store.trim(0, set(), grace_s=150, now=1000) == ([kept], 1000)  # new: used at 1000, within the grace


def test_a_lease_touches_its_files_and_a_job_whose_file_another_worker_removed_is_loaded_again(tmp_path):
    """Two workers on one --root (a Slurm array's tasks, systemd's instances): one's trim may remove a file the other
    loaded a job with. At each lease a worker counts its files as used (the other's trim keeps them for the grace)
    and forgets a loaded job whose file is gone: its next load downloads it again."""
    import os

    from storyboard_cli.serve.inputs_cache import InputFiles
    from storyboard_cli.serve.lease_session import Hot

    files = InputFiles(None, tmp_path / "w", shared=False)
    here, gone = files.cache.put(b"a control image"), "0" * 64
    os.utime(files.cache.path(here), (1000, 1000))
    hot = Hot(jobs={("j1", JOB, (("pose.png", here),), None): "job 1", ("j2", JOB, (("pose.png", gone),), None): "2"})
    assert files.lease_starts({here, gone}) == {gone}
    assert os.stat(tmp_path / "w" / "blobs" / here[:2] / here).st_mtime > 1000  # used now
    hot.drop_inputs({gone})
    assert list(hot.jobs.values()) == ["job 1"]
    assert InputFiles(None, tmp_path / "w", shared=True).lease_starts({gone}) == set()  # the server's store: its own



def test_a_lease_done_removes_only_the_pngs_it_wrote_into_a_copy_never_the_servers_own(tmp_path):
    """--upload with the server's own root as --root: the copy is the server's folder, and nothing in it is removed."""
    from storyboard_cli.serve.inputs_cache import InputFiles
    from storyboard_cli.serve.lease_session import Hot, Outcome
    from storyboard_cli.serve.wire import Lease
    from storyboard_cli.serve.worker import tidy

    (tmp_path / "root" / "jobs" / "j1").mkdir(parents=True)
    served = write_job(tmp_path / "root" / "jobs" / "j1", JOB)  # the server's job folder
    job = LeasedJob(path=str(served), out_dir=str(served.parent / "out"), job_file="job.yaml", job_text=JOB)
    lease = Lease(lease="l1", job="j1", jobs={"j1": job}, expires=0, ttl=10, images=[])
    outcome = Outcome(records={"j1": [{"path": "a/a_c0_s1.png"}]})
    for root, removed in ((tmp_path / "root", False), (tmp_path / "w", True)):  # the server's root; its own
        where = place("j1", job, WorkerOptions("http://s", root=root, upload=True))
        png = where.out_dir / "a" / "a_c0_s1.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(b"png")
        other = png.with_name("a_c1_s2.png")  # not the lease's
        other.write_bytes(b"png")
        tidy(lease, {"j1": where}, outcome, InputFiles(None, root.resolve()), Hot())
        assert png.exists() != removed and other.exists(), root

LORA_JOB = """version: 1
model: tiny
controlnet: tiny
loras: {mei: LORA}
buckets: [1]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a keeper, seed: SEED, lora: {mei: 0.8}, control: {image: CONTROL, scale: 0.8}}
"""


@pytest.mark.slow  # a server and a rendering worker process, four jobs one after another
def test_a_remote_workers_disk_keeps_neither_the_pngs_it_sent_nor_inputs_past_its_bound(tmp_path):
    """A worker without the server's files (its own --root, --upload): once a lease is done, its copies of the job
    folders hold none of the PNGs it sent, and with --max-inputs-gb 0 its store holds only the files of the last
    lease's jobs (of those older than the grace a file used lately keeps: each job's are aged past it, as if the
    jobs came that far apart): a job whose files were removed downloads them again and renders the same pixels."""
    import hashlib
    import os
    import shutil

    from storyboard_cli.serve.inputs_cache import TRIM_GRACE_S

    from storyboard_cli.serve import client

    from conftest import ROOT

    for name, src in (("pose.png", "jobs/control/hero_pose.png"), ("valley.png", "jobs/control/valley_layout.png"),
                      ("mei.safetensors", "jobs/loras/mei.safetensors")):
        shutil.copy(ROOT / src, tmp_path / name)
    digest = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
              for name in ("pose.png", "valley.png", "mei.safetensors")}
    server = Server(tmp_path / "root", free_port())
    server.start(lease_s=10, gpus="none")
    here = tmp_path / "elsewhere"
    worker = start_worker(server.url, "remote", "--upload", "--root", str(here), "--max-inputs-gb", "0")
    try:
        done = []
        for name, control, seed in (("a", "pose.png", 1), ("b", "valley.png", 2), ("a2", "pose.png", 1)):
            path = write_job(tmp_path, LORA_JOB.replace("LORA", "mei.safetensors").replace("CONTROL", control)
                             .replace("SEED", str(seed)), f"{name}.yaml")
            job = client.submit(path, server.url)  # uploads the control image and the LoRA
            assert server.wait(job["id"], lambda j: j["state"] in ("succeeded", "failed"))["state"] == "succeeded"
            done.append(job["id"])
            # the worker tidies once the server has taken the lease's completion: the job's end, not before it
            eventually(lambda: ({p.name for p in (here / "blobs").glob("*/*") if "." not in p.name},
                                list((here / "jobs").rglob("*.png"))),
                       # the other image: removed; every PNG it wrote: sent, then removed
                       lambda disk: disk == ({digest[control], digest["mei.safetensors"]}, []), timeout_s=20)
            long_ago = time.time() - TRIM_GRACE_S - 60
            for blob in (here / "blobs").glob("*/*"):
                os.utime(blob, (long_ago, long_ago))
        first, again = (server.root / "jobs" / j / "out" / "a" for j in (done[0], done[2]))
        (png,) = [p.name for p in first.glob("*.png")]
        assert np.array_equal(pixels(first / png), pixels(again / png))
        assert not (server.root / "jobs" / done[0] / "out" / "a" / png).samefile(again / png)
    finally:
        stop(worker)
        server.kill_everything()
