"""A graph's first replay checked against a reference step on the same inputs: the one test that a captured graph (its
variant's kernels, the static buffers it reads) computes the step. The reference is the eager step, or (`direct`) the
graph's own step run outside the graph on the same buffers, where the runner has checked the same kernels against the
eager step at other rows (engine/graph/runner.py `_check`), or that step for the batch's first images alone on tensors
of their own (`FirstStep`, `first_step_of_part`), which can run beside the batch's later replays. The limit is the
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


def first_step(buf: Buffers, v: Views, replay: Callable[[], None], direct: Callable[[Views], None], x: torch.Tensor,
               sched: Schedule, noise: torch.Tensor | None, cond: Cond, conds: Conditions,
               guidance: torch.Tensor) -> tuple[float, str]:
    """(relative error, why it fails or "") of a graph's first replay where it is the batch's first step (the batch's
    inputs, guidance and noise loaded in `v`), against `direct`: the graph's step run outside the graph on the same
    inputs, the kernels the runner checked against the eager step at other rows. At the batch's own guidance: both
    sides run the same kernels, so CFG has no kernel order to amplify. Leaves the buffers as the replay left them
    (the next latents, the prediction, the step index at 1): the loop goes on from the second step, and the check
    costs one step, not a replay and a step beside the batch's 30."""
    if noise is not None:
        v.noise.copy_(noise)
    replay()
    got = [v.x.clone(), v.prev.clone()]
    v.load(buf, x, sched, cond, conds, guidance)
    if noise is not None:
        v.noise.copy_(noise)
    direct(v)
    result = _compare(v.key, list(zip(got, [v.x, v.prev])))
    v.x.copy_(got[0])  # the graph's own first step, as every later batch of the shape gets it
    v.prev.copy_(got[1])
    return result


class FirstStep:
    """A graph's first replay where it is the batch's first step (the batch loaded in `v`), with its check against
    the graph's step for the batch's first `n` images outside the graph (`against`) to come: the replay's first `n`
    images (next latents, prediction) are copied, and whether the other images' latents are finite is taken, on the
    device as the replay leaves them, so the loop's next replays may follow at once. The reference reads tensors of its
    own and the batch's text, guidance and kinds, which the loop leaves as they are: it can be queued between the
    loop's later replays, its host's work (launches, a library's setup at its rows) beside the GPU's, and its outcome
    read once the GPU has run it (`ran`, `result`). At other rows than the batch's the two sides round apart: `limit`
    is the row's `alone_rtol` there, its `check_rtol` for the whole batch."""

    def __init__(self, v: Views, replay: Callable[[], None], noise: torch.Tensor | None, n: int, limit: float):
        if noise is not None:
            v.noise.copy_(noise)
        replay()
        self.key, self.n, self.limit = v.key, n, limit
        # clones, queued behind the replay: the next replay overwrites the static buffers
        self.got = (v.x[:n].clone(), v.prev[:n].clone())
        # a capture that breaks the static buffers, the pool or the launch order breaks the first images' rows too
        self.others = torch.isfinite(v.x[n:]).all()
        self.measured: torch.Tensor | None = None
        self.end: torch.cuda.Event | None = None

    def against(self, part: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queues the reference (`part`: the graph's step for the first `n` images outside the graph: next latents,
        prediction) and the comparison, without a wait."""
        x_next, denoised = part()
        self.measured = _measure([(self.got[0], x_next), (self.got[1], denoised)])
        if self.measured.is_cuda:
            self.end = torch.cuda.Event()
            self.end.record()

    def ran(self) -> bool:
        """Whether the reference and the comparison were queued and the GPU has run them (`result` does not wait)."""
        return self.measured is not None and (self.end is None or self.end.query())

    def result(self) -> tuple[float, str]:
        """(relative error, why it fails or ""), after `against`; waits for the GPU where it has not run them."""
        if not bool(self.others):
            return float("nan"), "NaN/inf in the latents of the batch's other images"
        return _verdict(self.measured, self.key, self.limit)


def first_step_of_part(v: Views, replay: Callable[[], None], part: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                       noise: torch.Tensor | None, n: int) -> tuple[float, str]:
    """(relative error, why it fails or "") of a graph's first replay where it is the batch's first step (the batch
    loaded in `v`), against `part`: the graph's step for the batch's first `n` images alone, outside the graph (the
    kernels the runner checked against the eager step at other rows, at fewer rows: (next latents, prediction)), at
    once (`FirstStep` without the loop between). The replay's first `n` images are compared, and the other images'
    latents must be finite. It costs a step of `n` images where `first_step` costs one of the batch, and nothing is
    loaded again: the buffers keep the replay's step. The two sides run the kernels at different rows, which may round
    apart: the limit is the variant's `alone_rtol`, far above that."""
    check = FirstStep(v, replay, noise, n, VARIANTS[v.key.variant].alone_rtol)
    check.against(part)
    return check.result()


def _compare(key: ShapeKey, pairs: list[tuple[torch.Tensor, torch.Tensor]],
             limit: float | None = None) -> tuple[float, str]:
    """The largest relative error of `pairs` (got, want), and why it fails `limit` (`key`'s variant's check_rtol where
    None) or ""."""
    return _verdict(_measure(pairs), key, limit)


def _measure(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per pair (got, want), on the device and without a wait: 1 where got's NaN/inf pattern is want's (else 0), and
    got's relative L2 error over want's finite values (in float32)."""
    out = []
    for got, want in pairs:
        finite = torch.isfinite(want)
        out.append((finite == torch.isfinite(got)).all().float())
        diff = torch.linalg.vector_norm(torch.where(finite, got - want, 0), dtype=torch.float32)
        scale = torch.linalg.vector_norm(torch.where(finite, want, 0), dtype=torch.float32).clamp_min(1e-6)
        out.append(diff / scale)
    return torch.stack(out)


def _verdict(measured: torch.Tensor, key: ShapeKey, limit: float | None) -> tuple[float, str]:
    """`_measure`'s values read (a wait where the GPU has not made them): the largest relative error, and why it fails
    `limit` (`key`'s variant's check_rtol where None) or ""; a NaN/inf pattern that differs fails whatever the error."""
    values = measured.tolist()
    err = 0.0
    for same, rel in zip(values[::2], values[1::2]):
        if not same:
            return float("nan"), "NaN/inf pattern differs from eager"
        err = max(err, rel)
    limit = VARIANTS[key.variant].check_rtol if limit is None else limit
    return err, f"relative error {err:.2e} > {limit:.0e}" if err > limit else ""
