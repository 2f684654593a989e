"""Compiled kernels inside the CUDA graphs (skipped without CUDA), on sdxl-random at 1024x1024 fp16, a size
the bench job uses: the kernels come from $BCG_CACHE (built side by side first when missing: minutes on an
H200), and every compiled replay is checked against the UNCOMPILED eager step. A LoRA swap reaches the
compiled graphs with no new capture and no pointer changed."""

import pytest
import torch

from helpers.gpu import (SIDE, assert_rel_close, compiled_setup, lora_swap_reaches_the_graph, loop_inputs,
                         replay_is_checked, unguided, unit_eps)
from helpers.kernels import loads_in_a_new_process

pytestmark = pytest.mark.gpu
# the runner's own first-replay check (one step, its variant's check_rtol) and the module calls below are the close
# comparisons; over a few steps a random-weight network in fp16 grows the kernels' rounding difference, and
# guidance would multiply it: the loops run at guidance 1
RTOL = 0.05
# the compiled UNet's noise prediction against the eager module's, same inputs: 1.6e-3 measured (fp16, H200); an
# artifact that read its float32 timestep as fp16 was 1.2e-1 to 1.6e-1 off
EPS_RTOL = 1e-2


@pytest.fixture(scope="module")
def setup():
    return compiled_setup()


@pytest.mark.parametrize("batch,control", [(1, False), (2, False), (2, True)])
def test_compiled_replay_matches_the_uncompiled_eager_step(setup, batch, control):
    replay_is_checked(setup, batch, control, "compiled", RTOL, "euler_a")


def test_a_lora_swap_reaches_the_compiled_graph(setup, tmp_path):
    lora_swap_reaches_the_graph(setup, tmp_path, RTOL)


def test_a_check_failure_falls_back_to_the_plain_graph(setup, monkeypatch):
    """The compiled graph fails its check (and was the runner's only graph, so its pool went with it): the shape runs
    its PLAIN graph, captured into a new pool and checked, not eager (capturing into the dead pool's handle tripped an
    allocator assert, and that failed capture left the default CUDA generator in capture mode)."""
    from dataclasses import replace

    from storyboard_cli.engine.graph.keys import ShapeKey
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.variants import VARIANTS

    models, runner, eager = setup
    fresh = GraphRunner(models, max_batch=1, max_hw=(SIDE, SIDE), compiled=runner.compiled)
    monkeypatch.setitem(VARIANTS, "compiled", replace(VARIANTS["compiled"], check_rtol=-1.0))
    args = unguided(loop_inputs(models, 1, SIDE, SIDE, False, "euler", steps=3))
    got = fresh.sample(*args)
    key = ShapeKey(1, SIDE, SIDE, False, "float16", "compiled")
    assert fresh.stats[key].state == "plain" and "relative error" in fresh.stats[key].reason
    plain = fresh.shape_key(1, SIDE, SIDE, False)
    assert plain.variant == "plain" and fresh.stats[plain].state == "graph" and fresh.stats[plain].checked, \
        fresh.stats[plain].reason
    assert_rel_close(got, eager.sample(*args), RTOL)
    torch.empty(4, device=models.device).uniform_()  # CUDA random ops still work outside a capture


def test_a_compiled_graphs_warm_up_runs_at_the_fewest_rows(setup):
    """A size's first compiled graph warms its artifact's kernels up at the fewest rows the artifact takes (2), not at
    its batch's; its capture and its check against the uncompiled eager step pass as before."""
    from storyboard_cli.engine.graph.runner import GraphRunner

    models, runner, eager = setup
    # at most the setup's 2 images: a larger runner would grow the kernels' shared zero residuals under its graphs
    fresh = GraphRunner(models, max_batch=2, max_hw=(SIDE, SIDE), compiled=runner.compiled)
    args = unguided(loop_inputs(models, 2, SIDE, SIDE, False, "euler", steps=3))
    got = fresh.sample(*args)
    (stats,) = fresh.stats.values()  # one graph: 2 images guided, 4 rows
    assert stats.key.variant == "compiled" and stats.state == "graph" and stats.checked, stats.reason
    assert stats.warmup and stats.warmup_rows == 2, (stats.warmup_rows, stats.reason)
    assert_rel_close(got, eager.sample(*args), RTOL)


def test_a_compiled_graph_that_needs_a_warm_up_gets_it_beside_the_loop_before(setup):
    """The ControlNet batch's compiled graph (kernels no graph before ran) is warmed up between the replays of the
    batch before, on scratch buffers on the warm-ups' stream with no sync, and captured in the next piece on torch's
    capture stream: both loops stay close to the uncompiled eager loops, and its first replay checks against eager.
    Its ControlNet's artifact is loaded there too, in the piece before the warm-up (a render defers each graph's
    kernels to its first capture): kernels of their own here, so that the load is this test's."""
    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.steps import FULL

    models, runner, eager = setup
    kernels = CompiledKernels(models, None, root=runner.compiled.root)
    fresh = GraphRunner(models, max_batch=2, max_hw=(SIDE, SIDE), compiled=kernels)
    shapes = [Shape(2, SIDE, SIDE, 0), Shape(1, SIDE, SIDE, 1)]
    fresh.prepare(shapes, beside=True)
    control = fresh.shape_key(*shapes[1], FULL)
    assert control.variant == "compiled" and control not in fresh.graphs  # left to the loop before
    assert [t.module for t in kernels.deferred()] == ["controlnet"], kernels.load_note()
    first, second = (unguided(loop_inputs(models, s.batch, SIDE, SIDE, bool(s.control), "euler", steps=4))
                     for s in shapes)
    got = [fresh.sample(*first, None, fresh.ahead(shapes[1], {FULL})), fresh.sample(*second)]
    stats = fresh.stats[control]
    assert (stats.state, stats.beside, stats.warmup, stats.warmup_rows) == ("graph", True, True, 2), fresh.describe()
    assert stats.load_s > 0 and not kernels.deferred(), fresh.describe()  # loaded beside, by the piece before
    assert stats.checked and "against" not in stats.reason, stats.reason  # the ControlNet's kernels, against eager
    assert_rel_close(got[0], eager.sample(*first), RTOL)
    assert_rel_close(got[1], eager.sample(*second), RTOL)
    # each batch's lead, from `sample`'s entry to its loop's first replay, is timed on the graph of its first step
    torch.cuda.synchronize()
    rows = {r["shape"]: r for r in fresh.describe()}
    for key in (fresh.shape_key(*shapes[0], FULL), control):
        assert rows[key.label]["batches"] == 1 and rows[key.label]["lead_ms"] > 0, rows[key.label]


def test_a_second_process_loads_from_the_cache(setup):
    from storyboard_cli.models.tiny import cache_root

    assert loads_in_a_new_process(cache_root() / "compiled", "cuda", "float16", "sdxl-random", SIDE,
                                  model="sdxl-random") == "loaded"


@pytest.mark.parametrize("timestep", [999.0, 500.0, 50.0])
@pytest.mark.parametrize("control", [False, True])
def test_compiled_module_calls_match_the_eager_modules(setup, timestep, control):
    """The compiled UNet (and ControlNet) calls against the eager modules on the same unit-scale inputs, at three
    timesteps: the prediction itself, not a step's result, which a wrong prediction moves by a fraction of its error."""
    from storyboard_cli.engine.eager import StepCalls

    models, runner, _ = setup
    assert_rel_close(unit_eps(models, runner.compiled, timestep, control, 0),
           unit_eps(models, StepCalls.eager(models), timestep, control, 0), EPS_RTOL)


def test_a_later_run_checks_its_graph_against_its_kernels_on_the_first_runs_record(setup, tmp_path):
    """The product's runner keeps its checks against the eager step beside the artifacts (engine/graph/ledger.py); a
    later run on the same kernels, weights and GPU checks its graph against its kernels outside the graph on its
    batch's first step, and its loop matches the eager loop as the first run's does."""
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.models.tiny import cache_root

    models, runner, eager = setup
    assert runner.ledger is not None and runner.ledger.root == cache_root() / "compiled"
    args = unguided(loop_inputs(models, 2, SIDE, SIDE, False, "euler", steps=3))
    reasons = []
    for _ in range(2):  # at most the setup's 2 images (the kernels' shared zero residuals)
        fresh = GraphRunner(models, max_batch=2, max_hw=(SIDE, SIDE), compiled=runner.compiled,
                            ledger=CheckLedger(models, runner.compiled, tmp_path))
        got = fresh.sample(*args)
        (stats,) = fresh.stats.values()
        assert stats.key.variant == "compiled" and stats.state == "graph" and stats.checked, stats.reason
        assert_rel_close(got, eager.sample(*args), RTOL)
        reasons.append(stats.reason)
    assert "against" not in reasons[0] and len(list(tmp_path.glob("checked-*.json"))) == 1, reasons
    assert reasons[1].endswith("(against eager at 2 images in an earlier run)"), reasons


def test_a_first_batch_whose_kernels_were_checked_runs_its_first_steps_while_its_graph_is_captured(setup, tmp_path):
    """A render's first batch on kernels the ledger checked against eager (every run after a machine's first): the
    runner's `prepare(beside=True)` leaves its graph to its batch, which runs its first OWN_STEPS steps on the kernels
    outside the graph while the graph is captured beside them on torch's capture stream (no sync), and checks its
    first replay against the first image's step alone. The loop matches the uncompiled eager loop, and the same
    batch again (every step a replay) matches it closely: the steps outside the graph ran the graph's kernels."""
    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import OWN_STEPS, GraphRunner
    from storyboard_cli.steps import FULL

    models, runner, eager = setup
    args = unguided(loop_inputs(models, 2, SIDE, SIDE, False, "dpmpp_2m", steps=6))
    shape = Shape(2, SIDE, SIDE, 0)

    def fresh() -> GraphRunner:  # at most the setup's 2 images (the kernels' shared zero residuals)
        return GraphRunner(models, max_batch=2, max_hw=(SIDE, SIDE), compiled=runner.compiled,
                           ledger=CheckLedger(models, runner.compiled, tmp_path))

    first = fresh()
    first.prepare([shape], beside=True)  # no check on record: captured before its batch, checked against eager
    key = first.shape_key(*shape, FULL)
    assert key.variant == "compiled" and key in first.graphs
    want = first.sample(*args)
    behind = fresh()
    behind.prepare([shape], beside=True)
    assert key not in behind.graphs  # left to its batch
    got = behind.sample(*args)
    stats = behind.stats[key]
    assert (stats.state, stats.beside, stats.beside_of, stats.warmup_rows) == ("graph", True, key.label, 4), \
        behind.describe()
    assert stats.checked and f"first {OWN_STEPS} steps" in stats.reason and stats.replays == 6 - OWN_STEPS
    again = behind.sample(*args)
    assert stats.replays == 12 - OWN_STEPS
    assert_rel_close(got, again, 1e-3)
    assert_rel_close(got, want, 1e-3)
    assert_rel_close(got, eager.sample(*args), RTOL)
