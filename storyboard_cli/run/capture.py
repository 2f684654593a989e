"""`bcg capture`: the shapes a job needs; with `warm`, captured (and compiled), checked and timed."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from storyboard_cli.costs import StepShape, device_of
from storyboard_cli.engine.base import Shape, nets_of
from storyboard_cli.engine.build import check_engine, device_name, graph_runner
from storyboard_cli.engine.conditioning import PromptCache, conditioning
from storyboard_cli.engine.conditions import KINDS
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.device import resolve_device
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.kernels.builds import CompileEvent, stage
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.engine.variants import AUTO, VARIANTS
from storyboard_cli.errors import BadInput
from storyboard_cli.job.file import NAMED_SIZES, Job
from storyboard_cli.job.estimate import observe_loops
from storyboard_cli.job.plan import render_batches, work_items
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.run.batch import batch_shapes
from storyboard_cli.run.render import model_specs
from storyboard_cli.steps import FULL, StepPlan, plan_label

log = logging.getLogger(__name__)


@dataclass
class ShapeTiming:
    shape: str
    state: str
    reason: str
    capture_s: float
    pool_mb: float
    eager_ms: float | None  # per denoising step (CFG batched), median of `repeats` timed loops
    graph_ms: float | None
    compile_s: float = 0.0

    @property
    def speedup(self) -> float | None:
        return self.eager_ms / self.graph_ms if self.eager_ms and self.graph_ms else None


def _timed_loop(engine, x, sched, cond, conds, guidance, repeats: int, plan: StepPlan | None = None) -> float:
    """Median ms per step over `repeats` loops of sched.steps steps, timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.sample(x, sched, None, cond, conds, guidance, plan)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / sched.steps)
    return sorted(times)[len(times) // 2]


def synthetic_inputs(models: SdxlModels, batch: int, width: int, height: int, with_control: int,
                     cache: PromptCache | None = None):
    """Inputs of the right shapes for timing (values do not change kernel times): x, cond, the conditioning kinds'
    values (each row's `synthetic`: with an IP-Adapter every row has one reference slot filled), guidance.
    `with_control`: Shape.control (the ControlNets' bits)."""
    cache = cache or PromptCache(models)
    cond = conditioning(cache, ["a storyboard frame, ink"] * batch, [""] * batch, width, height)
    conds = Conditions.of(*(row.synthetic(models, batch, width, height, int(with_control)) for row in KINDS.values()))
    x = torch.randn((batch, 4, height // 8, width // 8), generator=torch.Generator("cpu").manual_seed(0))
    guidance = torch.full((batch,), 5.0, device=models.device)
    return x.to(models.device), cond, conds, guidance


def time_shapes(models: SdxlModels, runner: GraphRunner, shapes: list[Shape], steps: int = 10, repeats: int = 2,
                eager: bool = True, on_row: Callable[[ShapeTiming], None] | None = None,
                plans: dict[Shape, set[StepPlan]] | None = None,
                on_stage: Callable[[CompileEvent], None] | None = None) -> list[ShapeTiming]:
    """Captures `shapes` (largest first), checks each, and times eager vs graph ms/step side by side. `plans`: the
    draft plans a shape's batches run (`job_plans`): their step kinds are captured with the rest, and each plan's
    loop is checked and timed on the graphs too (one row each, its ms per step averaged over the plan's steps).
    `on_stage`: a stage event (builds.stage) as each stage begins: what it waits for, and the time left by the shapes
    timed so far."""
    plans = plans or {}
    say = on_stage or (lambda e: None)
    say(stage(f"capturing the graphs of {len(set(shapes))} shapes, largest first"))
    runner.prepare(shapes, {s: set().union(*plans[s]) | {FULL} for s in plans} or None)
    cache = PromptCache(models)
    sched = schedule("euler", steps, models.scheduler_config)
    warm = schedule("euler", 2, models.scheduler_config)
    eager_engine = EagerEngine(models)
    rows = []

    def row(timing: ShapeTiming) -> None:
        rows.append(timing)
        if on_row:
            on_row(timing)

    todo, t0 = sorted(set(shapes), reverse=True), time.perf_counter()
    for i, shape in enumerate(todo):
        # what is left, by the shapes timed so far (the largest come first: an upper bound)
        left = (time.perf_counter() - t0) / i * (len(todo) - i) if i else None
        x, cond, conds, guidance = synthetic_inputs(models, shape.batch, shape.width, shape.height, shape.control,
                                                  cache)
        x = x * sched.init_sigma
        eager_ms = None
        if eager:
            say(stage(f"shape {i + 1}/{len(todo)} {shape.label}: timing the eager step", left or 0.0))
            eager_engine.sample(x, warm, None, cond, conds, guidance)  # warm-up
            eager_ms = _timed_loop(eager_engine, x, sched, cond, conds, guidance, repeats)
        say(stage(f"shape {i + 1}/{len(todo)} {shape.label}: checking and timing its graph", left or 0.0))
        runner.sample(x, sched, None, cond, conds, guidance)  # first replay: checked against eager
        st = runner.stats_of(shape)
        graph_ms = _timed_loop(runner, x, sched, cond, conds, guidance, repeats) if runner.can_run(shape) else None
        row(ShapeTiming(st.key.label, st.state, st.reason, st.capture_s, st.pool_mb, eager_ms, graph_ms, st.compile_s))
        for plan in sorted(plans.get(shape, ())):
            row(_plan_row(runner, shape, plan, x, cond, conds, guidance, repeats))
    return rows


def _plan_row(runner: GraphRunner, shape: Shape, plan: StepPlan, x, cond, conds, guidance, repeats: int) -> ShapeTiming:
    """A draft plan's loop on the graphs: its kinds checked against eager at first replay, then timed."""
    sched = schedule("euler", len(plan), runner.models.scheduler_config)
    runner.sample(x, sched, None, cond, conds, guidance, plan)
    # a kind that fell back stops the loop's captures: the kinds after it have no stats
    stats = [s for s in (runner.stats_of(shape, kind) for kind in set(plan)) if s is not None]
    failed = [s for s in stats if s.state != "graph"]
    graph_ms = None if failed else _timed_loop(runner, x, sched, cond, conds, guidance, repeats, plan)
    state = failed[0].state if failed else "graph"
    reason = f"{failed[0].key.label}: {failed[0].reason}" if failed else "every step kind checked"
    today = runner.shape_key(*shape)  # has its own row (DeepCache's full step where the job caches at this shape)
    kinds = [s for s in stats if s.key != today]
    return ShapeTiming(f"{shape.label} {plan_label(plan)}", state, reason, sum(s.capture_s for s in kinds),
                       sum(s.pool_mb for s in kinds), None, graph_ms)


def job_plans(job: Job) -> dict[Shape, set[StepPlan]]:
    """The step plans of a job's batches other than today's loop (the draft levers, a ControlNet's end), by shape."""
    batches = render_batches(job, work_items(job))
    plans: dict[Shape, set[StepPlan]] = {}
    for shape, batch in zip(batch_shapes(batches), batches):
        if any(kind != FULL for kind in batch.key.plan):
            plans.setdefault(shape, set()).add(batch.key.plan)
    return plans


def job_shapes(job: Job | None, controlnet: str | None, buckets: tuple[int, ...]) -> list[Shape]:
    """A job's batch shapes (its hires passes' too), or (no job) every named size at every bucket, largest first."""
    if job is not None:
        return sorted(set(batch_shapes(render_batches(job, work_items(job)))), reverse=True)
    flags = (False, True) if controlnet else (False,)
    return sorted({Shape(n, h, w, c) for (w, h) in NAMED_SIZES.values() for n in buckets for c in flags},
                  reverse=True)


def capture(*, job: Job | None = None, model: str = "sdxl-random", controlnet: str | None = None,
            buckets: tuple[int, ...] = (1, 2, 4, 8), device: str | None = None, dtype: str | None = None,
            warm: bool = False, steps: int = 10, compile: str = "auto", kernels: str = AUTO, eager: bool = False,
            on_event: Callable[[object], None] | None = None) -> tuple[list[str], list[str], list[ShapeTiming]]:
    """The shapes a job (or the named sizes x buckets) needs and the job's draft loops on them; with `warm`,
    compiles the kernels the cache lacks (unless `compile` is "off"; progress as engine.kernels.builds.CompileEvent),
    then captures, checks and times every shape and loop on `kernels`' row (engine/variants.py `choose`); `eager`:
    each shape's uncompiled step timed beside it (a warm-up does not need it: its graphs are ready without). Notes
    (why compiled kernels are not used) arrive as strings."""
    dev, dt = resolve_device(device, dtype)
    if warm and dev.type != "cuda":
        raise BadInput("bcg capture --warm needs a CUDA device: CUDA graphs do not exist on the CPU")
    kernels = check_engine("graph" if warm else "auto", compile, dev, kernels)  # a row's name (engine/variants.py)
    kinds: list = []  # the kinds' arguments to the loader after the ControlNets (an IP-Adapter, regions)
    if job is not None:
        model, controlnet, *kinds = model_specs(job, work_items(job))
    shapes = job_shapes(job, controlnet, buckets)
    plans = job_plans(job) if job is not None else {}
    labels = [s.label for s in shapes]
    loops = [f"{s.label} {plan_label(p)}" for s in sorted(plans, reverse=True) for p in sorted(plans[s])]
    if not warm:
        return labels, loops, []
    say = on_event or (lambda e: None)
    say(stage(f"loading the weights of {model}"))
    models = load_sdxl(model, controlnet, dev, dt, *kinds)
    notes: list[str] = []
    runner = graph_runner(models, shapes, "off" if compile == "off" else "on", notes, on_event, kernels)
    for note in notes:
        say(note)
    rows = time_shapes(models, runner, shapes, steps=steps, eager=eager, plans=plans, on_stage=say)
    record_loops(rows, shapes, plans, device_of(device_name(dev)), model, int(models.ip_adapter is not None))
    return labels, loops, rows


def record_loops(rows: list[ShapeTiming], shapes: list[Shape], plans: dict, device: str, model: str,
                 refs: int) -> None:
    """Each shape's graph loop (its guided step: 2 rows per image) into the cache's cost table (job/estimate.py
    `observe_loops`): a later `bcg plan` on this machine reads it. `rows` as `time_shapes` made them: a shape's row,
    then one per draft plan of it."""
    loops, at = [], 0
    for shape in sorted(set(shapes), reverse=True):
        timing, at = rows[at], at + 1 + len(plans.get(shape, ()))
        if timing.graph_ms and timing.state in VARIANTS:
            step = StepShape(shape.width, shape.height, 2 * shape.batch, len(nets_of(shape.control)), refs,
                             timing.state)
            loops.append((step, timing.graph_ms, timing.capture_s))
    try:
        observe_loops(device, model, loops)
    except OSError as e:  # only a cache: the next estimate is not calibrated on it
        log.debug("cost table not written: %s", e)
