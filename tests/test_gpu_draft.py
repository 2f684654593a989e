"""Draft mode's step kinds as CUDA graphs against the eager engine (skipped without CUDA). Tiny preset, fp32 and
fp16: the conditional rows alone, DeepCache full and shallow, their mix in one loop, with ControlNet (cut-off
only), after another shape's replays (the shared feature buffer), and under a LoRA swap in place."""

import pytest
import torch

from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.steps import step_plan

from helpers.gpu import assert_rel_close, loop_inputs

pytestmark = pytest.mark.gpu
STEPS = 9
PLANS = {"cutoff": (4, 0, 0), "cond-only": (0, 0, 0), "deepcache": (STEPS, 3, 0), "both": (5, 3, 1),
         "cond-deepcache": (0, 2, 0)}


@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("plan", PLANS)
def test_draft_replay_matches_eager(tiny_cuda, batch, plan):
    models, runner, eager, rtol = tiny_cuda
    kinds = step_plan(STEPS, *PLANS[plan])
    for w, h in [(256, 256), (320, 192)]:
        args = loop_inputs(models, batch, w, h, False, "dpmpp_2m", STEPS)
        got = runner.sample(*args, kinds)
        assert_rel_close(got, eager.sample(*args, kinds), rtol)
        keys = {runner.shape_key(batch, h, w, False, k) for k in kinds}
        assert all(runner.stats[k].state == "graph" and runner.stats[k].checked for k in keys)


@pytest.mark.parametrize("batch", [1, 4])
def test_cutoff_with_controlnet(tiny_cuda, batch):
    models, runner, eager, rtol = tiny_cuda
    kinds = step_plan(STEPS, 4)
    args = loop_inputs(models, batch, 256, 256, True, "euler_a", STEPS)
    assert_rel_close(runner.sample(*args, kinds), eager.sample(*args, kinds), rtol)


@pytest.mark.parametrize("batch", [1, 4])
def test_control_end_then_deepcache_with_controlnet(tiny_cuda, batch):
    """A ControlNet shot as --draft renders it: guided with the ControlNet for 4 steps, then the conditional rows
    alone without it, DeepCache on them (the graphs of a shot without a ControlNet)."""
    models, runner, eager, rtol = tiny_cuda
    kinds = step_plan(STEPS, 4, 3, 0, control=4)
    args = loop_inputs(models, batch, 256, 256, True, "euler", STEPS)
    assert_rel_close(runner.sample(*args, kinds), eager.sample(*args, kinds), rtol)
    keys = {runner.shape_key(batch, 256, 256, True, k) for k in kinds}
    assert {k.control for k in keys} == {True, False}
    assert all(runner.stats[k].state == "graph" and runner.stats[k].checked for k in keys)


def test_deepcache_after_another_shape(tiny_cuda):
    """Two shapes share the feature buffer: a batch of one after a batch of the other still matches."""
    models, runner, eager, rtol = tiny_cuda
    kinds = step_plan(STEPS, STEPS, 3, 0)
    a = loop_inputs(models, 2, 256, 256, False, "euler", STEPS, seed=3)
    b = loop_inputs(models, 4, 320, 192, False, "euler", STEPS, seed=4)
    first = runner.sample(*a, kinds)
    other = runner.sample(*b, kinds)
    assert_rel_close(runner.sample(*a, kinds), first, rtol / 10 if rtol > 1e-3 else 1e-6)
    assert_rel_close(other, eager.sample(*b, kinds), rtol)


def test_lora_swapped_in_place_reaches_the_draft_graphs(tiny_cuda, tmp_path):
    """Graphs of every draft kind captured before a swap replay with the new weights, and none is captured again."""
    from storyboard_cli.models.lora import LoraApplier, read_lora
    from storyboard_cli.bench.synthetic_lora import random_factors, save_kohya

    models, runner, eager, rtol = tiny_cuda
    factors = {k: (d.half(), u.half()) for k, (d, u) in random_factors(models, seed=3, rank=4).items()}
    path = save_kohya(tmp_path / "a.safetensors", factors, models.unet.config.layers_per_block, alpha=4.0)
    lora = read_lora("a", path, models.unet.config)
    applier = LoraApplier(models)
    applier.register(lora)
    kinds = step_plan(STEPS, 5, 3, 0)
    args = loop_inputs(models, 2, 256, 256, False, "euler", STEPS, seed=5)
    before = runner.sample(*args, kinds)
    captured = len(runner.graphs)
    applier.apply({"a": (lora, 0.9)})
    try:
        after = runner.sample(*args, kinds)
        assert len(runner.graphs) == captured
        assert_rel_close(after, eager.sample(*args, kinds), rtol)
        assert not torch.allclose(after, before)
    finally:
        applier.apply({})
    assert_rel_close(runner.sample(*args, kinds), before, rtol / 10 if rtol > 1e-3 else 1e-6)


def test_draft_kinds_are_captured_without_a_warm_up(tiny_cuda):
    """A fresh runner: the first graph at each rows and size warms up; the draft kinds whose kernels an earlier graph
    ran (the same rows and size) are captured without one, and still match the eager engine."""
    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=8, max_hw=(320, 320))
    # 4 rows: a 4-image batch's conditional rows
    runner.sample(*loop_inputs(models, 2, 256, 256, False, "euler", STEPS))
    args = loop_inputs(models, 4, 256, 256, False, "euler", STEPS)
    runner.sample(*args)
    kinds = step_plan(STEPS, 5, 3, 0)
    assert_rel_close(runner.sample(*args, kinds), eager.sample(*args, kinds), rtol)
    warm = {(k.batch, k.step.label): s.warmup for k, s in runner.stats.items()}
    assert warm == {(2, ""): True, (4, ""): True, (4, "deepcache full b0"): False, (4, "deepcache shallow b0"): False,
                    (4, "cond deepcache full b0"): False, (4, "cond deepcache shallow b0"): False}
    assert all(s.state == "graph" and s.checked for s in runner.stats.values())


def test_a_capture_without_a_warm_up_that_fails_is_tried_again_after_one(tiny_cuda):
    models, _, eager, rtol = tiny_cuda
    runner = GraphRunner(models, max_batch=8, max_hw=(320, 320))
    calls = []

    def lazy_init_in_capture(v):  # what a capture records fails where no warm-up ran before it
        if torch.cuda.is_current_stream_capturing():
            warmup = runner.stats[v.key].warmup
            calls.append(warmup)
            if not warmup:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        runner.step(v)

    runner.stepper = lazy_init_in_capture
    args = loop_inputs(models, 2, 256, 256, False, "euler", STEPS)
    runner.sample(*args)
    kinds = step_plan(STEPS, STEPS, 3, 0)
    assert_rel_close(runner.sample(*args, kinds), eager.sample(*args, kinds), rtol)
    assert calls == [True, False, True, False, True]  # today's step; DeepCache's full, then shallow step: each twice
    assert all(s.state == "graph" and s.checked and s.warmup for s in runner.stats.values())


def test_capture_warm_checks_and_times_a_draft_jobs_loops(tiny_cuda, tmp_path):
    """`bcg capture JOB --warm --draft`'s timing: every shape's today's row, then a row per draft loop whose kinds
    were captured, checked against eager and timed."""
    from conftest import write_job
    from storyboard_cli.job.file import as_draft, load_job
    from storyboard_cli.run.capture import job_plans, job_shapes, time_shapes

    models, _, _, _ = tiny_cuda
    job = as_draft(load_job(write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n"
                                                "  - {id: a, prompt: x, steps: 9, size: 256x256, candidates: 2}\n"
                                                "  - {id: b, prompt: y, steps: 9, size: 320x192, candidates: 1}\n")))
    shapes, plans = job_shapes(job, None, job.buckets), job_plans(job)
    assert set(plans) == set(shapes) and all(len(p) == 1 for p in plans.values())
    runner = GraphRunner(models, max_batch=8, max_hw=(320, 320))
    rows = time_shapes(models, runner, shapes, steps=4, repeats=1, eager=False, plans=plans)
    loops = [r for r in rows if " guided" in r.shape]
    assert len(rows) == 2 * len(shapes) and len(loops) == len(shapes)
    assert all(r.state == "graph" and r.reason == "every step kind checked" and r.graph_ms > 0 for r in loops), loops
    assert all(s.checked for s in runner.stats.values())


def test_todays_step_on_deepcaches_full_graph_is_todays_result_bit_for_bit(tiny_cuda):
    """Where a shape has DeepCache's full step, today's step replays that graph (engine/graphs.py `writers`): the same
    kernels plus the feature's copy, so the same latents to the bit as a runner that captured today's step alone."""
    from storyboard_cli.engine import Shape

    models, _, _, _ = tiny_cuda
    args = loop_inputs(models, 4, 256, 256, False, "euler", STEPS)
    alone = GraphRunner(models, max_batch=4, max_hw=(256, 256))
    want = alone.sample(*args)
    shared = GraphRunner(models, max_batch=4, max_hw=(256, 256))
    shape = Shape(4, 256, 256, False)
    shared.prepare([shape], {shape: set(step_plan(STEPS, 5, 3, 0))})
    assert shared.shape_key(4, 256, 256, False).step.cache == "write"
    assert torch.equal(shared.sample(*args), want)
    (replayed,) = [s for s in shared.stats.values() if s.replays]
    assert replayed.key.step.cache == "write" and replayed.checked and replayed.replays == STEPS
    assert len(shared.stats) == 4 and all(s.state == "graph" for s in shared.stats.values())
