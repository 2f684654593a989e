"""A batch's decode and writes overlap the next batch's denoising (run/oom.py `deliver_ready`, `flush`): the same pixels and manifest
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


def _watch_batches(monkeypatch) -> dict:
    """Which batch's run_batch is running (`shot`: its first item's) and whether the engine's loop is (`looping`), as
    a dict that the patched BatchRunner.run_batch and EagerEngine.sample keep current."""
    from storyboard_cli.engine.eager import EagerEngine

    run_batch, sample = BatchRunner.run_batch, EagerEngine.sample
    now = {"shot": None, "looping": False}

    def running(self, batch, fallback=False, upcoming=None):
        now["shot"] = batch.items[0].shot
        return run_batch(self, batch, fallback, upcoming)

    def looping(self, *args, **kwargs):
        now["looping"] = True
        try:
            return sample(self, *args, **kwargs)
        finally:
            now["looping"] = False

    monkeypatch.setattr(BatchRunner, "run_batch", running)
    monkeypatch.setattr(EagerEngine, "sample", looping)
    return now


def test_each_batch_s_prompts_are_encoded_between_the_steps_of_the_batch_before(job, tmp_path, tiny_cpu, monkeypatch):
    """Every batch after the first finds its prompts encoded while the batch before denoised (between its steps, inside
    the engine's loop), each prompt once; the files are the bytes of a render without it, in the same order."""
    import storyboard_cli.engine.conditioning as conditioning

    encode, where, now = conditioning.encode_text, [], _watch_batches(monkeypatch)

    def recorded(models, prompts):
        where.append((prompts[0], now["shot"], now["looping"]))
        return encode(models, prompts)

    monkeypatch.setattr(conditioning, "encode_text", recorded)
    result, lines, files = _render(job, tmp_path / "ahead", tiny_cpu)
    monkeypatch.undo()
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, NotAhead)
    assert result.status == seq.status == "done" and lines == seq_lines and files == seq_files
    prompts = {"a": "a castle on a hill", "b": "a boat at sea", "c": "a lighthouse"}
    order = list(dict.fromkeys(p.split("/")[0] for p in lines))  # the shots in batch order
    assert sorted(p for p, _, _ in where) == sorted(prompts.values())  # each prompt once
    encoded = {p: (shot, looping) for p, shot, looping in where}
    assert encoded[prompts[order[0]]] == (order[0], False)  # the first batch's: before its own loop
    for before, shot in zip(order, order[1:]):
        assert encoded[prompts[shot]] == (before, True), (shot, encoded)
    assert result.report.stages_s["encode"] > 0 and "encode" in result.report.hidden_s
    # what the loops waited for, per bucket: together the encode stage's exposed part, at most the stage (on the CPU
    # the first batch's inputs at least: nothing ran beside them)
    waited = sum(b["waited_s"] for b in result.report.buckets)
    stage = result.report.stages_s["encode"]
    assert waited > 0 and abs(min(waited, stage) - (stage - result.report.hidden_s["encode"])) < 1e-3, (waited, stage)


def test_each_batch_s_noise_is_drawn_between_the_steps_of_the_batch_before(job_dir, tmp_path, tiny_cpu, monkeypatch):
    """An ancestral sampler's per-step noise (about 0.2 s of the host's time for 8 images at 1024x1024) is drawn for
    every batch after the first while the batch before denoises (between its steps), each image once; the files are
    the bytes of a render that draws each batch's noise in its own run_batch."""
    import storyboard_cli.engine.sampling as sampling
    import storyboard_cli.run.batch as batch_mod

    job = load_job(write_job(job_dir, JOB.replace("guidance: 5.0,", "guidance: 5.0, sampler: euler_a,")))
    draw, where, now = sampling.draw_image_noise, [], _watch_batches(monkeypatch)

    def recorded(seed, steps, shape, sched):
        where.append((seed, now["shot"], now["looping"]))
        return draw(seed, steps, shape, sched)

    monkeypatch.setattr(batch_mod, "draw_image_noise", recorded)
    result, lines, files = _render(job, tmp_path / "ahead", tiny_cpu)
    monkeypatch.undo()
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, NotAhead)
    assert result.status == seq.status == "done" and lines == seq_lines and files == seq_files
    seeds = {"a": {7, 8}, "b": {20}, "c": {30, 31}}
    order = list(dict.fromkeys(p.split("/")[0] for p in lines))  # the shots in batch order
    assert sorted(seed for seed, _, _ in where) == sorted(s for v in seeds.values() for s in v)  # each image once
    drawn = {seed: (shot, looping) for seed, shot, looping in where}
    assert all(drawn[seed] == (order[0], False) for seed in seeds[order[0]])  # the first batch's: in its own run
    for before, shot in zip(order, order[1:]):
        assert all(drawn[seed] == (before, True) for seed in seeds[shot]), (shot, drawn)


def test_each_batch_s_inputs_are_made_between_the_steps_of_the_batch_before(job, tmp_path, tiny_cpu, monkeypatch):
    """Every batch after the first finds its inputs (text conditioning, kinds' values, noise, guidance) made while the
    batch before denoised (between its steps), once, and its run_batch makes none; the files are the bytes of a
    render whose batches each make their own."""
    make, made, now = BatchRunner.make_inputs, [], _watch_batches(monkeypatch)

    def recorded(self, batch, text_loras=None):
        made.append((batch.items[0].shot, now["shot"], now["looping"]))
        return make(self, batch, text_loras)

    monkeypatch.setattr(BatchRunner, "make_inputs", recorded)
    result, lines, files = _render(job, tmp_path / "ahead", tiny_cpu)
    monkeypatch.undo()
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, NotAhead)
    assert result.status == seq.status == "done" and lines == seq_lines and files == seq_files
    order = list(dict.fromkeys(p.split("/")[0] for p in lines))  # the shots in batch order
    assert [shot for shot, _, _ in made] == order  # each batch's inputs made once
    assert made[0] == (order[0], order[0], False)  # the first batch's: in its own run_batch
    for (shot, during, looping), before in zip(made[1:], order):
        assert (during, looping) == (before, True), made


class NotAhead(Sequential):
    """One batch after the other, each encoding its own prompts."""

    def batch_runner(self) -> BatchRunner:
        runner = super().batch_runner()
        runner.ahead = False
        return runner


def test_a_render_s_decode_gives_the_batch_decode_s_bytes_and_flags_each_image_with_nan(tiny_cpu):
    """`decode_pixels` (a render's decode: each image made uint8 before the next is decoded) gives the bytes of
    `decode_on_device` (the whole batch's float pixels first), and marks the image whose latents hold a NaN alone."""
    import torch

    from storyboard_cli.run.batch import decode_on_device, decode_pixels

    latents = torch.randn(3, 4, 8, 10, generator=torch.Generator().manual_seed(3))
    latents[1, 2, 3, 4] = float("nan")
    finite, pixels = decode_pixels(tiny_cpu, latents)
    want_f, want = decode_on_device(tiny_cpu, latents)
    assert pixels.shape == (3, 64, 80, 3) and torch.equal(pixels[0::2], want[0::2])
    assert finite.tolist() == torch.isfinite(want_f).flatten(1).all(1).tolist() == [True, False, True]


@pytest.mark.parametrize("running", [False, True], ids=["done", "running"])
def test_a_decode_still_running_never_holds_the_next_batch_and_batches_land_in_order(job, tmp_path, tiny_cpu,
                                                                                    monkeypatch, running):
    """A batch is delivered once the next batch's loop is queued if its decode is done by then (`done`). A decode
    still running then (`running`: as on a GPU where it outlasts the next loop) is not waited for: the batch after is
    run first, and the oldest batch is delivered once two decodes would be in flight, the rest at the end. Either
    way, the files and the manifest's order are a sequential render's."""
    from storyboard_cli.run.oom import OutOfMemoryPolicy

    events, run_batch, deliver = [], BatchRunner.run_batch, OutOfMemoryPolicy.deliver

    def ran(self, batch, fallback=False, upcoming=None):
        out = run_batch(self, batch, fallback, upcoming)
        events.append(("ran", batch.items[0].shot))
        return out

    def delivered(self, decoded, label):
        events.append(("delivered", decoded[0].item.shot))
        return deliver(self, decoded, label)

    monkeypatch.setattr(BatchRunner, "run_batch", ran)
    monkeypatch.setattr(OutOfMemoryPolicy, "deliver", delivered)
    monkeypatch.setattr(BatchRunner, "decoded", lambda self, d: not running)
    result, lines, files = _render(job, tmp_path / "overlap", tiny_cpu)
    monkeypatch.undo()
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == seq.status == "done" and result.rendered == 5
    assert lines == seq_lines and files == seq_files
    a, b, c = [shot for what, shot in events if what == "ran"]
    if running:
        want = [("ran", a), ("ran", b), ("ran", c), ("delivered", a), ("delivered", b), ("delivered", c)]
    else:
        want = [("ran", a), ("ran", b), ("delivered", a), ("ran", c), ("delivered", b), ("delivered", c)]
    assert events == want


def test_a_decode_out_of_memory_is_decoded_again_and_other_decode_errors_fail_its_images(job, tmp_path, tiny_cpu,
                                                                                       monkeypatch):
    """A decode runs on its own thread on a GPU (what it raises arrives where the batch is delivered): out of memory
    once, the batch's latents are decoded again, to the same bytes; any other error fails that batch's images alone."""
    import torch

    import storyboard_cli.run.batch as batch

    real, calls = batch.decode_pixels, []

    def fails(error):
        def decode(models, latents):
            calls.append(latents.shape[0])
            if len(calls) == 1:
                raise error
            return real(models, latents)
        return decode

    monkeypatch.setattr(batch, "decode_pixels", fails(torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")))
    result, lines, files = _render(job, tmp_path / "oom", tiny_cpu)
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == "done" and result.rendered == 5 and calls[0] == calls[1]
    assert lines == seq_lines and files == seq_files
    calls.clear()
    monkeypatch.setattr(batch, "decode_pixels", fails(ValueError("simulated decode failure")))
    result, lines, _ = _render(job, tmp_path / "error", tiny_cpu)
    assert result.status == "failed" and len(result.failed) == calls[0] and result.rendered == 5 - calls[0]
    assert all("simulated decode failure" in f["reason"] for f in result.failed)

def test_a_decode_out_of_memory_twice_frees_the_graphs_and_is_decoded_once_more(job, tmp_path, tiny_cpu, monkeypatch):
    """A decode out of memory again on its own retry: the engine gives back its graphs and their pool (what it holds
    for speed) and the batch is decoded a third time, to the same bytes, with a note in the report; out of memory a
    third time fails that batch's images alone, and the other batches land."""
    import torch

    import storyboard_cli.run.batch as batch

    real, calls, released = batch.decode_pixels, [], []
    release = BatchRunner.release

    def fails(times):
        def decode(models, latents):
            calls.append((latents.shape[0], len(released)))
            if len(calls) <= times:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(models, latents)
        return decode

    def recorded(self):
        released.append(len(calls))
        release(self)

    monkeypatch.setattr(BatchRunner, "release", recorded)
    monkeypatch.setattr(batch, "decode_pixels", fails(2))
    result, lines, files = _render(job, tmp_path / "oom", tiny_cpu)
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == "done" and result.rendered == 5 and lines == seq_lines and files == seq_files
    assert calls[0][0] == calls[1][0] == calls[2][0] and released == [2]  # freed between the 2nd and 3rd decode
    assert [c[1] for c in calls[:3]] == [0, 0, 1]
    assert any("out of GPU memory decoding" in n and "graphs were freed" in n for n in result.notes), result.notes
    assert not any("on the CPU" in n for n in result.notes), result.notes
    calls.clear(), released.clear()
    monkeypatch.setattr(batch, "decode_pixels", fails(3))
    result, lines, files = _render(job, tmp_path / "oom3", tiny_cpu)
    assert result.status == "done" and result.rendered == 5 and lines == seq_lines and files == seq_files
    assert released == [2] and calls[3][0] == calls[0][0]  # a fourth decode, on the host copy of the VAE
    assert any("decoded on the CPU" in n for n in result.notes), result.notes
    calls.clear(), released.clear()
    monkeypatch.setattr(batch, "decode_pixels", fails(4))
    result, _, _ = _render(job, tmp_path / "oom4", tiny_cpu)
    assert result.status == "failed" and len(result.failed) == calls[0][0] and result.rendered == 5 - calls[0][0]
    assert released == [2] and all("out of memory" in f["reason"] for f in result.failed)


def test_the_cpu_s_copy_of_the_vae_decodes_as_the_vae_does_and_holds_nothing_of_the_device(tiny_cpu):
    """The last resort of a decode out of GPU memory (`BatchRunner.decode_on_host`): a float32 copy of the VAE in host
    memory, of the same weights, that decodes the same pixels (the tiny preset on the CPU: the same modules)."""
    import torch

    from storyboard_cli.models.loader import host_decoder
    from storyboard_cli.run.batch import decode_pixels

    host = host_decoder(tiny_cpu)
    assert host.vae is not tiny_cpu.vae and host.unet is tiny_cpu.unet and host.device == torch.device("cpu")
    ours, theirs = host.vae.state_dict(), tiny_cpu.vae.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].float()) for k in ours)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in ours.values())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(host.vae.parameters(), tiny_cpu.vae.parameters()))
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    finite, pixels = decode_pixels(host, latents)
    want_finite, want = decode_pixels(tiny_cpu, latents)
    assert finite.all() and torch.equal(finite, want_finite) and torch.equal(pixels, want)


def test_a_batch_out_of_memory_frees_what_it_held_before_the_batch_before_is_decoded(job, tmp_path, tiny_cpu,
                                                                                    monkeypatch):
    """A batch whose run_batch runs out of memory while the batch before is still decoding: that decode is finished
    (and retried, on a GPU, if it too ran out of memory) outside the handler of the error, whose frames hold the
    failed batch's memory; every image lands, the bytes and order of a sequential render under the same failure (the
    split batch's images are denoised one at a time there too: on the CPU a batch's size may move the UNet's
    rounding)."""
    import sys

    import torch

    real_run, real_finish, ran, handling = BatchRunner.run_batch, BatchRunner.finish, [], []

    def second_of_two_out_of_memory(self, batch, fallback=False, upcoming=None):
        ran.append(batch.size)
        if batch.size == 2 and ran.count(2) == 2:  # the first batch of two is delivered after this one's loop
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_run(self, batch, fallback, upcoming)

    def finish(self, d):
        handling.append((len(ran), sys.exc_info()[0]))  # batches run so far, the exception being handled
        return real_finish(self, d)

    monkeypatch.setattr(BatchRunner, "run_batch", second_of_two_out_of_memory)
    monkeypatch.setattr(BatchRunner, "finish", finish)
    result, lines, files = _render(job, tmp_path / "oom", tiny_cpu)
    failed_at = [i for i, size in enumerate(ran, 1) if size == 2][1]
    assert handling[0][0] == failed_at, (ran, handling)  # the first batch is delivered once the second one failed
    assert all(exc is None for _, exc in handling), handling
    ran.clear()
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", tiny_cpu, Sequential)
    assert result.status == seq.status == "done" and result.rendered == 5
    assert lines == seq_lines and files == seq_files
    assert any("out of GPU memory at 2" in n for n in result.notes), result.notes


@pytest.mark.gpu
def test_on_a_gpu_the_decode_beside_the_next_batch_writes_the_same_bytes(job, tmp_path):
    """The decode and the inputs on streams of their own, the graphs replaying on the UNet's: the same PNG bytes as
    one batch after the other."""
    result, lines, files = _render(job, tmp_path / "overlap", None, device="cuda", compile="off")
    seq, seq_lines, seq_files = _render(job, tmp_path / "sequential", None, Sequential, device="cuda", compile="off")
    assert result.status == seq.status == "done" and result.engine == "graph"
    assert lines == seq_lines and files == seq_files
    assert result.report.stages_s["denoise"] > 0 and set(result.report.hidden_s) == {"encode", "decode", "save"}


@pytest.mark.gpu
def test_on_a_gpu_a_loops_pace_counts_the_time_the_gpu_waited_for_the_host():
    """`Pace`'s gaps (GraphStats.idle_ms): a host stall longer than the replays queued before it shows as the GPU's
    idle time, and a loop whose launches stay ahead of the GPU shows almost none."""
    import time

    import torch

    from storyboard_cli.engine.graph.keys import GraphStats
    from storyboard_cli.engine.graph.pace import Pace

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            a @ a  # the library's setup outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            b = a @ a
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end)

    def loop(stall_s: float) -> float:
        pace, stats = Pace(True), GraphStats(None)
        for i in range(6):
            pace.replay(graph)
            if i == 2:
                time.sleep(stall_s)  # at most the three replays launched so far queued: then the GPU waits
        torch.cuda.synchronize()
        stats.gaps += pace.gaps
        assert len(stats.gaps) == 5
        return stats.idle_ms

    stall = max(0.1, 5 * replay_ms / 1000)
    assert loop(0.0) < 0.5
    # an H100 ran the three queued replays in 4.4 ms of a 100 ms stall and idled 96.0 ms (2026-12-07)
    assert 1000 * stall - 3 * replay_ms < loop(stall) < 1000 * stall + 5
    del b
