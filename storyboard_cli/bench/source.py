"""`bcg bench`'s `source` part: the text-to-image step against an img2img and an inpainting step (the source kind's
blend after every update), side by side in one graph runner on the same shape: the claim "an inpaint or img2img step
at 8 x 1024x1024 (compiled) at most 3% slower than the text-to-image step"."""

from __future__ import annotations

import statistics
from typing import Callable

from storyboard_cli.bench.draft import _loop_s
from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import graph_runner
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.conditions.source import NAME as SOURCE
from storyboard_cli.engine.conditions.source import synthetic
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.run.capture import synthetic_inputs

STRENGTH = 0.5


def source_steps(models: SdxlModels, log: Callable[[str], None], batch: int = 8, side: int = 1024, steps: int = 30,
                 repeats: int = 5, compile: str = "on") -> dict:
    """ms per image-step of three loops at `batch` images of side x side, in one graph runner (compiled kernels with
    `compile` "on": built first where the cache lacks them; the eager engine on the CPU): text-to-image (its graph's
    blend idle), img2img (the schedule's tail at STRENGTH, every row's mask 1) and inpainting (the same tail, half of
    each row repainted); every graph checked and warmed first, then `repeats` rounds taking each loop in turn; medians
    and each loop's ratio to text-to-image."""
    cuda = models.device.type == "cuda"
    shape = Shape(batch, side, side, False)
    engine = graph_runner(models, [shape], compile=compile) if cuda else EagerEngine(models)
    engine.prepare([shape])
    x, cond, conds, guidance = synthetic_inputs(models, batch, side, side, False)
    full = schedule("euler", steps, models.scheduler_config)
    start = steps - int(steps * STRENGTH)
    tail = schedule("euler", steps, models.scheduler_config, start)
    others = Conditions(tuple(v for v in conds if v.kind != SOURCE))
    inpaint = synthetic(models, batch, side, side, 0, repaint=0.5)  # half of each row repainted
    img2img = synthetic(models, batch, side, side, 0)  # every row's mask 1
    loops = {"text_to_image": (full, others, x * full.init_sigma),
             "img2img": (tail, Conditions((*others, img2img)), x * tail.sigmas[0].item()),
             "inpaint": (tail, Conditions((*others, inpaint)), x * tail.sigmas[0].item())}
    for sched, c, x0 in loops.values():  # first replays (checked against eager) and a warm-up loop each
        engine.sample(x0, sched, None, cond, c, guidance)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(repeats):
        for name, (sched, c, x0) in loops.items():
            times[name].append(_loop_s(engine, x0, sched, cond, c, guidance, None) / sched.steps)
    ms = {name: statistics.median(t) * 1000 / batch for name, t in times.items()}
    rec = {"shape": shape.label, "steps": steps, "strength": STRENGTH, "tail_steps": tail.steps, "repeats": repeats,
           "engine": engine.name, "compile": compile, "ms_per_image_step": ms,
           "ratio_vs_text_to_image": {name: m / ms["text_to_image"] for name, m in ms.items()},
           "graphs": engine.describe()}
    log("source steps at " + shape.label + ": " + ", ".join(
        f"{n} {m:.2f} ms/image-step ({rec['ratio_vs_text_to_image'][n]:.3f}x)" for n, m in ms.items()))
    return rec
