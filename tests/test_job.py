"""Pure tests for job parsing and validation (no torch, milliseconds)."""

import sys
from pathlib import Path

import pytest

from conftest import DATA, ROOT, write_job
from storyboard_cli.errors import JobError
from storyboard_cli.job import NAMED_SIZES, load_job, parse_size

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
    assert sum(s.control is not None for s in job.shots) >= 2
    assert all(s.control.image.is_file() for s in job.shots if s.control)


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
    assert job.buckets == (1, 2, 4, 8)
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
    assert shot.control.image == (job_dir / "control" / "hero_pose.png").resolve()
    assert shot.control.scale == 0.5


@pytest.mark.parametrize("text,size", [("square", (1024, 1024)), ("640x480", (640, 480)), ("WIDE", (1344, 768)),
                                       ("512 x 512", (512, 512))])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_named_sizes_are_sdxl_buckets():
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in NAMED_SIZES.values())


def test_job_module_does_not_import_torch():
    import subprocess

    code = "import sys, storyboard_cli.job, storyboard_cli.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
