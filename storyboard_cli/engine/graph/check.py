"""A graph's first replay checked against a reference step on the same inputs: the one test that a captured graph (its
variant's kernels, the static buffers it reads) computes the step. The reference is the eager step, or (`direct`) the
graph's own step run outside the graph on the same buffers, where the runner has checked the same kernels against the
eager step at other rows (engine/graph/runner.py `_check`); where that replay is a batch's first step, that step for
the batch's first images alone (or the whole batch), compared beside the batch's loop (`FirstStep`). The limit is the
variant's (engine/variants.py)."""

from __future__ import annotations

from typing import Callable

import torch

from storyboard_cli.engine.conditioning import Cond
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.eager import sample_step
from storyboard_cli.engine.graph.buffers import Buffers, Views
from storyboard_cli.engine.graph.keys import ShapeKey
from storyboard_cli.engine.sampling import Schedule
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.models.loader import SdxlModels


def first_replay(models: SdxlModels, buf: Buffers, key: ShapeKey, replay: Callable[[], None], x: torch.Tensor,
                 sched: Schedule, cond: Cond, conds: Conditions, guidance: torch.Tensor,
                 direct: Callable[[Views], None] | None = None) -> tuple[float, str]:
    """(relative error, why it fails or "") of one replay of `key`'s graph against the eager step (or `direct`: the
    graph's step run on the buffers outside the graph), in the next latents and in the prediction (the denoised
    latents: at the check's first, noisiest step the UNet's output dominates them, where the next latents move by a
    fraction of it). The caller reloads the buffers after. At guidance 1: CFG multiplies the difference of two fp16
    kernel orders (compiled against plain) by up to 2g - 1 where the conditional and unconditional predictions are
    close; the check is there to catch broken kernels, and the guidance arithmetic is the same code in both."""
    guidance = torch.ones_like(guidance)
    v = buf.view(key)
    conds = conds.like(v.conds)  # the kinds the graph runs (a step after the ControlNet's end: not that one)
    v.load(buf, x, sched, cond, conds, guidance)
    # DeepCache: a shallow step reads the feature in the buffer (the reference reads the same copy);
    # a full step's written feature is checked with its output
    feature = None if v.feature is None else v.feature.clone()
    replay()
    # clones: the next replay overwrites the static buffers
    got = [v.x.clone(), v.prev.clone(), None if feature is None else v.feature.clone()]
    if direct is None:
        row = sched.table[0].to(x.device)
        want = [*sample_step(models, x, torch.zeros_like(x), torch.zeros_like(x), row, cond, conds.at(0), guidance,
                             None, key.step, feature, 0), feature]
    else:  # the same inputs in the same buffers (a compiled artifact reads them with the strides it was built for)
        v.load(buf, x, sched, cond, conds, guidance)
        if feature is not None:
            v.feature.copy_(feature)
        direct(v)
        want = [v.x, v.prev, v.feature]
    pairs = list(zip(got[:2], want[:2]))
    if key.step.cache == "write":  # the feature each wrote (a conditional step: its half) is checked too
        rows = slice(None) if key.step.guided else slice(key.batch, None)
        pairs.append((got[2][rows], want[2][rows]))
    return _compare(key, pairs)


class FirstStep:
    """A graph's first replay where it is the batch's first step, checked beside the batch's loop. Right after the
    replay its first `n` images' next latents and prediction are kept (copies queued behind it), with whether the other
    images' latents are finite (a capture that breaks the static buffers, the pool or the launch order breaks the first
    images' rows too). `compare` takes the reference, the graph's step for those `n` images alone outside the graph
    (the kernels the runner checked against the eager step at other rows: GraphRunner.part_step), and compares on the
    device into a few numbers copied to the host; `result` reads them once the GPU has got there (`ready`). So the
    loop's replays are queued while the reference's host-bound launches run, and no sync waits for them: the check costs
    the reference's GPU time, where a check before the loop also left the GPU idle for the reference's host time (50-230
    ms a batch, docs/PERFORMANCE.md). `n` is the batch: the same kernels at the same rows, the variant's check_rtol;
    fewer: its alone_rtol where it has one (the two sides run the kernels at other rows, which may round apart)."""

    def __init__(self, v: Views, n: int):
        self.key, self.n = v.key, n
        variant = VARIANTS[v.key.variant]
        self.limit = variant.alone_rtol if n < v.key.batch and variant.alone_rtol is not None else variant.check_rtol
        self.got = [v.x[:n].clone(), v.prev[:n].clone()]  # the next replay overwrites the static buffers
        self.others = torch.isfinite(v.x[n:]).all()
        self.values: torch.Tensor | None = None  # [error, NaN/inf pattern differs, another image not finite]
        self.event: torch.cuda.Event | None = None
        self.span: tuple | None = None  # the reference's (start, end) CUDA events, where its caller timed it

    def compare(self, want: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Queues the comparison with `want` (the reference's next latents and prediction) and the copy of its
        numbers to the host."""
        err, differs = _device_compare(list(zip(self.got, want)))
        values = torch.stack([err, differs.float(), (~self.others).float()])
        self.got = []
        if values.is_cuda:
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values

    @property
    def compared(self) -> bool:
        return self.values is not None

    def ready(self) -> bool:
        """Whether the comparison is queued and the GPU has run it (`result` does not wait)."""
        return self.compared and (self.event is None or self.event.query())

    def result(self) -> tuple[float, str]:
        """(relative error, why it fails or ""), as `_compare` gives them; waits for the GPU where it has not got
        there."""
        if self.event is not None:
            self.event.synchronize()
        err, differs, others = self.values.tolist()
        if others:
            return float("nan"), "NaN/inf in the latents of the batch's other images"
        if differs:
            return float("nan"), "NaN/inf pattern differs from eager"
        return err, f"relative error {err:.2e} > {self.limit:.0e}" if err > self.limit else ""


def _device_compare(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_compare`'s error (the largest relative error of `pairs` (got, want) where `want` is finite) and whether a
    pair's NaN/inf patterns differ, as device tensors: no sync."""
    err = differs = None
    for got, want in pairs:
        finite = torch.isfinite(want)
        apart = (finite != torch.isfinite(got)).any()
        diff = torch.linalg.vector_norm(torch.where(finite, got - want, 0), dtype=torch.float32)
        scale = torch.linalg.vector_norm(torch.where(finite, want, 0), dtype=torch.float32).clamp_min(1e-6)
        one = diff / scale
        err, differs = (one, apart) if err is None else (torch.maximum(err, one), differs | apart)
    return err, differs


def _compare(key: ShapeKey, pairs: list[tuple[torch.Tensor, torch.Tensor]],
             limit: float | None = None) -> tuple[float, str]:
    """The largest relative error of `pairs` (got, want), and why it fails `limit` (`key`'s variant's check_rtol where
    None) or ""."""
    err = 0.0
    for got, want in pairs:
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)):
            return float("nan"), "NaN/inf pattern differs from eager"
        diff = torch.linalg.vector_norm((got - want)[finite], dtype=torch.float32)
        scale = torch.linalg.vector_norm(want[finite], dtype=torch.float32).clamp_min(1e-6)
        err = max(err, (diff / scale).item())
    limit = VARIANTS[key.variant].check_rtol if limit is None else limit
    return err, f"relative error {err:.2e} > {limit:.0e}" if err > limit else ""
