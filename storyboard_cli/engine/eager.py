"""The denoiser step: the conditioning kinds' inputs + UNet + classifier-free guidance, one function, plain PyTorch.

The graph engine captures exactly these functions; the eager engine calls them directly. The step names no
conditioning kind: each reaches it through its value (engine/conditions/kind.py Condition), as k-diffusion's samplers
pass `extra_args` through.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch

from storyboard_cli.engine.base import Shape, run_between
from storyboard_cli.engine.conditioning import Cond
from storyboard_cli.engine.conditions.control import embedding_apart
from storyboard_cli.engine.conditions.kind import Conditions, Step
from storyboard_cli.engine.deepcache import feature_shape, shallow_unet, writing_feature
from storyboard_cli.engine.sampling import SIGMA, TIMESTEP, Schedule, update
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.steps import FULL, StepKind, StepPlan

__all__ = ["EagerEngine", "StepCalls", "controlnet_call", "denoise", "new_feature", "sample_step", "unet_call"]


def unet_call(unet, latents, t, embeds, pooled, time_ids, mid, down, attention: dict | None = None) -> torch.Tensor:
    """The UNet as a function of tensors: latents [2B, 4, h, w], t [2B], embeds [2B, 77, C], pooled [2B, P],
    time_ids [2B, 6], residuals added to its blocks (mid, down: the ControlNets') or None, the attention processors'
    keyword arguments (`attention`: Conditions.attention, an IP-Adapter's tokens) or None -> eps [2B, 4, h, w] in the
    model dtype."""
    added = {"text_embeds": pooled, "time_ids": time_ids}
    return unet(latents, t, encoder_hidden_states=embeds, added_cond_kwargs=added, cross_attention_kwargs=attention,
                down_block_additional_residuals=down, mid_block_additional_residual=mid, return_dict=False)[0]


def controlnet_call(controlnet, latents, t, embeds, pooled, time_ids, image, scale) -> tuple[torch.Tensor, ...]:
    """The ControlNet as a function of tensors: image (its `controlnet_cond`), scale [2B, 1, 1, 1] -> (mid, *down).
    The step passes a net apart from its embedding (engine/conditions/control.py `embedding_apart`) and, for `image`,
    the guide [2B, C, H/8, W/8] its embedding made (`embed_guide`); a whole net takes the pixels [2B, 3, H, W]."""
    down, mid = controlnet(latents, t, encoder_hidden_states=embeds, controlnet_cond=image, conditioning_scale=scale,
                           added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)
    return (mid, *down)


@dataclass(eq=False)
class StepCalls:
    """The module calls inside the step: the one seam where compiled kernels replace the modules.

    unet(latents, t, embeds, pooled, time_ids, mid, down[, attention]) -> eps;
    controlnet(latents, t, embeds, pooled, time_ids, guide, scale) -> (mid, *down): the first ControlNet's,
    `others` the further nets' (a job's `controlnets:`), each taking its guide embedded (`embed_guide`).
    The default (`eager`) is `unet_call` / `controlnet_call` on the loaded modules (the nets apart from their
    embeddings)."""

    unet: Callable
    controlnet: Callable | None
    others: tuple[Callable, ...] = ()

    @classmethod
    def eager(cls, models: SdxlModels) -> StepCalls:
        nets = [partial(controlnet_call, embedding_apart(net)) for net in models.controlnets]
        return cls(partial(unet_call, models.unet), nets[0] if nets else None, tuple(nets[1:]))

    def net(self, i: int) -> Callable:
        return self.controlnet if i == 0 else self.others[i - 1]


def denoise(models: SdxlModels, x: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor, cond: Cond,
            conds: Conditions, guidance: torch.Tensor, calls: StepCalls | None = None, kind: StepKind = FULL,
            feature: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, 4, h, w] float32 (VE form), sigma/timestep [] -> denoised [B, 4, h, w] float32.

    A guided step doubles the batch inside the step (negative rows first, as diffusers does); a step of the
    conditional rows alone (`kind.guided` False) runs the second half of `cond` and `conds` and no combine,
    as diffusers does once guidance is off. `conds`: this step's values of the batch's conditioning kinds (their
    attention inputs reach every UNet call, their residuals a whole UNet's). `feature` [2B, C, h', w']: DeepCache's
    cache (engine/deepcache.py), written by a "write" step and read by a "read" step (a conditional step uses its
    second half).
    """
    calls = calls or StepCalls.eager(models)
    b = x.shape[0]
    c_in = torch.rsqrt(sigma * sigma + 1)  # as diffusers' EulerDiscreteScheduler.scale_model_input
    latents = (x * c_in).to(models.dtype)
    if kind.guided:
        latents = latents.repeat(2, 1, 1, 1)  # [2B, 4, h, w]
    else:
        cond, conds = cond.half(b), conds.half(b)
        if feature is not None:
            feature = feature[b:]
    attention = conds.attention()
    t = timestep.expand(latents.shape[0])
    if kind.cache == "read":
        eps = shallow_unet(models.unet, latents, t, cond.embeds, cond.pooled, cond.time_ids, feature, kind.branch,
                           attention).float()
    else:
        mid, down = conds.residuals(Step(calls, kind, latents, t, cond.embeds, cond.pooled, cond.time_ids))
        with writing_feature(models.unet, kind.branch, feature) if kind.cache == "write" else nullcontext():
            eps = calls.unet(latents, t, cond.embeds, cond.pooled, cond.time_ids, mid, down, attention).float()
    if not kind.guided:
        return x - sigma * eps
    eps_neg, eps_pos = eps.chunk(2)
    eps = eps_neg + guidance.view(-1, 1, 1, 1) * (eps_pos - eps_neg)
    return x - sigma * eps


def new_feature(models: SdxlModels, x: torch.Tensor, plan: StepPlan | None) -> torch.Tensor | None:
    """DeepCache's cache for one batch of latents x [B, 4, h, w] (None when the plan does not cache)."""
    branch = next((k.branch for k in plan or () if k.cache), None)
    if branch is None:
        return None
    b, _, h, w = x.shape
    return torch.zeros(feature_shape(models.unet, 2 * b, h, w, branch), device=x.device, dtype=models.dtype)


def sample_step(models: SdxlModels, x: torch.Tensor, denoised_prev: torch.Tensor, noise: torch.Tensor,
                row: torch.Tensor, cond: Cond, conds: Conditions, guidance: torch.Tensor,
                calls: StepCalls | None = None, kind: StepKind = FULL, feature: torch.Tensor | None = None,
                index: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole step: denoise, the sampler update, then the kinds' hooks after it (Conditions.after_step). Returns
    (x_next, denoised). `conds`: this step's (Conditions.at); `index`: the step's number (an int, or the graph's step
    counter [1] on the device)."""
    denoised = denoise(models, x, row[SIGMA], row[TIMESTEP], cond, conds, guidance, calls, kind, feature)
    return conds.after_step(x, update(x, denoised, denoised_prev, noise, row), denoised, index), denoised


class EagerEngine:
    """Runs the loop in plain PyTorch, one launch per kernel. Works on any device: it can run every shape,
    prepares nothing and holds nothing to release but the allocator's cache."""

    name = "eager"

    def __init__(self, models: SdxlModels):
        self.models = models

    @torch.no_grad()
    def sample(self, x: torch.Tensor, sched: Schedule, noise: torch.Tensor | None, cond: Cond,
               conds: Conditions | None, guidance: torch.Tensor, plan: StepPlan | None = None,
               between: Iterator[Callable[[], object]] | None = None) -> torch.Tensor:
        """x [B, 4, h, w] initial latents on the device -> final latents [B, 4, h, w] float32. `plan`: each
        step's kind (steps.step_plan); None: every step guided, the UNet whole (FULL). `between`: engine/base.py."""
        table = sched.table.to(x.device)
        prev = torch.zeros_like(x)
        zero = torch.zeros_like(x)
        feature = new_feature(self.models, x, plan)
        conds = conds or Conditions()
        calls = StepCalls.eager(self.models)  # once per loop, not per step (the nets apart from their embeddings)
        for i in range(sched.steps):
            x, prev = sample_step(self.models, x, prev, zero if noise is None else noise[i], table[i], cond,
                                  conds.at(i), guidance, calls, plan[i] if plan else FULL, feature, i)
            between = run_between(between)
        run_between(between, everything=True)
        return x

    def prepare(self, shapes: list[Shape], kinds: dict[Shape, set[StepKind]] | None = None,
                later: list[Shape] = (), beside: bool = False) -> None:
        pass

    def ahead(self, shape: Shape, kinds: set[StepKind], spare: bool = False) -> Iterator[Callable[[], object]] | None:
        return None

    def release(self) -> None:
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    def can_run(self, shape: Shape) -> bool:
        return True

    def describe(self) -> list[dict]:
        return []
