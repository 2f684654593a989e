"""The tiny preset's ControlNet guide steers the picture (models/tiny.py, GUIDE_GAIN), so that a test can tell
whether a row got its own guide, or any guide at all: a blank guide gives another picture than a pose, and swapping
two rows' guides in one batch swaps their pictures."""

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, write_job
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

STEERS = 2.0  # mean levels (0-255) between the pictures of two different guides, at least
JOB = """version: 1
model: tiny
controlnet: tiny
buckets: [2]
defaults: {{steps: 4, size: 128x128, prompt: the keeper on the stairs, seed: 9}}
shots:
  - {{id: first, control: {{image: {first}, scale: 1.0}}}}
  - {{id: second, control: {{image: {second}, scale: 1.0}}}}
"""


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guides")
    Image.new("RGB", (128, 128)).save(folder / "blank.png")
    Image.open(ROOT / "jobs" / "control" / "hero_pose.png").save(folder / "pose.png")
    return folder


def _render(folder, tiny_cpu, first, second):
    """One batch of two images, the same prompt and seed, each shot its own guide: their pixels by shot."""
    job = load_job(write_job(folder, JOB.format(first=first, second=second), f"{first}-{second}.yaml"))
    out = folder / f"out-{first}-{second}"
    assert render(job, RenderOptions(out_dir=out), models=tiny_cpu).rendered == 2
    return {shot: np.asarray(Image.open(next(out.rglob(f"{shot}*.png"))), dtype=np.float32)
            for shot in ("first", "second")}


def test_a_blank_guide_and_a_pose_give_other_pictures_and_a_swap_swaps_them(guides, tiny_cpu):
    one = _render(guides, tiny_cpu, "blank.png", "pose.png")
    swapped = _render(guides, tiny_cpu, "pose.png", "blank.png")
    apart = np.abs(one["first"] - one["second"]).mean()
    assert apart >= STEERS, f"a blank guide and a pose are {apart:.3f} levels apart"
    assert np.array_equal(one["first"], swapped["second"]) and np.array_equal(one["second"], swapped["first"])
