"""A served job reads and writes only under the server's folders (--root and --allow-dir): a control image,
a LoRA, a model path or an output_dir elsewhere (by `..`, an absolute path or a symlink) is a 422 that names
the field, before the file is read. Through FastAPI's TestClient: no server process, no model."""

import shutil

import pytest
from fastapi.testclient import TestClient

from storyboard_cli.serve.api import Settings, create_app

from conftest import ROOT

YAML = {"Content-Type": "application/yaml"}


def job(control="", top=""):
    shot = f", control: {{image: '{control}', scale: 0.5}}" if control else ""
    return (f"version: 1\nmodel: tiny\ncontrolnet: tiny\n{top}defaults: {{steps: 2, size: 64x64}}\n"
            f"shots:\n  - {{id: a, prompt: a castle{shot}}}\n")


@pytest.fixture
def setup(tmp_path):
    root, inputs, outside = tmp_path / "root", tmp_path / "inputs", tmp_path / "outside"
    for folder in (root / "shared", inputs, outside):
        folder.mkdir(parents=True)
    for folder in (root / "shared", inputs, outside):
        shutil.copy(ROOT / "jobs" / "control" / "hero_pose.png", folder / "pose.png")
    (inputs / "escape.png").symlink_to(outside / "pose.png")  # a symlink in an allowed folder, to outside
    (outside / "inward.png").symlink_to(inputs / "pose.png")  # one from outside into an allowed folder
    app = create_app(Settings(root, inputs=(inputs,)))
    with TestClient(app) as c:
        yield c, root, inputs, outside


def post(client, body):
    return client.post("/v1/jobs", content=body, headers={**YAML, "X-Job-Filename": "ep.yaml"})


def refused(r, field, shot=None):
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert f"field '{field}'" in detail and "outside the folders this server may read and write" in detail, detail
    assert detail.startswith("ep.yaml:") and (shot is None or f"shot '{shot}'" in detail)
    return detail


def test_files_under_root_and_the_allowed_folders_are_accepted(setup):
    client, root, inputs, outside = setup
    assert post(client, job(str(inputs / "pose.png"))).status_code == 202
    assert post(client, job("../../shared/pose.png")).status_code == 202  # from <root>/jobs/<id>/ up to root
    assert post(client, job(str(outside / "inward.png"))).status_code == 202  # it resolves into inputs
    assert post(client, job(top="output_dir: renders/ep1\n")).status_code == 202


def test_control_images_outside_are_refused_by_dotdot_absolute_path_and_symlink(setup):
    client, root, inputs, outside = setup
    refused(post(client, job("../../../outside/pose.png")), "control.image", "a")
    refused(post(client, job(str(outside / "pose.png"))), "control.image", "a")
    refused(post(client, job(str(inputs / "escape.png"))), "control.image", "a")
    assert not list((root / "jobs").iterdir())  # nothing kept of the refused jobs


def test_loras_models_and_output_dirs_outside_are_refused_before_they_are_read(setup):
    client, root, inputs, outside = setup
    # none of these files exists: the answer is the confinement, not "file not found"
    refused(post(client, job(top=f"loras: {{ink: {outside}/ink.safetensors}}\n")), "loras.ink")
    refused(post(client, job(top="loras: {ink: ../../../ink.safetensors}\n")), "loras.ink")
    refused(post(client, job().replace("model: tiny", f"model: {outside}/sdxl.safetensors")), "model")
    refused(post(client, job().replace("controlnet: tiny", "controlnet: ../cn")), "controlnet")
    refused(post(client, job(top=f"output_dir: {outside}/renders\n")), "output_dir")
    refused(post(client, job(top="output_dir: ../../../renders\n")), "output_dir")
    line = refused(post(client, job(top="output_dir: /tmp\n")), "output_dir")
    assert line.startswith("ep.yaml:4 ")  # the line of the field, as `bcg plan` names it
