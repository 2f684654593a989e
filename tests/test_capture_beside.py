"""Graphs captured beside the loop before their batch (GraphRunner.ahead, BatchRunner.capture_ahead): which graphs
`prepare(beside=True)` leaves to it, that the loop's pieces capture them, and that the pictures are those of a render
that captured every graph ahead. CUDA's part (the capture itself while replays run) is tests/test_overlap.py's GPU
test; here each 'graph' replays its step function on the CPU (tests/helpers/graphs.py)."""

import numpy as np
import pytest
from PIL import Image

from conftest import write_job
from helpers.graphs import cpu_replays
from storyboard_cli.engine.graph.keys import Warmed
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.job.file import as_draft, load_job
from storyboard_cli.run.render import RenderOptions, render

JOB = """version: 1
model: tiny
controlnet: tiny
defaults: {steps: 4, size: 64x64}
shots:
  - {id: a, prompt: a cliff, seed: 9, control: {image: control/hero_pose.png}}
  - {id: b, prompt: a lighthouse, seed: 1}
  - {id: c, prompt: a harbour, seed: 7, guidance: 1}
"""


def _render(job, out, models, beside: bool):
    runner = GraphRunner(models, max_batch=1, max_hw=(64, 64))
    captured = cpu_replays(runner)
    replay = runner.capturer

    def capture(key):  # the bookkeeping of a real capture: what it ran, so that later captures skip the warm-up
        graph = replay(key)
        runner.warmed.append(Warmed.of(key))
        return graph

    runner.capturer = capture
    runner.beside_ready = lambda: beside
    runner.beside_recorder = lambda v: replay(v.key)
    result = render(job, RenderOptions(out_dir=out), models=models, engine=runner)
    return result, runner, captured


def _pixels(folder):
    return {p.relative_to(folder): np.asarray(Image.open(p)) for p in sorted(folder.glob("*/*.png"))}


@pytest.mark.parametrize("draft", [False, True])
def test_graphs_that_need_no_warm_up_are_captured_beside_the_loop_before_theirs(job_dir, tmp_path, tiny_cpu, draft):
    job = load_job(write_job(job_dir, JOB))
    job = as_draft(job) if draft else job
    ahead, runner_a, captured_a = _render(job, tmp_path / "ahead", tiny_cpu, beside=False)
    beside, runner_b, captured_b = _render(job, tmp_path / "beside", tiny_cpu, beside=True)
    assert ahead.status == beside.status == "done" and ahead.rendered == beside.rendered == 3
    by_beside = {k for k, s in runner_b.stats.items() if s.beside}
    if draft:  # every graph of a draft 64x64 batch writes or reads DeepCache's feature: never beside a loop
        assert not by_beside and all(k.step.cache for k in captured_b if k.control == 0)
    else:  # the ControlNet shot runs first; the shots after it run kernels its graph ran (same rows, one net fewer)
        assert by_beside, runner_b.describe()
    assert not any(s.beside for s in runner_a.stats.values())
    assert sorted(captured_a) == sorted(captured_b)  # the same graphs, captured at another time
    labels = {k.label for k in runner_b.stats}
    for key in by_beside:
        stats = runner_b.stats[key]
        assert stats.state == "graph" and stats.checked and not stats.warmup and stats.replays > 0
        assert key.control == 0 and captured_b.index(key) > 0
        assert stats.beside_of in labels - {key.label}, stats.beside_of  # the graph whose loop it ran beside
    rows = {r["shape"]: r for r in beside.report.graphs}
    assert all(rows[k.label]["beside"] and rows[k.label]["beside_of"] == runner_b.stats[k].beside_of
               for k in by_beside)
    # the GPU's idle time between replays: no CUDA events on the CPU, so none; the report's table shows the column
    assert all(r["idle_ms"] == 0.0 for r in rows.values())
    graphs_md = (tmp_path / "beside" / "report.md").read_text().split("## Graphs")[1]
    assert "| replay ms | GPU idle ms | note |" in graphs_md and graphs_md.count(" | 0.0 | ") >= len(rows)
    a, b = _pixels(tmp_path / "ahead"), _pixels(tmp_path / "beside")
    assert a.keys() == b.keys() and len(a) == 3
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    # their host seconds are capture, hidden: the captures before the first batch are what was exposed
    hidden = beside.report.hidden_s or {}
    assert (hidden.get("capture", 0.0) > 0.0) == bool(by_beside)


def test_a_graph_that_needs_a_warm_up_is_captured_before_the_first_batch(job_dir, tmp_path, tiny_cpu):
    """Plain graphs at other rows run other kernels: a warm-up on the static buffers the loop in flight reads would
    break that loop, so such a graph is never left to the loop before it."""
    text = JOB.replace("{id: b, prompt: a lighthouse, seed: 1}", "{id: b, prompt: a lighthouse, seed: 1, candidates: 2}")
    text = text.replace("controlnet: tiny\n", "controlnet: tiny\nbuckets: [1, 2, 4, 8]\n")  # b and d: 2 + 1 images
    job = load_job(write_job(job_dir, text + "  - {id: d, prompt: a boat, seed: 3}\n"))
    result, runner, _ = _render(job, tmp_path / "out", tiny_cpu, beside=True)
    assert result.status == "done" and result.rendered == 5
    beside = {k.label: s.beside for k, s in runner.stats.items()}
    assert beside["2x64x64 float32"] is False  # two rows of the plain step: kernels no graph before ran
    assert beside["1x64x64 float32"] is True  # the ControlNet shot's graph ran its kernels


def test_a_loops_end_runs_the_pieces_it_must_and_drops_the_spare_ones():
    """`run_between`: one piece at a time, spare ones too, while the loop has room; at its end every piece left up to
    the first `Spare` one, which is dropped with the rest (they come last), and none of them is even asked for."""
    from storyboard_cli.engine.base import Spare, run_between

    ran, asked = [], []

    def pieces():
        for name in ("encode", "inputs"):
            yield lambda name=name: ran.append(name)
        for name in ("capture c", "capture d"):
            asked.append(name)
            yield Spare(lambda name=name: ran.append(name))

    left = run_between(run_between(pieces()))
    assert ran == ["encode", "inputs"] and asked == []
    assert run_between(left) is left and ran[-1] == "capture c"  # a spare piece, while the loop has room
    assert run_between(left, everything=True) is None and ran[-1] == "capture c" and asked == ["capture c",
                                                                                             "capture d"]
    every = pieces()
    assert run_between(every, everything=True) is None and ran[-2:] == ["encode", "inputs"]
    assert asked[-1] == "capture c"  # the first spare piece reached ends it, unrun


JOB_SIZES = """version: 1
model: tiny
buckets: [1]
defaults: {steps: STEPS, size: 64x64}
shots:
  - {id: a, prompt: a cliff, seed: 9}
  - {id: b, prompt: a lighthouse, seed: 1, size: 64x128}
  - {id: c, prompt: a harbour, seed: 7, size: 128x64}
  - {id: d, prompt: a boat, seed: 3, size: 128x64}
"""


class _AskedEngine:
    """The eager engine, whose `ahead` is asked for pieces (one each, logged with its `spare`): a graph engine's
    captures for a batch, as BatchRunner hands them to the loop."""

    def __init__(self, models, log):
        from storyboard_cli.engine.eager import EagerEngine

        self.eager, self.log, self.name = EagerEngine(models), log, "eager"

    def __getattr__(self, name):
        return getattr(self.eager, name)

    def ahead(self, shape, kinds, spare=False):
        self.log.append(("asked", (shape.height, shape.width), spare))
        return iter([lambda: self.log.append(("ran", (shape.height, shape.width), spare))])


@pytest.mark.parametrize("steps", [40, 1])
def test_a_loop_captures_the_next_batchs_graphs_then_spares_for_the_batches_after(job_dir, tiny_cpu, steps):
    """Beside a batch's loop: the next batch's captures first (with its prompts, noise and inputs), then, while the
    loop has room, `Spare` captures for the batches after it, each shape once, asked of the engine only as the loop
    reaches them. A loop too short to reach them (one step: its pieces run after its last one) drops them: the next
    batch's pieces are all that must run there."""
    from storyboard_cli.job.plan import make_batches, work_items
    from storyboard_cli.run.batch import BatchRunner

    job = load_job(write_job(job_dir, JOB_SIZES.replace("STEPS", str(steps))))
    batches = make_batches(work_items(job), job.buckets)
    sizes = [(b.key.height, b.key.width) for b in batches]
    assert len(batches) == 4 and len(set(sizes)) == 3 and sizes[2] == sizes[3] != sizes[1]
    log = []
    runner = BatchRunner(tiny_cpu, _AskedEngine(tiny_cpu, log))
    assert runner.ahead
    runner.run_batch(batches[0], upcoming=batches[1:])
    if steps > 1:
        assert log == [("asked", sizes[1], False), ("ran", sizes[1], False), ("asked", sizes[2], True),
                       ("ran", sizes[2], True)], log  # the fourth batch's shape is the third's: asked once
    else:
        assert log == [("asked", sizes[1], False), ("ran", sizes[1], False), ("asked", sizes[2], True)], log
    log.clear()
    runner.run_batch(batches[0], fallback=True, upcoming=batches[1:])
    assert log == []  # a batch on the fallback engine captures nothing for the others


def test_a_spare_capture_waits_for_its_sizes_kernels_to_be_built(tiny_cpu):
    """A graph runner asked for a spare capture of a shape whose compiled kernels this run still builds gives none (the
    compiled graph will replace one captured now); once they are in the cache, or where the run compiles nothing, the
    shape's captures are what they would be for the next batch."""
    from types import SimpleNamespace

    from storyboard_cli.engine.base import Shape
    from storyboard_cli.steps import FULL

    runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(64, 64))
    runner.beside_ready = lambda: True
    shape, building = Shape(1, 64, 64, 0), object()
    runner.compiled = SimpleNamespace(waiting=[building], targets=lambda shapes: [building])
    assert runner.ahead(shape, {FULL}, spare=True) is None
    assert runner._kernels_to_come(shape)
    runner.compiled.waiting = []
    assert not runner._kernels_to_come(shape)
    runner.compiled = None
    assert not runner._kernels_to_come(shape)


@pytest.mark.gpu
def test_on_a_gpu_a_graph_captured_beside_the_loop_before_renders_what_one_captured_ahead_renders(job_dir, tmp_path):
    """The real capture while the ControlNet shot's replays run (thread-local mode, torch's capture stream, the pool
    shared, no sync): the pictures of a render that captured every graph before the first batch, within one level."""
    import torch

    from storyboard_cli.run.render import RenderSession

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    class Ahead(RenderSession):
        def batch_runner(self):
            self.engine.beside_ready = lambda: False  # before `prepare`: every graph captured ahead
            return super().batch_runner()

    job = load_job(write_job(job_dir, JOB))
    ahead = Ahead(job, RenderOptions(out_dir=tmp_path / "ahead", device="cuda", compile="off")).execute()
    beside = RenderSession(job, RenderOptions(out_dir=tmp_path / "beside", device="cuda", compile="off")).execute()
    assert ahead.status == beside.status == "done" and beside.engine == "graph"
    rows = {r["shape"]: r for r in beside.report.graphs}
    assert [s for s, r in rows.items() if r["beside"]] == ["1x64x64 float16"], rows
    assert not any(r["beside"] for r in ahead.report.graphs)
    assert rows["1x64x64 float16"]["state"] == "graph" and "checked" in rows["1x64x64 float16"]["reason"]
    assert beside.report.hidden_s["capture"] > 0
    a, b = _pixels(tmp_path / "ahead"), _pixels(tmp_path / "beside")
    assert a.keys() == b.keys() and len(a) == 3
    for name in a:
        assert np.abs(a[name].astype(int) - b[name].astype(int)).max() <= 1, name
