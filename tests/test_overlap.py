"""A batch's decode and writes overlap the next batch's denoising (run/oom.py `flush`): the same pixels and manifest
order as one batch after the other, nothing already denoised lost when a later batch fails, and the report's hidden
seconds. CPU, tiny preset (the GPU's streams: tests/test_gpu.py)."""

import json

import pytest

from conftest import write_job
from storyboard_cli.job.file import load_job
from storyboard_cli.run.batch import BatchRunner
from storyboard_cli.run.render import RenderOptions, RenderSession

JOB = """version: 1
name: t
model: tiny
defaults: {steps: 3, guidance: 5.0, size: 64x64}
buckets: [1, 2]
shots:
  - {id: a, prompt: a castle on a hill, seed: 7, candidates: 2}
  - {id: b, prompt: a boat at sea, seed: 20, size: 64x80}
  - {id: c, prompt: a lighthouse, seed: 30, candidates: 2}
"""


class Sequential(RenderSession):
    """Each batch decoded and delivered before the next one runs."""

    def batch_runner(self) -> BatchRunner:
        runner = super().batch_runner()
        runner.overlap = False
        return runner


def _render(job, out, models, session=RenderSession, **opts):
    result = session(job, RenderOptions(out_dir=out, **opts), models=models).execute()
    lines = [json.loads(line)["path"] for line in (out / "manifest.jsonl").read_text().splitlines()]
    return result, lines, {p: (out / p).read_bytes() for p in lines}


@pytest.fixture
def job(job_dir):
    return load_job(write_job(job_dir, JOB))


def test_overlapped_batches_write_what_sequential_ones_write_in_the_same_order(job, tmp_path, tiny_cpu):
    result, lines, files = _render(job, tmp_path / "overlap", tiny_cpu)
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == seq.status == "done" and result.rendered == 5
    assert lines == seq_lines and files == seq_files  # the same bytes, in the same manifest order
    assert set(result.report.hidden_s) == {"encode", "decode", "save"}
    md = (tmp_path / "overlap" / "report.md").read_text()
    assert "| stage | s | hidden s |" in md


def test_a_failed_batch_loses_none_of_the_batch_denoised_before_it(job, tmp_path, tiny_cpu, monkeypatch):
    real, calls = BatchRunner.run_batch, []

    def second_fails(self, batch, fallback=False, upcoming=None):
        calls.append(batch.items[0].shot)
        if len(calls) == 2:  # the first batch's decode is still pending here
            raise RuntimeError("simulated failure of one batch")
        return real(self, batch, fallback, upcoming)

    monkeypatch.setattr(BatchRunner, "run_batch", second_fails)
    result, lines, _ = _render(job, tmp_path / "o", tiny_cpu)
    failed = {f["path"] for f in result.failed}
    assert result.status == "failed" and len(calls) == 3
    assert failed and all("simulated" in f["reason"] for f in result.failed)
    assert result.rendered + len(failed) == 5 and set(lines).isdisjoint(failed)
    first = [p for p in lines if p.startswith(f"{calls[0]}/")]
    assert first and lines[: len(first)] == first  # the first batch's images landed, before the third's


class Ahead(RenderSession):
    """The next batch's prompts encoded beside each batch's loop, as on a GPU (run/batch.py `encode_ahead`)."""

    def batch_runner(self) -> BatchRunner:
        runner = super().batch_runner()
        runner.ahead = True
        return runner


def test_prompts_encoded_beside_the_batch_before_write_the_same_bytes_and_each_prompt_once(job, tmp_path, tiny_cpu,
                                                                                          monkeypatch):
    """Every batch after the first finds its prompts encoded on the inputs' thread while the batch before ran; the
    files are the bytes of one batch after the other, and no prompt is encoded twice."""
    import threading

    import storyboard_cli.engine.conditioning as conditioning

    real, where = conditioning.encode_text, []

    def encode(models, prompts):
        where.append((prompts[0], threading.current_thread().name))
        return real(models, prompts)

    monkeypatch.setattr(conditioning, "encode_text", encode)
    result, lines, files = _render(job, tmp_path / "ahead", tiny_cpu, Ahead)
    ahead = dict(where)
    monkeypatch.setattr(conditioning, "encode_text", real)
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == seq.status == "done" and lines == seq_lines and files == seq_files
    assert len(where) == len(ahead) == 3, where  # each prompt once
    first = lines[0].split("/")[0]
    prompts = {"a": "a castle on a hill", "b": "a boat at sea", "c": "a lighthouse"}
    assert ahead.pop(prompts[first]) == "MainThread"
    assert set(ahead.values()) == {"bcg-inputs_0"}, ahead
    assert result.report.stages_s["encode"] > 0 and "encode" in result.report.hidden_s


def test_a_decode_out_of_memory_is_decoded_again_and_other_decode_errors_fail_its_images(job, tmp_path, tiny_cpu,
                                                                                       monkeypatch):
    """A decode runs on its own thread on a GPU (what it raises arrives where the batch is delivered): out of memory
    once, the batch's latents are decoded again, to the same bytes; any other error fails that batch's images alone."""
    import torch

    import storyboard_cli.run.batch as batch

    real, calls = batch.decode_on_device, []

    def fails(error):
        def decode(models, latents):
            calls.append(latents.shape[0])
            if len(calls) == 1:
                raise error
            return real(models, latents)
        return decode

    monkeypatch.setattr(batch, "decode_on_device", fails(torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")))
    result, lines, files = _render(job, tmp_path / "oom", tiny_cpu)
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == "done" and result.rendered == 5 and calls[0] == calls[1]
    assert lines == seq_lines and files == seq_files
    calls.clear()
    monkeypatch.setattr(batch, "decode_on_device", fails(ValueError("simulated decode failure")))
    result, lines, _ = _render(job, tmp_path / "error", tiny_cpu)
    assert result.status == "failed" and len(result.failed) == calls[0] and result.rendered == 5 - calls[0]
    assert all("simulated decode failure" in f["reason"] for f in result.failed)

@pytest.mark.gpu
def test_on_a_gpu_the_decode_beside_the_next_batch_writes_the_same_bytes(job, tmp_path):
    """The decode and the inputs on streams of their own, the graphs replaying on the UNet's: the same PNG bytes as
    one batch after the other."""
    result, lines, files = _render(job, tmp_path / "overlap", None, device="cuda", compile="off")
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", None, Sequential, device="cuda", compile="off")
    assert result.status == seq.status == "done" and result.engine == "graph"
    assert lines == seq_lines and files == seq_files
    assert result.report.stages_s["denoise"] > 0 and set(result.report.hidden_s) == {"encode", "decode", "save"}
