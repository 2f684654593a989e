"""CPU tests of the engine bookkeeping: shape keys, engine choice, fallback to eager with a reason."""

import pytest
import torch

from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graphs import GraphRunner, ShapeKey
from storyboard_cli.errors import BadInput
from storyboard_cli.render import make_engine, synthetic_inputs
from storyboard_cli.sampling import ancestral_split, dpmpp_2m_coeffs, euler_coeffs, schedule


def test_shape_key_identity_and_order():
    a = ShapeKey(4, 1024, 1024, False, "float16")
    assert a == ShapeKey(4, 1024, 1024, False, "float16")
    assert a != ShapeKey(4, 1024, 1024, True, "float16")
    assert sorted([ShapeKey(1, 1024, 1024, False, "f"), a])[-1] == a
    assert a.label == "4x1024x1024 float16"


def test_auto_engine_on_cpu_is_eager_with_a_note(tiny_cpu):
    notes = []
    assert isinstance(make_engine(tiny_cpu, "auto", [], notes), EagerEngine)
    assert "eager" in notes[0] and "GPU" in notes[0]
    with pytest.raises(BadInput, match="needs a CUDA device"):
        make_engine(tiny_cpu, "graph", [], [])


@pytest.mark.parametrize("failure,reason", [(None, "CUDA graphs need a CUDA device"), ("injected", "injected")])
def test_capture_failure_falls_back_to_eager_with_the_reason(tiny_cpu, failure, reason):
    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(64, 64))
    runner.capture_failure = failure
    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 2, 64, 64, True)
    sched = schedule("euler", 3, tiny_cpu.scheduler_config)
    got = runner.sample(x, sched, None, cond, ctl, guidance)
    want = EagerEngine(tiny_cpu).sample(x, sched, None, cond, ctl, guidance)
    torch.testing.assert_close(got, want)
    (row,) = runner.describe()
    assert row["state"] == "eager" and reason in row["reason"] and row["shape"].startswith("2x64x64 +control")


def test_shape_larger_than_the_buffers_runs_eager(tiny_cpu):
    runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(64, 64))
    assert runner.graph(runner.shape_key(2, 64, 64, False)) is None
    assert "larger than the static buffers" in runner.describe()[0]["reason"]


def test_sampler_coefficients():
    assert euler_coeffs(2.0, 1.0) == (0.5, 0.5)
    down, up = ancestral_split(2.0, 1.0)
    assert abs(down**2 + up**2 - 1.0) < 1e-12 and down < 1.0
    assert dpmpp_2m_coeffs(None, 2.0, 0.0) == (0.0, 1.0, 0.0)  # the last step returns the denoised image
    a, b, c = dpmpp_2m_coeffs(4.0, 2.0, 1.0)
    assert abs(a - 0.5) < 1e-12 and abs(b + c - 0.5) < 1e-12  # weights of denoised + denoised_prev sum to 1 - a


@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m"])
def test_schedules_end_at_zero_and_are_finite(tiny_cpu, sampler):
    sched = schedule(sampler, 30, tiny_cpu.scheduler_config)
    assert sched.sigmas[-1] == 0 and sched.steps == 30 and torch.isfinite(sched.table).all()
    assert sched.ancestral == (sampler == "euler_a")
    assert sched.table[0, 0] > sched.table[-1, 0] > 0


def test_graph_runner_buffers_fit_every_batch_of_a_job(tiny_cpu, job_dir):
    from conftest import write_job
    from storyboard_cli.job import load_job
    from storyboard_cli.plan import make_batches, work_items
    from storyboard_cli.render import batch_shapes, graph_runner

    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 5, size: 128x64}\n"
                                      "  - {id: b, prompt: y, candidates: 2, size: 64x192}\n"))
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    assert sorted(shapes) == [(1, 64, 128, False), (2, 192, 64, False), (4, 64, 128, False)]
    runner, keys = graph_runner(tiny_cpu, shapes)
    assert (runner.max_batch, runner.max_pixels) == (4, 192 * 128)
    assert all(runner._fits(k) for k in keys) and [k.batch for k in keys] == [s[0] for s in shapes]
