"""A graph's first replay checked against the eager step on the same inputs: the one test that a captured graph (its
variant's kernels, the static buffers it reads) computes the step. The limit is the variant's (engine/variants.py).

The check is in two halves, so that its eager reference is off the loop's critical path: `first_replay` replays the
graph once on the check's inputs and keeps what it wrote, then starts the eager step on the same inputs (on a CUDA
device: from a thread of its own, on a side stream, beside the batch's loop; the eager step is host-bound at a few
rows, 0.18-0.21 s of launches against 29-46 ms of GPU work at 1-2 images); `Check.result` compares the two once the
loop has been queued. A graph that fails its check has its loop's latents thrown away (the runner's `sample`)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from storyboard_cli.engine.conditioning import Cond
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.eager import sample_step
from storyboard_cli.engine.graph.buffers import Buffers
from storyboard_cli.engine.graph.keys import ShapeKey
from storyboard_cli.engine.sampling import Schedule
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.models.loader import SdxlModels


class Referee:
    """Where the eager references run: on a CUDA device, one thread of its own and a side stream (the warm-ups'), so
    the references' launches overlap the loop's replays (a replay releases the GIL) and their comparison waits for
    the check's replay alone, not for the loop; elsewhere, in place."""

    def __init__(self, device: torch.device, stream: Callable[[], torch.cuda.Stream]):
        self.device, self.stream = device, stream
        self.pool: ThreadPoolExecutor | None = None

    def start(self, work: Callable[[], tuple[float, str]]) -> Future:
        if self.device.type != "cuda":
            done: Future = Future()
            done.set_result(work())
            return done
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="bcg-check")
        side = self.stream()
        side.wait_stream(torch.cuda.current_stream())  # the check's inputs and its replay's outputs come first
        index = torch.cuda.current_device() if self.device.index is None else self.device.index

        def run() -> tuple[float, str]:
            torch.cuda.set_device(index)  # the current device is the thread's own (`cuda` names no index)
            with torch.no_grad(), torch.cuda.stream(side):  # grad mode is the thread's own too
                return work()

        return self.pool.submit(run)


@dataclass(frozen=True)
class Check:
    """One graph's first replay being checked: `result()`, (relative error, why it fails or ""), waits for it."""

    key: ShapeKey
    outcome: Future

    def result(self) -> tuple[float, str]:
        return self.outcome.result()


def compare(key: ShapeKey, got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, str]:
    err = 0.0
    for g, w in zip(got, want):
        finite = torch.isfinite(w)
        if not torch.equal(finite, torch.isfinite(g)):
            return float("nan"), "NaN/inf pattern differs from eager"
        diff = torch.linalg.vector_norm((g - w)[finite], dtype=torch.float32)
        scale = torch.linalg.vector_norm(w[finite], dtype=torch.float32).clamp_min(1e-6)
        err = max(err, (diff / scale).item())
    limit = VARIANTS[key.variant].check_rtol
    return err, f"relative error {err:.2e} > {limit:.0e}" if err > limit else ""


def first_replay(models: SdxlModels, buf: Buffers, key: ShapeKey, replay: Callable[[], None], referee: Referee,
                 x: torch.Tensor, sched: Schedule, cond: Cond, conds: Conditions, guidance: torch.Tensor) -> Check:
    """One replay of `key`'s graph on the batch's inputs, against the eager step (made and compared by `referee`), in
    the next latents and in the prediction (the denoised latents: at the check's first, noisiest step the UNet's
    output dominates them, where the next latents move by a fraction of it). The caller reloads the buffers after. At
    guidance 1: CFG multiplies the difference of two fp16 kernel orders (compiled against plain) by up to 2g - 1 where
    the conditional and unconditional predictions are close; the check is there to catch broken kernels, and the
    guidance arithmetic is the same code in both."""
    guidance = torch.ones_like(guidance)
    v = buf.view(key)
    conds = conds.like(v.conds)  # the kinds the graph runs (a step after the ControlNet's end: not that one)
    v.load(buf, x, sched, cond, conds, guidance)
    # DeepCache: a shallow step reads the feature in the buffer (the eager step reads the same copy);
    # a full step's written feature is checked with its output
    feature = None if v.feature is None else v.feature.clone()
    replay()
    got = [v.x.clone(), v.prev.clone()]  # clones: the loop overwrites the static buffers
    rows = None
    if key.step.cache == "write":  # the feature each wrote (a conditional step: its half) is checked too
        rows = slice(None) if key.step.guided else slice(key.batch, None)
        got.append(v.feature[rows].clone())
    row = sched.table[0].to(x.device)

    def check() -> tuple[float, str]:
        expect, denoised = sample_step(models, x, torch.zeros_like(x), torch.zeros_like(x), row, cond, conds.at(0),
                                       guidance, None, key.step, feature, 0)
        return compare(key, got, [expect, denoised] + ([] if rows is None else [feature[rows]]))

    return Check(key, referee.start(check))
