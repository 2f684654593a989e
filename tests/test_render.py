"""CPU end-to-end tests on the tiny preset: render, rerun, batch invariance, failures, the lock."""

import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import write_job
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.folder.outputs import read_fingerprint
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

JOB = """version: 1
name: t
model: tiny
controlnet: tiny
defaults: {steps: 4, guidance: 5.0, size: 80x64}  # small: what these tests check holds at any size
shots:
  - {id: a, prompt: a castle on a hill, seed: 7, candidates: 4}
  - {id: b, prompt: a boat at sea, seed: 20, size: 64x80, sampler: euler_a}
  - {id: c, prompt: a keeper with a lantern, seed: 30, control: {image: control/hero_pose.png, scale: 0.8}}
"""


def _pixels(path):
    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.fixture
def job(job_dir):
    return load_job(write_job(job_dir, JOB))


def test_render_writes_pngs_manifest_and_report(job, tmp_path, tiny_cpu):
    out = tmp_path / "out"
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 6 and not result.failed
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert pngs == ["a/a_c0_s7.png", "a/a_c1_s8.png", "a/a_c2_s9.png", "a/a_c3_s10.png", "b/b_c0_s20.png",
                    "c/c_c0_s30.png"]
    with Image.open(out / "b/b_c0_s20.png") as im:
        assert im.size == (64, 80)
        params = im.info["parameters"]
        meta = json.loads(im.info["bcg"])
    assert params.splitlines()[0] == "a boat at sea"
    assert "Steps: 4, Sampler: Euler a, CFG scale: 5, Seed: 20, Size: 64x80, Model: tiny" in params
    assert meta["seed"] == 20 and meta["sampler"] == "euler_a"
    lines = [json.loads(l) for l in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(l["path"] for l in lines) == pngs
    report = json.loads((out / "report.json").read_text())
    assert report["images_rendered"] == 6 and set(report["stages_s"]) >= {"load", "encode", "denoise", "decode", "save"}
    assert (out / "report.md").read_text().startswith("# Render report")
    # images differ from one another (the seeds and prompts matter)
    assert np.abs(_pixels(out / "a/a_c0_s7.png") - _pixels(out / "a/a_c1_s8.png")).max() > 0


def test_rerun_skips_done_images_and_force_renders_again(job, tmp_path, tiny_cpu):
    out = tmp_path / "out"
    render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    first = (out / "a/a_c0_s7.png").stat().st_mtime_ns
    again = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert (again.rendered, again.skipped) == (0, 6)
    assert (out / "a/a_c0_s7.png").stat().st_mtime_ns == first
    forced = render(job, RenderOptions(out_dir=out, force=True), models=tiny_cpu)
    assert forced.rendered == 6
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 6


def test_a_changed_shot_is_rendered_again(job_dir, tmp_path, tiny_cpu):
    out = tmp_path / "out"
    render(load_job(write_job(job_dir, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    edited = load_job(write_job(job_dir, JOB.replace("a boat at sea", "a boat in a storm")))
    result = render(edited, RenderOptions(out_dir=out), models=tiny_cpu)
    assert (result.rendered, result.skipped) == (1, 5)
    assert json.loads(Image.open(out / "b/b_c0_s20.png").info["bcg"])["prompt"] == "a boat in a storm"
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 6


def test_batch_invariance_bucket_of_four_equals_alone(job_dir, tmp_path, tiny_cpu):
    """Image k=2 of a 4-image bucket equals the same seed rendered alone (bucket of 1)."""
    four = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nbuckets: [4]\nshots:\n"
                                       "  - {id: a, prompt: a castle, seed: 7, candidates: 4, steps: 4, size: 80x64}\n"))
    alone = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nbuckets: [1]\nshots:\n"
                                        "  - {id: a, prompt: a castle, seed: 9, steps: 4, size: 80x64}\n", "alone.yaml"))
    render(four, RenderOptions(out_dir=tmp_path / "four"), models=tiny_cpu)
    render(alone, RenderOptions(out_dir=tmp_path / "alone"), models=tiny_cpu)
    diff = np.abs(_pixels(tmp_path / "four/a/a_c2_s9.png") - _pixels(tmp_path / "alone/a/a_c0_s9.png"))
    assert diff.max() <= 1


def test_padding_rows_are_dropped(job_dir, tmp_path, tiny_cpu):
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nbuckets: [4]\nshots:\n"
                                      "  - {id: a, prompt: a castle, seed: 7, candidates: 3, steps: 3, size: 64x64}\n"))
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu)
    assert result.rendered == 3 and len(list((tmp_path / "o").rglob("*.png"))) == 3
    assert result.report.buckets[0]["rows"] == 8  # one bucket of 4, CFG-doubled


def test_nan_image_is_recorded_as_failed_never_saved_then_retried(job, tmp_path, tiny_cpu, monkeypatch):
    out = tmp_path / "out"
    real = EagerEngine.sample

    def poisoned(self, x, *args):
        latents = real(self, x, *args)
        if latents.shape[0] == 4:  # shot a's bucket: poison its second image
            latents[1, 0, 0, 0] = float("nan")
        return latents

    monkeypatch.setattr(EagerEngine, "sample", poisoned)
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.status == "failed"
    assert [f["path"] for f in result.failed] == ["a/a_c1_s8.png"]
    assert "NaN" in result.failed[0]["reason"]
    assert not (out / "a/a_c1_s8.png").exists() and result.rendered == 5
    assert json.loads((out / "report.json").read_text())["failures"][0]["path"] == "a/a_c1_s8.png"

    monkeypatch.setattr(EagerEngine, "sample", real)
    retry = render(job, RenderOptions(out_dir=out, retry_failed=True), models=tiny_cpu)
    assert (retry.status, retry.rendered, retry.skipped) == ("done", 1, 5)
    assert read_fingerprint(out / "a/a_c1_s8.png") is not None


def test_unreadable_control_image_fails_that_shot_only(job_dir, tmp_path, tiny_cpu):
    job = load_job(write_job(job_dir, JOB))
    (job_dir / "control" / "hero_pose.png").write_bytes(b"broken after planning")
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu)
    assert result.status == "failed" and result.rendered == 5
    assert [f["shot"] for f in result.failed] == ["c"]


def test_out_of_memory_splits_the_batch(job, tmp_path, tiny_cpu, monkeypatch):
    """The OOM path on the CPU: a bucket of 4 that 'does not fit' is retried as 2 + 2."""
    real = EagerEngine.sample

    def small_memory(self, x, *args):
        if x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, x, *args)

    monkeypatch.setattr(EagerEngine, "sample", small_memory)
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 6
    assert any("out of GPU memory at 4 x" in n for n in result.notes)


def test_out_of_memory_halves_a_batch_of_every_bucket_size(job_dir, tmp_path, tiny_cpu, monkeypatch):
    """With the default buckets (every size up to 8), a batch of 8 that does not fit is retried as 4 + 4, not 7 + 1
    (then 6 + 1, ...: one more out-of-memory for each size on the way down), and a later batch of 8 is split so before
    it runs; the pictures are the ones the batch renders when it fits."""
    text = JOB.replace("candidates: 4}", "candidates: 8}").replace("shots:", "shots:\n  - {id: z, prompt: a gull,"
                                                                    " seed: 90, candidates: 8}")
    job = load_job(write_job(job_dir, text))
    assert job.buckets == tuple(range(1, 9))
    real, sizes = EagerEngine.sample, []

    def small_memory(self, x, *args):
        sizes.append(x.shape[0])
        if x.shape[0] > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, x, *args)

    fits = render(job, RenderOptions(out_dir=tmp_path / "fits"), models=tiny_cpu)
    monkeypatch.setattr(EagerEngine, "sample", small_memory)
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu)
    assert result.status == "done" and result.rendered == fits.rendered == 18
    ran_out = [n for n in result.notes if "out of GPU memory at" in n]
    assert len(ran_out) == 1 and "at 8 x" in ran_out[0] and "retried in buckets of at most 4" in ran_out[0], ran_out
    assert sizes.count(8) == 1 and sizes.count(4) == 4, sizes  # the second batch of 8: split before it ran
    for png in sorted((tmp_path / "fits").glob("*/*.png")):
        assert np.abs(_pixels(png) - _pixels(tmp_path / "o" / png.parent.name / png.name)).max() <= 1, png


def test_out_of_memory_at_capture_frees_graphs_and_splits(job, tmp_path, tiny_cpu, monkeypatch):
    """Capture runs out of memory at every size: the batch is split down to one image, then eager."""
    from storyboard_cli.engine.graph.runner import GraphRunner

    runner = GraphRunner(tiny_cpu, max_batch=4, max_hw=(128, 128))

    def no_memory(key):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    runner.capturer = no_memory
    released = []
    # released outside the handler: an exception being handled keeps the failed capture's frames (and on a
    # GPU its graph's memory) alive, and the eager retry needs that memory
    monkeypatch.setattr(runner, "release", lambda: released.append(sys.exc_info()[0]))
    result = render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu, engine=runner)
    assert result.status == "done" and result.rendered == 6
    assert released and released == [None] * len(released)
    assert any("retried eager" in n for n in result.notes)
    assert any("at 4 x" in n for n in result.notes)
    # after the first failure, later batches of that size or larger are split before they run
    assert sum("at 4 x" in n for n in result.notes) == 1


def test_a_failed_model_load_keeps_the_last_report(job_dir, tmp_path, tiny_cpu):
    from storyboard_cli.errors import JobError

    out = tmp_path / "out"
    render(load_job(write_job(job_dir, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    before = (out / "report.json").read_text()
    broken = load_job(write_job(job_dir, JOB.replace("model: tiny", "model: ./nowhere").replace(
        "a castle on a hill", "a changed prompt")))
    with pytest.raises(JobError, match=r"job.yaml:3 field 'model': no such file or folder: ./nowhere"):
        render(broken, RenderOptions(out_dir=out))
    assert (out / "report.json").read_text() == before
    assert len(list(out.rglob("*.png"))) == 6  # nothing rendered is lost


def test_a_bug_of_ours_aborts_the_render_instead_of_failing_every_image(job, tmp_path, tiny_cpu, monkeypatch):
    def buggy(self, x, *args):
        raise TypeError("sample() got an unexpected keyword argument (simulated)")

    monkeypatch.setattr(EagerEngine, "sample", buggy)
    with pytest.raises(TypeError, match="simulated"):
        render(job, RenderOptions(out_dir=tmp_path / "o"), models=tiny_cpu)
    assert json.loads((tmp_path / "o" / "report.json").read_text())["status"] == "error"
    assert not list((tmp_path / "o").rglob("*.png"))
