"""CPU tests of the engine bookkeeping: shape keys, engine choice, fallback to eager with a reason."""

import inspect

import pytest
import torch

from storyboard_cli.engine import Engine, Shape
from storyboard_cli.engine.build import build_engine, check_engine, graph_runner
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.keys import GraphStats, ShapeKey
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.samplers import ancestral_split, dpmpp_2m_coeffs, euler_coeffs
from storyboard_cli.errors import BadInput
from storyboard_cli.run.capture import synthetic_inputs
from storyboard_cli.steps import FULL


def test_the_variant_table_falls_back_down_its_rows_to_eager(monkeypatch):
    """Each row falls back to a row below it, so the fallback loop ends; the chain is fp8 -> compiled -> plain -> eager;
    a compiled row's artifacts are told apart by their precision; FP8 only where it is asked for."""
    from storyboard_cli.engine.kernels.artifacts import Target
    from storyboard_cli.engine import variants
    from storyboard_cli.engine.variants import AUTO, EAGER, VARIANTS, chain, choose

    names = list(VARIANTS)
    for i, row in enumerate(VARIANTS.values()):
        assert row.fallback == EAGER or names.index(row.fallback) > i, row.name
    assert [v.name for v in chain("fp8")] + [EAGER] == ["fp8", "compiled", "plain", "eager"]
    assert [v.name for v in chain("compiled")] == ["compiled", "plain"]
    compiled = [v for v in VARIANTS.values() if v.compiled]
    assert len({v.precision for v in compiled}) == len(compiled)
    assert all(Target("unet", 64, 64, v.precision).variant is v for v in compiled)
    monkeypatch.setattr(variants, "capability", lambda device: (9, 0))  # an FP8 GPU: auto still takes fp16 compiled
    gpu = torch.device("cuda")
    assert (choose(AUTO, "auto", "auto", gpu), choose("fp8", "auto", "auto", gpu)) == ("compiled", "fp8")


def test_shape_key_identity_and_order():
    a = ShapeKey(4, 1024, 1024, False, "float16")
    assert a == ShapeKey(4, 1024, 1024, False, "float16")
    assert a != ShapeKey(4, 1024, 1024, True, "float16")
    assert sorted([ShapeKey(1, 1024, 1024, False, "f"), a])[-1] == a
    assert a.label == "4x1024x1024 float16" and a.variant == "plain"
    compiled = ShapeKey(4, 1024, 1024, False, "float16", "compiled")
    assert compiled != a and compiled.label == "4x1024x1024 float16 compiled"
    assert Shape(4, 1024, 1024, True).label == "4x1024x1024 +control"


def _fits(impl: inspect.Signature, declared: inspect.Signature) -> bool:
    """Whether every call that `declared` allows fits `impl`: the same parameters in the same order, kind and
    default; any more only with a default."""
    want, have = list(declared.parameters.values()), list(impl.parameters.values())
    same = [(p.name, p.kind, p.default) for p in want] == [(p.name, p.kind, p.default) for p in have[: len(want)]]
    return same and all(p.default is not p.empty for p in have[len(want):])


def test_both_engines_implement_the_protocol(tiny_cpu):
    """isinstance against a runtime-checkable Protocol only looks the names up: each method's parameters are held to
    the Protocol's too, so a call written against Engine runs on either engine."""
    methods = [n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")]
    assert methods == ["sample", "prepare", "ahead", "release", "can_run", "describe"]
    assert not _fits(inspect.signature(lambda self, shapes: None), inspect.signature(Engine.prepare))
    for engine, name in ((EagerEngine(tiny_cpu), "eager"), (GraphRunner(tiny_cpu), "graph")):
        assert isinstance(engine, Engine) and engine.name == name
        for method in methods:
            impl, declared = inspect.signature(getattr(type(engine), method)), inspect.signature(getattr(Engine, method))
            assert _fits(impl, declared), f"{type(engine).__name__}.{method}{impl} against Engine.{method}{declared}"
    eager = EagerEngine(tiny_cpu)
    eager.prepare([Shape(8, 64, 64, True)])
    eager.release()
    assert eager.can_run(Shape(8, 64, 64, True)) and eager.describe() == []
    assert eager.ahead(Shape(8, 64, 64, True), {FULL}) is None  # nothing to get ready beside a loop
    assert GraphRunner(tiny_cpu).ahead(Shape(1, 64, 64, False), {FULL}) is None  # no CUDA: no capture


def test_auto_engine_on_cpu_is_eager_with_a_note(tiny_cpu):
    notes = []
    assert build_engine(tiny_cpu, "auto", [], notes).name == "eager"
    assert "eager" in notes[0] and "GPU" in notes[0]
    assert build_engine(tiny_cpu, "auto", [], [], compile="off").name == "eager"
    with pytest.raises(BadInput, match="needs a CUDA device"):
        build_engine(tiny_cpu, "graph", [], [])


@pytest.mark.parametrize("kind,compile,message", [
    ("warp", "auto", "unknown engine"), ("auto", "maybe", "unknown value"), ("graph", "off", "--engine graph needs"),
    ("auto", "on", "--compile on needs a CUDA device"), ("eager", "on", "--compile on needs a CUDA device"),
])
def test_engine_options_are_checked_on_the_cpu(kind, compile, message):
    with pytest.raises(BadInput, match=message):
        check_engine(kind, compile, torch.device("cpu"))


@pytest.mark.parametrize("failure,reason", [(None, "CUDA graphs need a CUDA device"), ("injected", "injected")])
def test_capture_failure_falls_back_to_eager_with_the_reason(tiny_cpu, monkeypatch, failure, reason):
    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(64, 64))
    if failure:
        runner.capturer = lambda key: (_ for _ in ()).throw(RuntimeError(failure))
    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 2, 64, 64, True)
    sched = schedule("euler", 3, tiny_cpu.scheduler_config)
    got = runner.sample(x, sched, None, cond, ctl, guidance)
    want = EagerEngine(tiny_cpu).sample(x, sched, None, cond, ctl, guidance)
    torch.testing.assert_close(got, want)
    (row,) = runner.describe()
    assert row["state"] == "eager" and reason in row["reason"] and row["shape"].startswith("2x64x64 +control")
    assert not runner.can_run(Shape(2, 64, 64, True))


def test_a_larger_shape_grows_the_buffers_and_drops_the_graphs(tiny_cpu, monkeypatch):
    runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(64, 64))
    captured = []

    def fake_capture(key):  # the bookkeeping of a capture, without a GPU
        captured.append(key)
        runner.stats.setdefault(key, GraphStats(key)).checked = True
        return object()

    runner.capturer = fake_capture
    small, large = runner.shape_key(1, 64, 64, False), runner.shape_key(2, 128, 64, False)
    assert runner.graph(small) is not None and (runner.max_batch, runner.max_pixels) == (1, 64 * 64)
    assert runner.graph(large) is not None  # grown, not run eager
    assert (runner.max_batch, runner.max_pixels) == (2, 128 * 64) and runner.buf.x.numel() == 2 * 4 * 16 * 8
    # the graphs captured before the buffers grew point into the old ones: dropped, re-captured (and checked) on use
    assert small not in runner.graphs and runner.stats[small].state == "released"
    assert not runner.stats[small].checked
    runner.graph(small)
    assert captured == [small, large, small]


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
    from storyboard_cli.job.file import load_job
    from storyboard_cli.job.plan import make_batches, work_items
    from storyboard_cli.run.batch import batch_shapes

    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 5, size: 128x64}\n"
                                      "  - {id: b, prompt: y, candidates: 2, size: 64x192}\n"))
    shapes = batch_shapes(make_batches(work_items(job), job.buckets))
    assert sorted(shapes) == [(2, 192, 64, False), (5, 64, 128, False)]
    runner = graph_runner(tiny_cpu, shapes)
    assert (runner.max_batch, runner.max_pixels) == (5, 192 * 64)  # the largest batch, the largest image
    assert all(runner.buf.fits(s) for s in shapes)
    assert not runner.buf.fits(Shape(8, 64, 64, False)) and not runner.buf.fits(Shape(1, 256, 64, False))


def test_a_pace_learns_the_launch_queues_room_from_the_most_replays_in_flight_at_a_launch_that_waited():
    """`Pace.full`: a launch that waits finds the queue full, so as many replays as are then in flight are what the
    queue takes of this graph; one that waited with fewer in flight (the host's turn, not the queue's room) leaves the
    larger count. Before any launch waited, pieces wait for `ahead`."""
    from storyboard_cli.engine.graph.pace import BLOCKED_S, Pace

    class Graph:
        def replay(self):
            now[0] += wait.pop(0)

    now, wait, queued = [0.0], [], [0]
    pace = Pace(False, ahead=4)
    pace.in_flight, pace.clock = lambda: queued[0], lambda: now[0]

    def launch(waits: bool, in_flight: int) -> None:
        wait.append(2 * BLOCKED_S if waits else 0.0)
        queued[0] = in_flight
        pace.replay(Graph())

    launch(False, 3)
    assert not pace.room() and pace.full == 0  # three queued, none waited: four wanted
    launch(True, 3)
    assert pace.room() and pace.full == 3
    pace.blocked = False  # a piece ran
    assert pace.room()  # three still queued: the queue's room
    queued[0] = 2
    assert not pace.room()
    launch(True, 2)  # waited with two in flight: the queue's room stays three
    assert pace.full == 3
    pace.blocked = False
    assert not pace.room()
    launch(True, 5)
    pace.blocked = False
    queued[0] = 4
    assert pace.full == 5 and pace.room()  # more than `ahead` fit: `ahead` is enough


def test_a_loops_pieces_of_work_run_while_the_gpu_has_replays_queued_ahead_of_them(tiny_cpu):
    """The pieces a loop runs between its replays (the next batch's captures and prompts) run while AHEAD_REPLAYS of its
    replays are queued and not yet run, or when its last launch waited for room in the launch queue, and from then on
    while as many are queued as were then (the queue's room for this graph: `Pace.full`); after a piece that let the
    GPU run down the queue, the loop queues replays again before the next piece; the rest run after the last
    replay. Here a GPU is simulated (`Pace.in_flight`): each replay queues a step, and a long piece lets the GPU run
    three, and a launch takes no time on the host's clock unless it waits. On the CPU the graphs replay their captured
    step (helpers/graphs.py), and the simulated loop's replays compute nothing."""
    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.graph import pace as graph_pace
    from storyboard_cli.engine.graph.pace import Pace
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    from helpers.graphs import cpu_replays

    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(64, 64))
    cpu_replays(runner)
    replays, seen, ran, now = [], [], [0], [0.0]  # ran: the steps the simulated GPU has run; now: its host clock
    capturer = runner.capturer
    slow_launch, simulated = {6}, [False]  # the replay whose launch waits for room in the launch queue

    def counted(key):
        graph = capturer(key)
        replay = graph.replay

        def launch():  # in the simulated loop a launch takes no time unless it waits, and computes nothing
            if not simulated[0]:
                return replay()
            replays.append(key)
            if len(replays) in slow_launch:
                now[0] += 3 * graph_pace.BLOCKED_S
        graph.replay = launch
        return graph

    def paced(cuda):
        pace = Pace(cuda)
        pace.in_flight, pace.clock = lambda: len(replays) - ran[0], lambda: now[0]
        return pace

    runner.capturer, runner.pace = counted, paced
    runner.prepare([Shape(2, 64, 64, 0)])
    x, cond, conds, guidance = synthetic_inputs(tiny_cpu, 2, 64, 64, 0)
    sched = schedule("euler", 12, tiny_cpu.scheduler_config)

    def piece(n, long):
        def run():
            seen.append((n, len(replays), len(replays) - ran[0]))
            if long:  # the host's work outlasts three steps: the GPU runs them meanwhile
                ran[0] = min(len(replays), ran[0] + 3)
        return run

    with torch.no_grad():
        runner.sample(x, sched, None, cond, conds, guidance)  # its graph's check on the first batch's first step
        simulated[0] = True  # the next batch's loop: every step a replay
        longs = {0, 3, 7}
        runner.sample(x, sched, None, cond, conds, guidance, None, iter([piece(n, n in longs) for n in range(10)]))
    assert graph_pace.AHEAD_REPLAYS == 4 and len(replays) == 12
    assert seen == [
        (0, 4, 4),  # the first piece once four replays are queued; it is long: the GPU runs three steps meanwhile
        (1, 6, 3),  # the sixth launch waited for room in the queue, with three in flight: the queue holds three
        (2, 6, 3), (3, 6, 3),  # so the next pieces run with three queued: a short one, then the long one
        (4, 9, 3), (5, 9, 3), (6, 9, 3), (7, 9, 3),  # refilled to three: short pieces one after another
        (8, 12, 3), (9, 12, 3),  # after the long seventh, three queued again at the last launch: the rest
    ], seen
