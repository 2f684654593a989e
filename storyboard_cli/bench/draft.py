"""`bcg bench`'s draft parts: the draft levers' step loops side by side, the bench job with and without
`--draft` (and the drift of every draft image), and the graphs its draft render adds."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.bench.contenders import bcg_render
from storyboard_cli.bench.drift import drift_summary, picture_drift
from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import graph_runner
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.job.file import DRAFT_CUTOFF, DRAFT_DEEPCACHE, Job, as_draft
from storyboard_cli.job.plan import guided_steps, make_batches, work_items
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.batch import batch_kinds, batch_shapes
from storyboard_cli.run.capture import synthetic_inputs
from storyboard_cli.steps import FULL, step_plan


# the step loops `draft_steps` times side by side: (cfg_cutoff, DeepCache interval), branch 0
DRAFT_LOOPS = {"full": (1.0, 0), "deepcache_3": (1.0, 3), "cfg_cutoff_0.5": (0.5, 0), "cfg_cutoff_0.7": (0.7, 0),
               "draft_preset": (DRAFT_CUTOFF, DRAFT_DEEPCACHE.interval)}


def _loop_s(engine, x, sched, cond, conds, guidance, plan) -> float:
    """One whole loop's seconds: CUDA events on the GPU, the wall clock on the CPU (a smoke run)."""
    cuda = x.device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    engine.sample(x, sched, None, cond, conds, guidance, plan)
    if not cuda:
        return time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def draft_steps(models: SdxlModels, log: Callable[[str], None], batch: int = 8, side: int = 1024, steps: int = 30,
                repeats: int = 3) -> dict:
    """ms per image-step of whole `steps`-step loops at `batch` images, full against each lever (DRAFT_LOOPS),
    in one graph runner (plain graphs; the eager engine on the CPU), every graph checked and warmed first, then
    `repeats` rounds taking each loop in turn; medians. Also each graph's own ms per replay."""
    cuda = models.device.type == "cuda"
    shape = Shape(batch, side, side, False)
    sched = schedule("euler", steps, models.scheduler_config)
    plans = {name: step_plan(steps, guided_steps(steps, cutoff), interval, DRAFT_DEEPCACHE.branch)
             for name, (cutoff, interval) in DRAFT_LOOPS.items()}
    engine = graph_runner(models, [shape], compile="off") if cuda else EagerEngine(models)
    engine.prepare([shape], {shape: set().union(*plans.values())})
    x, cond, conds, guidance = synthetic_inputs(models, batch, side, side, False)
    x = x * sched.init_sigma
    for plan in plans.values():  # first replays (checked against eager) and a warm-up loop each
        engine.sample(x, sched, None, cond, conds, guidance, plan)
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():
            times[name].append(_loop_s(engine, x, sched, cond, conds, guidance, plan))
    ms = {name: statistics.median(t) * 1000 / (steps * batch) for name, t in times.items()}
    rec = {"shape": shape.label, "steps": steps, "repeats": repeats, "engine": engine.name,
           "ms_per_image_step": ms, "speedup_vs_full": {name: ms["full"] / m for name, m in ms.items()},
           "guided_steps": {name: sum(k.guided for k in plan) for name, plan in plans.items()},
           "graphs": engine.describe()}
    log("draft steps at " + shape.label + ": " + ", ".join(f"{n} {m:.2f} ms/image-step ({rec['speedup_vs_full'][n]:.2f}x)"
                                                          for n, m in ms.items()))
    return rec


def _groups(runner, today: set) -> dict:
    """Capture seconds, warm-ups and pool MB of today's graphs (the keys in `today`: the graphs a render without
    the draft levers replays) and of the extra kinds, from the stats."""
    stats = list(runner.stats.values())
    groups = {"plain": [s for s in stats if s.key in today], "extra": [s for s in stats if s.key not in today]}
    rec = {name: {"graphs": len(g), "warmups": sum(s.warmup for s in g), "capture_s": sum(s.capture_s for s in g),
                  "warmup_s": sum(s.warmup_s for s in g), "end_s": sum(s.end_s for s in g),
                  "pool_mb": sum(s.pool_mb for s in g)} for name, g in groups.items()}
    rec["capture_ratio"] = rec["extra"]["capture_s"] / rec["plain"]["capture_s"] if rec["plain"]["capture_s"] else None
    rec["pool_ratio"] = rec["extra"]["pool_mb"] / rec["plain"]["pool_mb"] if rec["plain"]["pool_mb"] else None
    return rec


def draft_capture(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The bench job's graphs (plain, --compile off): today's step kinds captured first, then the extra kinds
    its draft render adds (conditional rows, DeepCache full and shallow): capture seconds, warm-ups and pool MB
    of each group, from the runner's per-graph stats. Then, in a fresh runner, both sets in one `prepare` (as
    `capture --warm` does for a job with draft shots, and a process that renders both kinds of job): today's step
    is DeepCache's full step where a shape has one, and the whole set's capture seconds and pool against today's
    graphs alone, captured again after it in a third runner. CPU: nothing to capture."""
    if models.device.type != "cuda":
        return {"skipped": "CUDA graphs need a GPU"}
    batches = make_batches(work_items(as_draft(job)), job.buckets)
    shapes = batch_shapes(batches)
    kinds = batch_kinds(batches)
    runner = graph_runner(models, shapes, compile="off")
    runner.prepare(shapes)
    today = {runner.shape_key(*s) for s in shapes}
    runner.prepare(shapes, kinds)
    rec = _groups(runner, today)
    rec["feature_buffer_mb"] = runner.feature_mb()
    rec["graphs"] = runner.describe()
    log(f"draft capture: plain {json.dumps(rec['plain'])}, extra {json.dumps(rec['extra'])}")
    runner.release("bench part done")
    del runner
    together = graph_runner(models, shapes, compile="off")
    together.prepare(shapes, {s: kinds.get(s, set()) | {FULL} for s in shapes})
    both = _groups(together, {together.shape_key(*s) for s in shapes})  # today's step: DeepCache's full where shared
    both["graphs"] = together.describe()
    together.release("bench part done")
    del together
    # today's graphs alone once more, in the same state of the process as `together` (the first runner paid the
    # process's first captures: library handles, kernel modules)
    again = graph_runner(models, shapes, compile="off")
    again.prepare(shapes)
    alone = rec["today_alone"] = _groups(again, set(again.stats))["plain"]
    again.release("bench part done")
    total = {k: both["plain"][k] + both["extra"][k] for k in ("graphs", "capture_s", "pool_mb")}
    both["against_today_alone"] = {
        "graphs": total["graphs"], "capture_s": total["capture_s"], "pool_mb": total["pool_mb"],
        "capture_ratio": total["capture_s"] / alone["capture_s"] - 1 if alone["capture_s"] else None,
        "pool_ratio": total["pool_mb"] / alone["pool_mb"] - 1 if alone["pool_mb"] else None}
    rec["together"] = both
    log(f"draft capture, both in one prepare: plain {json.dumps(both['plain'])}, extra {json.dumps(both['extra'])}, "
        f"all against today's alone {json.dumps(both['against_today_alone'])}")
    return rec


def draft_job(job: Job, models: SdxlModels, log: Callable[[str], None]) -> dict:
    """The bench job rendered without and with the draft preset (ControlNet shots included), side by side,
    each render capturing its own graphs (--compile off): images/s and their ratio; then every draft image
    against the full image of the same seed (PSNR, mean absolute difference)."""
    with tempfile.TemporaryDirectory() as tmp:
        full = bcg_render(job, models, Path(tmp) / "full")
        draft = bcg_render(as_draft(job), models, Path(tmp) / "draft")
        drift = picture_drift(Path(tmp) / "draft", Path(tmp) / "full")
    rec = {"full": full, "draft": draft, "ratio": draft["images_per_s"] / full["images_per_s"],
           "denoise_ratio": full["stages_s"]["denoise"] / draft["stages_s"]["denoise"], "drift": drift}
    rec.update(drift_summary(drift))
    for name, r in (("full", full), ("draft", draft)):
        if r["failed"]:  # a ratio over failed images measures nothing
            log(f"draft job ({name}): {r['failed']} images failed ({r['failure']})")
            rec["ratio"] = float("nan")
    log(f"draft job: {rec['ratio']:.3f}x the images/s of the full render (denoise {rec['denoise_ratio']:.3f}x); "
        f"PSNR {json.dumps(rec.get('psnr_db'))} dB, MAD {json.dumps(rec.get('mad'))}")
    return rec
