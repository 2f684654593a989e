"""Graph replay against eager on a CUDA device (skipped without one). Tiny preset, fp32 and fp16."""

import pytest
import torch

from helpers.gpu import assert_rel_close, loop_inputs

pytestmark = pytest.mark.gpu
SIZES = [(256, 256), (320, 192)]


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("control", [False, True])
@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m"])
def test_replay_matches_eager(tiny_cuda, batch, control, sampler):
    models, runner, eager, rtol = tiny_cuda
    for w, h in SIZES:
        args = loop_inputs(models, batch, w, h, control, sampler)
        got = runner.sample(*args)
        want = eager.sample(*args)
        assert runner.stats[runner.shape_key(batch, h, w, control)].state == "graph"
        assert_rel_close(got, want, rtol)


def test_no_stale_buffers_between_batches(tiny_cuda):
    models, runner, eager, rtol = tiny_cuda
    a = loop_inputs(models, 4, 256, 256, True, seed=1)
    b = loop_inputs(models, 4, 256, 256, True, seed=2)
    first = runner.sample(*a)
    other = runner.sample(*b)  # overwrites every static buffer
    again = runner.sample(*a)
    assert_rel_close(again, first, rtol / 10 if rtol > 1e-3 else 1e-6)
    assert_rel_close(other, eager.sample(*b), rtol)
    assert not torch.allclose(first, other)


def test_pool_sharing_after_capture_in_another_shape(tiny_cuda):
    models, runner, eager, rtol = tiny_cuda
    a = loop_inputs(models, 2, 320, 192, False, seed=3)
    runner.sample(*a)
    runner.sample(*loop_inputs(models, 8, 256, 256, True, seed=4))  # may capture a new, larger graph in the pool
    runner.sample(*loop_inputs(models, 1, 192, 320, False, seed=5))  # a new capture after both
    assert_rel_close(runner.sample(*a), eager.sample(*a), rtol)


def test_padding_rows_do_not_change_real_rows(tiny_cuda):
    from storyboard_cli.engine.conditioning import Cond
    from storyboard_cli.engine.conditions.control import Control
    from storyboard_cli.engine.conditions.kind import Conditions

    models, runner, eager, rtol = tiny_cuda
    x, sched, noise, cond, conds, guidance = loop_inputs(models, 1, 256, 256, True, seed=6)
    alone = runner.sample(x, sched, noise, cond, conds, guidance)
    ctl = conds.get("control")
    # a bucket of 4 whose rows 1-3 are padding copies of row 0 (CFG rows: 4 negatives, then 4 positives)
    rows4 = lambda t: t.repeat_interleave(4, dim=0)  # noqa: E731
    padded = runner.sample(x.repeat(4, 1, 1, 1), sched, noise.repeat(1, 4, 1, 1, 1),
                           Cond(rows4(cond.embeds), rows4(cond.pooled), rows4(cond.time_ids)),
                           Conditions.of(Control(ctl.guide.repeat_interleave(4, dim=1),
                                                 ctl.scale.repeat_interleave(4, dim=1))),
                           guidance.repeat(4))
    # batch-size-dependent kernel choices (cuDNN convolutions use TF32 by default) move fp32 by ~1e-3
    tol = max(rtol, 3e-3)
    assert_rel_close(padded[:1], alone, tol)
    assert_rel_close(padded[3:], alone, tol)


def test_injected_capture_failure_falls_back_to_eager(tiny_cuda, monkeypatch):
    from storyboard_cli.engine.graph.runner import GraphRunner

    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=2, max_hw=(256, 256))

    def failing(key):
        raise RuntimeError("injected for the test")

    runner.capturer = failing
    args = loop_inputs(models, 2, 256, 256, False)
    assert_rel_close(runner.sample(*args), eager.sample(*args), 1e-6)
    st = runner.stats[runner.shape_key(2, 256, 256, False)]
    assert st.state == "eager" and "injected" in st.reason


def test_a_capture_that_fails_inside_cuda_leaves_the_pool_usable(tiny_cuda, monkeypatch):
    """A capture that fails inside the capture (here a host sync, which CUDA refuses while capturing) falls back to
    eager for its shape, and the next capture into the same pool still works (torch leaves the allocator recording
    into the pool after such a failure; the runner ends that)."""
    from storyboard_cli.engine.graph.runner import GraphRunner

    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=2, max_hw=(256, 256))
    def syncing(v):
        runner.step(v)
        if v.key.batch == 1 and torch.cuda.is_current_stream_capturing():
            v.x.sum().item()

    runner.stepper = syncing
    one = loop_inputs(models, 1, 256, 256, False)
    assert_rel_close(runner.sample(*one), eager.sample(*one), rtol)
    assert runner.stats[runner.shape_key(1, 256, 256, False)].state == "eager"
    # torch leaves the default CUDA generator in capture mode after such a failure; the runner ends that too
    torch.empty(4, device=models.device).uniform_()
    two = loop_inputs(models, 2, 256, 256, False)
    assert_rel_close(runner.sample(*two), eager.sample(*two), rtol)
    assert runner.stats[runner.shape_key(2, 256, 256, False)].state == "graph"


def test_in_place_weight_update_after_capture_is_seen_by_the_next_replay(tiny_cuda):
    """LoRA swaps weights with param.data.copy_ after the graphs exist: a replay must use the new values."""
    from storyboard_cli.engine.graph.runner import GraphRunner

    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=2, max_hw=(256, 256))
    args = loop_inputs(models, 2, 256, 256, True, sampler="euler", seed=7)
    before = runner.sample(*args)
    key = runner.shape_key(2, 256, 256, True)
    assert runner.stats[key].state == "graph" and runner.stats[key].checked
    weight = models.unet.conv_in.weight  # every step reads it; same storage before and after
    control_weight = models.controlnets[0].conv_in.weight  # the embedding's are read once per batch, not per step
    saved, saved_control = weight.detach().clone(), control_weight.detach().clone()
    pointers = weight.data_ptr(), control_weight.data_ptr()
    try:
        with torch.no_grad():
            weight.mul_(1.5)
            control_weight.mul_(0.5)
        assert (weight.data_ptr(), control_weight.data_ptr()) == pointers
        after = runner.sample(*args)  # a replay of the graph captured before the update: no new capture
        assert runner.stats[key].replays == 2 * args[1].steps
        assert_rel_close(after, eager.sample(*args), rtol)
        assert not torch.allclose(after, before)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
            control_weight.copy_(saved_control)
    assert_rel_close(runner.sample(*args), before, rtol / 10 if rtol > 1e-3 else 1e-6)


def test_growing_the_buffers_recaptures_and_still_matches_eager(tiny_cuda):
    from storyboard_cli.engine.graph.runner import GraphRunner

    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=1, max_hw=(192, 192))
    small = loop_inputs(models, 1, 192, 192, False, seed=8)
    assert_rel_close(runner.sample(*small), eager.sample(*small), rtol)
    large = loop_inputs(models, 4, 256, 256, True, seed=9)
    assert_rel_close(runner.sample(*large), eager.sample(*large), rtol)  # grown, not run eager
    assert runner.stats[runner.shape_key(4, 256, 256, True)].state == "graph"
    assert runner.stats[runner.shape_key(1, 192, 192, False)].state == "released"
    assert_rel_close(runner.sample(*small), eager.sample(*small), rtol)  # captured again into the new buffers
    st = runner.stats[runner.shape_key(1, 192, 192, False)]
    assert st.state == "graph" and st.checked


def test_render_graph_equals_eager(tmp_path):
    """A whole job through render(): graph engine vs eager engine give the same pixels (within fp32 rounding)."""
    from PIL import Image
    import numpy as np

    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for folder in ("control", "loras"):  # what the example job names, relative to it
        shutil.copytree(root / "jobs" / folder, tmp_path / folder)
    (tmp_path / "j.yaml").write_text((root / "jobs" / "episode1.yaml").read_text())
    job = load_job(tmp_path / "j.yaml")
    g = render(job, RenderOptions(out_dir=tmp_path / "g", device="cuda", dtype="fp32", engine="graph", compile="off"))
    e = render(job, RenderOptions(out_dir=tmp_path / "e", device="cuda", dtype="fp32", engine="eager"))
    assert g.status == e.status == "done" and g.rendered == e.rendered == 23
    assert all(x["state"] == "graph" for x in g.report.graphs), g.report.graphs
    for png in (tmp_path / "e").rglob("*.png"):
        a = np.asarray(Image.open(png), dtype=np.int16)
        b = np.asarray(Image.open(tmp_path / "g" / png.relative_to(tmp_path / "e")), dtype=np.int16)
        assert np.abs(a - b).max() <= 2, png.name



def test_a_plain_job_on_models_and_graphs_kept_from_a_controlnet_job_equals_its_own_render(tmp_path):
    """What a service's worker does when a job without a ControlNet follows one with (serve/lease_session.py's
    Hot.covers): the plain job renders on the models and engine warmed and used for the ControlNet job, its net
    loaded and unused; its pixels are those of its own render on models loaded for it alone, exactly."""
    import shutil
    from pathlib import Path

    import numpy as np
    from PIL import Image

    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render, warm

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "jobs" / "control", tmp_path / "control")
    head = "version: 1\nmodel: tiny\n{nets}defaults: {{steps: 4, size: 256x256, candidates: 2}}\nshots:\n"
    (tmp_path / "cn.yaml").write_text(head.format(nets="controlnet: tiny\n") + (
        "  - {id: c, prompt: a keeper, seed: 7, control: {image: control/hero_pose.png, scale: 0.8}}\n"
        "  - {id: n, prompt: a keeper at rest, seed: 8}\n"))
    (tmp_path / "plain.yaml").write_text(head.format(nets="") + "  - {id: p, prompt: a pier at dusk, seed: 9}\n")
    opts = dict(device="cuda", dtype="fp16", engine="graph", compile="off")
    cn = load_job(tmp_path / "cn.yaml")
    models, engine = warm(cn, RenderOptions(out_dir=tmp_path / "cn", **opts))
    assert render(cn, RenderOptions(out_dir=tmp_path / "cn", **opts), models=models, engine=engine).rendered == 4
    plain = load_job(tmp_path / "plain.yaml")
    kept = render(plain, RenderOptions(out_dir=tmp_path / "kept", **opts), models=models, engine=engine)
    alone = render(plain, RenderOptions(out_dir=tmp_path / "alone", **opts))
    assert kept.rendered == alone.rendered == 2 and models.controlnets
    for png in (tmp_path / "alone").rglob("*.png"):
        a = np.asarray(Image.open(png))
        assert np.array_equal(a, np.asarray(Image.open(tmp_path / "kept" / png.relative_to(tmp_path / "alone"))))

def _stop_builds(cache) -> None:
    """Kills the kernel builds a render started on `cache`: they run in sessions of their own and outlive it
    (engine/kernels/builds.py)."""
    import os
    import signal
    from pathlib import Path

    mark = f"BCG_CACHE={cache}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                os.kill(int(environ.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def test_a_first_render_on_an_empty_kernel_cache_renders_every_image_on_plain_graphs(tmp_path, monkeypatch):
    """`--compile auto` on a cache without the job's kernels, a new machine's first render: its sizes run plain graphs
    while their kernels build, in a runner that has the check ledger (engine/build.py), and every image renders, as
    with `--compile off`. A plain graph's check once raised KeyError naming its ledger record, failing every such
    batch."""
    import shutil
    from pathlib import Path

    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.render import RenderOptions, render

    cache = tmp_path / "cache"
    monkeypatch.setenv("BCG_CACHE", str(cache))
    root = Path(__file__).resolve().parent.parent
    for folder in ("control", "loras"):  # what the example job names, relative to it
        shutil.copytree(root / "jobs" / folder, tmp_path / folder)
    (tmp_path / "j.yaml").write_text((root / "jobs" / "episode1.yaml").read_text())
    job = load_job(tmp_path / "j.yaml")
    try:
        auto = render(job, RenderOptions(out_dir=tmp_path / "auto", device="cuda", engine="graph", compile="auto"))
    finally:
        _stop_builds(cache)
    assert auto.status == "done" and auto.rendered == 23, auto.report.graphs
    plain = [g for g in auto.report.graphs if g["variant"] == "plain"]
    assert plain and all(g["state"] == "graph" and g["reason"].startswith("checked") for g in plain), plain


def _largest_live_blocks(n: int = 8) -> list:
    """The n largest CUDA blocks allocated now: (MB, whether in a graph's pool, the innermost frame of ours that
    allocated it), from torch's memory snapshot (its history must be recording for the frames)."""
    try:
        snap = torch.cuda.memory._snapshot()
        blocks = [(b["size"], tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0), b.get("frames", []))
                  for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
        out = []
        for size, pooled, frames in sorted(blocks, key=lambda b: -b[0])[:n]:
            ours = [f for f in frames if "storyboard_cli" in f["filename"]]
            where = f"{ours[0]['filename'].split('storyboard_cli/')[-1]}:{ours[0]['line']} {ours[0]['name']}" if ours \
                else (f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?")
            out.append((size >> 20, "pool" if pooled else "", where))
        return out
    except Exception as e:  # noqa: BLE001 - a diagnosis for the failure message, never the test's failure
        return [f"no snapshot: {e!r}"]


def test_out_of_memory_splits_the_bucket(tmp_path, monkeypatch):
    """With the process capped between the memory a bucket of one image and a bucket of sixteen need to denoise (each
    measured as the capped render runs: graph engine, first-replay check, no compiled kernels), and 384 MB above what
    one image needs end to end (its decode included: a render decodes image by image, so a decode's peak does not
    grow with the bucket; on an H100 the tiny model's one-image render peaks at 618 MB, 432 of them its decode, and
    denoising 8 images at 726 MB, 16 at 1370), a bucket of 16 at 1024x1024 runs out of memory and is retried in
    smaller buckets; every image still lands, decoded on the GPU (a decode out of memory beside a loop is retried
    alone, then with the graphs freed; the CPU's decode, the last resort, would mean memory held that should not
    be)."""
    import gc

    from storyboard_cli.folder.outputs import read_fingerprint
    from storyboard_cli.job.file import load_job
    from storyboard_cli.models.loader import load_sdxl
    from storyboard_cli.run.batch import BatchRunner
    from storyboard_cli.run.render import RenderOptions, render

    models = load_sdxl("tiny", None, "cuda", torch.float16)

    def job(n, buckets):
        path = tmp_path / f"job{n}_{len(buckets)}.yaml"
        path.write_text(f"version: 1\nname: oom\nmodel: tiny\nbuckets: {buckets}\nshots:\n"
                        f"  - {{id: a, prompt: x, steps: 3, size: 1024x1024, candidates: {n}, seed: 5}}\n")
        return load_job(path)

    def settle():
        gc.collect()
        torch.cuda.empty_cache()

    denoised = []  # the peak reserved once each batch's loop is done, before its decode starts
    run_batch = BatchRunner.run_batch

    def measured(self, *args, **kwargs):
        done = run_batch(self, *args, **kwargs)
        torch.cuda.synchronize()
        denoised.append(torch.cuda.max_memory_reserved())
        return done

    monkeypatch.setattr(BatchRunner, "run_batch", measured)

    def peak(n):
        """Reserved, not allocated: the cap counts the allocator's segments, rounding and pools included. Returns
        the base, the denoising's peak above it and the whole render's (its decode's included)."""
        settle()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved()
        denoised.clear()
        result = render(job(n, [n]), RenderOptions(out_dir=tmp_path / f"peak{n}", compile="off"), models=models)
        assert result.status == "done" and result.report.graphs[0]["state"] == "graph", result.report.graphs
        (loop,) = denoised
        return base, loop - base, torch.cuda.max_memory_reserved() - base

    base, one, one_whole = peak(1)
    _, sixteen, sixteen_whole = peak(16)
    monkeypatch.setattr(BatchRunner, "run_batch", run_batch)
    mb = {"base": base >> 20, "one": one >> 20, "one_whole": one_whole >> 20, "sixteen": sixteen >> 20,
          "sixteen_whole": sixteen_whole >> 20}
    cap = max((one + sixteen) // 2, one_whole + 384 * 2**20)
    assert sixteen > cap + 128 * 2**20, mb  # room for a cap between them
    held = []  # at each decode that fell to the CPU: the largest blocks allocated then, and where
    decode_on_host = BatchRunner.decode_on_host

    def noted(self, d):
        held.append(_largest_live_blocks())
        return decode_on_host(self, d)

    monkeypatch.setattr(BatchRunner, "decode_on_host", noted)
    settle()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.memory._record_memory_history(max_entries=200_000)  # each block's stack, for `held`
    torch.cuda.set_per_process_memory_fraction((base + cap) / total)
    try:
        result = render(job(16, [1, 2, 4, 8, 16]), RenderOptions(out_dir=tmp_path / "capped", compile="off"),
                        models=models)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()  # after the render: what it left allocated, reserved, split and unused
    left = {k: stats[f"{k}_bytes.all.current"] >> 20 for k in ("allocated", "reserved", "inactive_split")}
    why = {**mb, "cap_mb": cap >> 20, "left_mb": left, "held_at_cpu_decodes": held, "notes": result.notes,
           "reasons": sorted({f["reason"] for f in result.failed}),
           "graphs": [(g["shape"], g["state"], g["reason"]) for g in result.report.graphs]}
    assert result.status == "done" and result.rendered == 16, why
    assert any("out of GPU memory at 16" in n for n in result.notes) or any(
        "out of memory" in g["reason"].lower() for g in result.report.graphs), why
    assert not any("on the CPU" in n for n in result.notes), why
    assert all(read_fingerprint(p) for p in (tmp_path / "capped").rglob("*.png"))


def test_the_decode_s_last_resort_on_the_cpu_gives_the_gpu_s_pixels_and_allocates_nothing_there():
    """`BatchRunner.decode_on_host`'s copy of the VAE (models/loader.py `host_decoder`), made from the GPU's decoder
    (its norms widened and fused, channels_last, its attention ours): nothing of it allocated on the GPU, and its
    pixels within 2 levels of the GPU's decode (float32 both; the GPU's convolutions in TF32)."""
    from storyboard_cli.models.loader import host_decoder, load_sdxl
    from storyboard_cli.run.batch import decode_pixels

    models = load_sdxl("tiny", None, "cuda", torch.float32)
    latents = torch.randn(2, 4, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = host_decoder(models)
    assert torch.cuda.memory_allocated() == before and next(host.vae.parameters()).device.type == "cpu"
    finite, pixels = decode_pixels(host, latents.cpu())
    want_finite, want = decode_pixels(models, latents)
    diff = (pixels.int() - want.cpu().int()).abs()
    assert finite.all() and want_finite.all() and diff.max() <= 2, (diff.max(), diff.float().mean())


def test_capture_warm_times_the_eager_step_only_with_eager(tmp_path):
    """`bcg capture --warm`'s run: every shape captured, checked and its graph timed; the uncompiled step timed beside
    it only with `eager` (a warm-up of a copied cache does not wait for it)."""
    from storyboard_cli.job.file import load_job
    from storyboard_cli.run.capture import capture

    path = tmp_path / "job.yaml"
    path.write_text("version: 1\nmodel: tiny\nbuckets: [2]\nshots:\n"
                    "  - {id: a, prompt: a hut, steps: 2, size: 256x256, candidates: 2}\n")
    for eager in (False, True):
        _, _, rows = capture(job=load_job(path), warm=True, steps=2, compile="off", eager=eager)
        (row,) = rows
        assert row.state == "graph" and row.reason.startswith("checked") and row.graph_ms > 0, row
        assert (row.eager_ms is not None and row.eager_ms > 0) if eager else row.eager_ms is None, row
