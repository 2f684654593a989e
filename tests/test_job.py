"""Pure tests for job parsing and validation (no torch, milliseconds)."""

import os
import shutil
from pathlib import Path

import pytest

from conftest import DATA, ROOT, write_job
from storyboard_cli.errors import JobError
from storyboard_cli.job.file import NAMED_SIZES, load_job, parse_size

BAD = sorted((DATA / "bad_jobs").glob("*.yaml"))


def _expectation(path: Path) -> tuple[str, int]:
    head = path.read_bytes().decode("utf-8", "replace").splitlines()
    expect = next((l[len("# expect: "):] for l in head if l.startswith("# expect: ")), "the job file is empty")
    line = next((int(l[len("# line: "):]) for l in head if l.startswith("# line: ")), 1)
    return expect, line


def test_corpus_is_large_enough():
    assert len(BAD) >= 30


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_job_names_file_line_and_field(path):
    expect, line = _expectation(path)
    with pytest.raises(JobError) as info:
        load_job(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}"), message
    assert expect in message, message


def test_example_job_is_valid_and_rich_enough():
    job = load_job(ROOT / "jobs" / "episode1.yaml")
    assert len(job.shots) >= 10
    assert len({(s.width, s.height) for s in job.shots}) >= 3
    assert {s.candidates for s in job.shots} >= {1, 2, 3, 4}
    assert sum(bool(s.controls) for s in job.shots) >= 2
    assert all(c.image.is_file() for s in job.shots for c in s.controls)


def test_defaults_merge_keys_and_named_sizes(tmp_path):
    path = write_job(tmp_path, """
version: 1
name: t
model: tiny
defaults: &d
  steps: 12
  size: portrait
  guidance: 4
shots:
  - id: a
    prompt: one
  - id: b
    <<: *d
    prompt: two
    steps: 20
    size: 512x768
""")
    job = load_job(path)
    a, b = job.shots
    assert (a.width, a.height, a.steps, a.guidance, a.sampler) == (832, 1216, 12, 4.0, "euler")
    assert (b.width, b.height, b.steps) == (512, 768, 20)
    assert job.buckets == (1, 2, 3, 4, 5, 6, 7, 8)
    assert job.output_dir == Path("outputs") / "t"


def test_default_seed_is_stable_and_per_shot(tmp_path):
    text = "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n  - {id: b, prompt: x}\n"
    one, two = load_job(write_job(tmp_path, text)), load_job(write_job(tmp_path, text, "again.yaml"))
    assert [s.seed for s in one.shots] == [s.seed for s in two.shots]
    assert one.shots[0].seed != one.shots[1].seed


def test_control_path_resolves_relative_to_the_job_file(tmp_path, job_dir):
    sub = job_dir / "nested"
    sub.mkdir()
    path = write_job(sub, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                          "  - {id: a, prompt: x, control: {image: ../control/hero_pose.png, scale: 0.5}}\n")
    shot = load_job(path).shots[0]
    assert shot.controls[0].image == (job_dir / "control" / "hero_pose.png").resolve()
    assert shot.controls[0].scale == 0.5


@pytest.mark.parametrize("text,size", [("square", (1024, 1024)), ("640x480", (640, 480)), ("WIDE", (1344, 768)),
                                       ("512 x 512", (512, 512))])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_named_sizes_are_sdxl_buckets():
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in NAMED_SIZES.values())


# ---------------------------------------------------------------- LoRAs, names, paths

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"


def _lora_job(tmp_path, shots: str, defaults: str = "") -> str:
    return (f"version: 1\nname: t\nmodel: tiny\nloras:\n  mei: {MEI}\n  ink: {MEI}\n{defaults}shots:\n{shots}")


def test_loras_by_field_by_tag_and_from_defaults(tmp_path):
    job = load_job(write_job(tmp_path, _lora_job(tmp_path, (
        "  - {id: a, prompt: 'mei walks <lora:mei:0.8> at night'}\n"
        "  - {id: b, prompt: mei walks at night, lora: {mei: 0.8, ink: 0.25}}\n"
        "  - {id: c, prompt: 'a boat <lora:ink>', lora: {mei: 0}}\n"
        "  - {id: d, prompt: 'a boat <lora:mei:0.8>', lora: {mei: 0.8, ink: -0.5}}\n"
        "  - {id: e, prompt: a hut}\n"), "defaults:\n  lora: {ink: 0.25}\n")))
    a, b, c, d, e = job.shots
    assert (a.prompt, a.loras) == ("mei walks at night", (("ink", 0.25), ("mei", 0.8)))  # a tag adds to defaults
    assert (b.prompt, b.loras) == (a.prompt, a.loras)  # the tag and the field are the same request
    assert (c.prompt, c.loras) == ("a boat", (("ink", 1.0),))  # a zero scale applies nothing
    assert d.loras == (("ink", -0.5), ("mei", 0.8))
    assert e.loras == (("ink", 0.25),)
    mei = job.loras["mei"]
    assert mei.path == MEI and mei.sha256.startswith(mei.shorthash) and len(mei.shorthash) == 12
    assert mei.text_encoders and mei.file == os.path.relpath(MEI, tmp_path)


def test_lora_path_is_relative_to_the_job_file(tmp_path):
    (tmp_path / "loras").mkdir()
    shutil.copy(MEI, tmp_path / "loras" / "mei.safetensors")
    sub = tmp_path / "jobs"
    sub.mkdir()
    job = load_job(write_job(sub, "version: 1\nmodel: tiny\nloras: {mei: ../loras/mei.safetensors}\n"
                                  "shots:\n  - {id: a, prompt: x, lora: {mei: 1}}\n"))
    assert job.loras["mei"].path == tmp_path / "loras" / "mei.safetensors"
    assert job.loras["mei"].file == "../loras/mei.safetensors"


def test_a_job_named_by_a_file_with_spaces_gets_a_safe_name(tmp_path):
    text = "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n"
    job = load_job(write_job(tmp_path, text, "ep 1 (final v2).yaml"))
    assert job.name == "ep-1-final-v2" and job.output_dir == Path("outputs") / "ep-1-final-v2"
    with pytest.raises(JobError) as info:
        load_job(write_job(tmp_path, text, "(((.yaml"))
    assert "add a top-level 'name:'" in str(info.value) and "field 'name'" not in str(info.value)


def test_output_dir_expands_the_home_folder(tmp_path):
    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\noutput_dir: ~/renders/x\nshots:\n"
                                       "  - {id: a, prompt: x}\n"))
    assert job.output_dir == Path.home() / "renders" / "x"


@pytest.mark.parametrize("shot_id", ["index.html", "manifest.jsonl", "report.md", "selects", "Thumbs", "picks.json"])
def test_shot_ids_that_name_bcgs_own_files_are_refused(tmp_path, shot_id):
    with pytest.raises(JobError, match="is a name bcg uses in the output folder"):
        load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - {{id: {shot_id}, prompt: x}}\n"))


def test_a_control_image_shared_by_shots_is_decoded_once(job_dir, monkeypatch):
    from PIL import Image

    loads = []
    real = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: loads.append(a) or real(*a, **k))
    load_job(write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n" + "".join(
        f"  - {{id: s{i}, prompt: x, control: {{image: control/hero_pose.png}}}}\n" for i in range(5))))
    assert len(loads) == 1


def test_a_job_named_by_a_file_with_accents_keeps_its_letters(tmp_path):
    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n", "épisode.yaml"))
    assert job.name == "episode"


def test_lora_tags_as_model_sites_write_them_are_applied(tmp_path):
    job = load_job(write_job(tmp_path, _lora_job(tmp_path, (
        "  - {id: a, prompt: 'mei walks <lora:mei:0.8> at night'}\n"
        "  - {id: b, prompt: 'mei walks <LORA:mei:0.8> at night'}\n"
        "  - {id: c, prompt: 'mei walks <lyco:mei:0.8> at night'}\n"))))
    a, b, c = job.shots
    assert (a.prompt, a.loras) == (b.prompt, b.loras) == (c.prompt, c.loras) == ("mei walks at night",
                                                                                (("mei", 0.8),))
