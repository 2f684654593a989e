"""Inputs travel with the job as content-addressed blobs.

- The README's serve example as written: `bcg serve --gpus cpu`, then `bcg submit jobs/episode1.yaml --wait` from
  the project folder uploads the job's LoRA and control images and renders what `bcg render` renders, pixel for
  pixel; submitting it again uploads 0 bytes.
- A worker that does not share the server's filesystem (`bcg worker --upload --root elsewhere`) downloads each
  input once, checks its digest, and renders the same pixels.
- A file named by a server path is copied into the blob store at submission: swapping it for a symlink to
  another file after the 202 changes nothing the worker reads.
- The blob routes themselves (TestClient): what is missing, an upload checked against its digest, the size cap.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render
from storyboard_cli.serve.api import Settings, create_app

from conftest import ROOT
from helpers.serve import Server, free_port, start_worker, stop

DEADLINE_S = 240


def bcg(*args, timeout=DEADLINE_S):
    return subprocess.run([sys.executable, "-m", "storyboard_cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def pngs(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*.png") if "thumbs" not in p.parts)


def assert_same_pixels(a, b):
    assert pngs(a) == pngs(b) and pngs(a), (pngs(a), pngs(b))
    for rel in pngs(a):
        assert np.array_equal(np.asarray(Image.open(a / rel)), np.asarray(Image.open(b / rel))), rel


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_readme_serve_example_works_as_written(tmp_path, tiny_cpu):
    server = Server(tmp_path / "root", free_port()).start(gpus="cpu")
    try:
        first = bcg("submit", "jobs/episode1.yaml", "--server", server.url, "--wait")
        assert first.returncode == 0, first.stderr
        assert "inputs: 3 uploaded" in first.stderr, first.stderr  # the LoRA and the two control images
        job_id = first.stdout.split()[-1]
        again = bcg("submit", "jobs/episode1.yaml", "--server", server.url)
        assert again.returncode == 0, again.stderr
        assert "inputs: 0 uploaded (0 B), 3 already on the server" in again.stderr, again.stderr
    finally:
        server.kill_everything()
    blobs = {p.name for p in (tmp_path / "root" / "blobs").rglob("*") if p.is_file() and "." not in p.name}
    assert blobs == {sha256(ROOT / "jobs" / f) for f in ("loras/mei.safetensors", "control/hero_pose.png",
                                                        "control/valley_layout.png")}
    ref = tmp_path / "ref"
    assert render(load_job(ROOT / "jobs" / "episode1.yaml"), RenderOptions(out_dir=ref), models=tiny_cpu).rendered == 23
    assert_same_pixels(tmp_path / "root" / "jobs" / job_id / "out", ref)


def _remote_worker_renders(server, root, job_ids) -> set[str]:
    """A worker without the server's files (`--upload`, its own --root) renders the jobs, each must succeed; then
    everything is stopped. Returns the blobs the worker downloaded (by sha256)."""
    worker = None
    try:
        worker = start_worker(server.url, "remote", "--upload", "--root", str(root))
        for job_id in job_ids:
            done = server.wait(job_id, lambda j: j["state"] in ("succeeded", "failed", "canceled"))
            assert done["state"] == "succeeded", done
    finally:
        if worker is not None:
            stop(worker)
        server.kill_everything()
    return {p.name for p in (root / "blobs").rglob("*") if p.is_file() and "." not in p.name}


POSE_JOB = """version: 1
model: tiny
controlnet: tiny
defaults: {{steps: 2, size: 64x64}}
shots:
  - {{id: posed, prompt: a keeper on the stairs, seed: 3, control: {{image: '{pose}', scale: 0.9}}}}
"""


@pytest.mark.slow
def test_a_worker_without_the_servers_files_downloads_them_and_a_swap_after_submission_reaches_nothing(
        tmp_path, tiny_cpu):
    # the example job at 2 steps, with its LoRA and control images beside it, on a laptop's disk
    laptop = tmp_path / "laptop"
    for folder in ("loras", "control"):
        shutil.copytree(ROOT / "jobs" / folder, laptop / folder)
    (laptop / "ep.yaml").write_text((ROOT / "jobs" / "episode1.yaml").read_text().replace("steps: 12", "steps: 2"))
    # a control image the job names by a path under the server's root, swapped after submission
    root = tmp_path / "root"
    (root / "inputs").mkdir(parents=True)
    pose = root / "inputs" / "pose.png"
    shutil.copy(ROOT / "jobs" / "control" / "hero_pose.png", pose)
    outside = tmp_path / "outside.png"
    shutil.copy(ROOT / "jobs" / "control" / "valley_layout.png", outside)
    (laptop / "posed.yaml").write_text(POSE_JOB.format(pose=pose))

    server = Server(root, free_port()).start(gpus="none")
    try:
        submitted = [bcg("submit", str(laptop / name), "--server", server.url, "--json") for name in
                     ("ep.yaml", "posed.yaml")]
        assert all(r.returncode == 0 for r in submitted), [r.stderr for r in submitted]
        ep, posed = (json.loads(r.stdout)["id"] for r in submitted)
        pose.unlink()
        pose.symlink_to(outside)  # after the 202: the worker must not follow it
    except BaseException:
        server.kill_everything()
        raise
    cached = _remote_worker_renders(server, tmp_path / "w", [ep, posed])
    assert cached == {sha256(laptop / "loras" / "mei.safetensors"), sha256(laptop / "control" / "hero_pose.png"),
                      sha256(laptop / "control" / "valley_layout.png")}  # each downloaded once
    ref = tmp_path / "ref"
    job = load_job(laptop / "ep.yaml")
    assert render(job, RenderOptions(out_dir=ref), models=tiny_cpu).rendered == 23
    assert_same_pixels(root / "jobs" / ep / "out", ref)

    shutil.copy(ROOT / "jobs" / "control" / "hero_pose.png", tmp_path / "pose.png")  # the file as it was submitted
    (tmp_path / "orig.yaml").write_text(POSE_JOB.format(pose=tmp_path / "pose.png"))
    render(load_job(tmp_path / "orig.yaml"), RenderOptions(out_dir=tmp_path / "orig"), models=tiny_cpu)
    assert_same_pixels(root / "jobs" / posed / "out", tmp_path / "orig")
    png = Image.open(next((root / "jobs" / posed / "out" / "posed").glob("*.png")))
    meta = json.loads(png.text["bcg"])
    assert sha256(tmp_path / "pose.png").startswith(meta["control_sha256"]) and meta["control_image"].endswith("pose.png")
    assert "ControlNet: pose.png (scale 0.9)" in png.text["parameters"]  # the job's name for it, not the blob's


@pytest.mark.slow
def test_the_characters_example_served_to_a_remote_worker_renders_what_bcg_render_does(tmp_path):
    """References, a character's LoRA and two nets' guides travel as blobs: a worker without the server's files
    downloads each once and renders the pixels `bcg render` renders, with the same report of characters."""
    laptop = tmp_path / "laptop"
    for folder in ("loras", "control", "refs"):
        shutil.copytree(ROOT / "jobs" / folder, laptop / folder)
    shutil.copy(ROOT / "jobs" / "characters.yaml", laptop / "characters.yaml")
    server = Server(tmp_path / "root", free_port()).start(gpus="none")
    try:
        sent = bcg("submit", str(laptop / "characters.yaml"), "--server", server.url, "--json")
        assert sent.returncode == 0, sent.stderr
        assert "inputs: 5 uploaded" in sent.stderr, sent.stderr  # the LoRA, two guides, two references
        job_id = json.loads(sent.stdout)["id"]
    except BaseException:
        server.kill_everything()
        raise
    cached = _remote_worker_renders(server, tmp_path / "w", [job_id])
    assert cached == {sha256(laptop / f) for f in ("loras/mei.safetensors", "control/mei_pose.png",
                                                  "control/window_depth.png", "refs/mei.png", "refs/stranger.png")}
    ref = tmp_path / "ref"
    rendered = bcg("render", str(laptop / "characters.yaml"), "--out", str(ref), "--quiet")
    assert rendered.returncode == 0, rendered.stderr
    out = tmp_path / "root" / "jobs" / job_id / "out"
    assert_same_pixels(out, ref)
    served = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in served["characters"]] == ["mei"]
    assert served["characters"] == json.loads((ref / "report.json").read_text())["characters"]


# ---------------------------------------------------------------- the routes, in process

@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(tmp_path / "root", max_blob_mb=1))
    with TestClient(app) as c:
        yield c


def test_missing_then_put_then_get(client, tmp_path):
    data = b"a control image, say"
    digest = hashlib.sha256(data).hexdigest()
    other = hashlib.sha256(b"other").hexdigest()
    assert client.post("/v1/blobs/missing", json={"digests": [digest, other]}).json() == {"missing": [digest, other]}
    r = client.put(f"/v1/blobs/{digest}", content=data)
    assert r.status_code == 201 and r.json() == {"sha256": digest, "size": len(data), "created": True}
    assert client.put(f"/v1/blobs/{digest}", content=data).status_code == 200  # stored once
    assert client.post("/v1/blobs/missing", json={"digests": [digest, other]}).json() == {"missing": [other]}
    assert client.get(f"/v1/blobs/{digest}").content == data
    assert client.get(f"/v1/blobs/{other}").status_code == 404
    stored = tmp_path / "root" / "blobs" / digest[:2] / digest
    assert stored.read_bytes() == data and not stored.stat().st_mode & 0o222  # read-only


def test_an_upload_whose_bytes_do_not_match_its_digest_or_exceed_the_cap_is_refused_and_leaves_nothing(client,
                                                                                                     tmp_path):
    digest = hashlib.sha256(b"what was promised").hexdigest()
    r = client.put(f"/v1/blobs/{digest}", content=b"something else")
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
    big = b"x" * (2 << 20)
    r = client.put(f"/v1/blobs/{hashlib.sha256(big).hexdigest()}", content=big)
    assert r.status_code == 413, r.text
    assert client.put("/v1/blobs/not-a-digest", content=b"x").status_code == 422
    blobs = tmp_path / "root" / "blobs"
    assert not [p for p in blobs.rglob("*") if p.is_file()]  # no temporary file left either


def test_a_job_naming_an_input_the_server_lacks_is_a_422_naming_the_field(client):
    body = ("version: 1\nmodel: tiny\nloras: {ink: loras/ink.safetensors}\ndefaults: {steps: 2, size: 64x64}\n"
            "shots:\n  - {id: a, prompt: p}\ninputs:\n  loras/ink.safetensors: " + "ab" * 32 + "\n")
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml", "X-Job-Filename": "ep.yaml"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith("ep.yaml:3 field 'loras.ink': loras/ink.safetensors") and "not been uploaded" in detail
    assert str(client.app.state.settings.root) not in detail  # no server path in the message


def test_upload_speed_of_a_200_mb_file_over_loopback(tmp_path):
    """The issue's number: 200 MB/s or more for a 200 MB LoRA over loopback into a real server (recorded in
    docs/PERFORMANCE.md; asserted here at a quarter of it, for a loaded CI machine)."""
    import os
    import time

    data = os.urandom(200 * 10**6)
    digest = hashlib.sha256(data).hexdigest()
    server = Server(tmp_path / "root", free_port()).start(gpus="none")
    try:
        t0 = time.perf_counter()
        r = httpx.put(f"{server.url}/v1/blobs/{digest}", content=iter(data[i:i + (1 << 20)] for i in
                                                                         range(0, len(data), 1 << 20)),
                      headers={"Content-Length": str(len(data))}, timeout=120)
        seconds = time.perf_counter() - t0
    finally:
        server.kill_everything()
    assert r.status_code == 201, r.text
    print(f"200 MB upload: {seconds:.2f} s, {200 / seconds:.0f} MB/s")
    assert 200 / seconds >= 50
