"""A graph's first replay checked against a reference step on the same inputs: the one test that a captured graph (its
variant's kernels, the static buffers it reads) computes the step. The reference is the eager step, or (`direct`) the
graph's own step run outside the graph on the same buffers, where the runner has checked the same kernels against the
eager step at other rows (engine/graph/runner.py `_check`), or that step for the batch's first images alone
(`first_step_of_part`). The limit is the variant's (engine/variants.py)."""

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


def first_step_of_part(v: Views, replay: Callable[[], None], part: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                       noise: torch.Tensor | None, n: int) -> tuple[float, str]:
    """(relative error, why it fails or "") of a graph's first replay where it is the batch's first step (the batch
    loaded in `v`), against `part`: the graph's step for the batch's first `n` images alone, outside the graph (the
    kernels the runner checked against the eager step at other rows, at fewer rows: (next latents, prediction)). The
    replay's first `n` images are compared, and the other images' latents must be finite: a capture that breaks the
    static buffers, the pool or the launch order breaks the first images' rows too. It costs a step of `n` images where
    `first_step` costs one of the batch, and nothing is loaded again: the buffers keep the replay's step. The two sides
    run the kernels at different rows, which may round apart: the limit is the variant's `alone_rtol`, far above
    that."""
    if noise is not None:
        v.noise.copy_(noise)
    replay()
    x_next, denoised = part()
    if not torch.isfinite(v.x[n:]).all():
        return float("nan"), "NaN/inf in the latents of the batch's other images"
    return _compare(v.key, [(v.x[:n], x_next), (v.prev[:n], denoised)], VARIANTS[v.key.variant].alone_rtol)


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
