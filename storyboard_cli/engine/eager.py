"""The denoiser step: ControlNet + UNet + classifier-free guidance, one function, plain PyTorch.

The graph engine captures exactly these functions; the eager engine calls them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from storyboard_cli.conditioning import Cond
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.sampling import SIGMA, TIMESTEP, Schedule, update


@dataclass
class Control:
    image: torch.Tensor  # [2B, 3, H, W] in [0, 1], negative rows first
    scale: torch.Tensor  # [2B, 1, 1, 1]


def denoise(models: SdxlModels, x: torch.Tensor, sigma: torch.Tensor, timestep: torch.Tensor, cond: Cond,
            control: Control | None, guidance: torch.Tensor) -> torch.Tensor:
    """x [B, 4, h, w] float32 (VE form), sigma/timestep [] -> denoised [B, 4, h, w] float32.

    CFG doubles the batch inside the step (negative rows first, as diffusers does).
    """
    rows = 2 * x.shape[0]
    c_in = torch.rsqrt(sigma * sigma + 1)  # as diffusers' EulerDiscreteScheduler.scale_model_input
    latents = (x * c_in).to(models.dtype).repeat(2, 1, 1, 1)  # [2B, 4, h, w]
    t = timestep.expand(rows)
    added = {"text_embeds": cond.pooled, "time_ids": cond.time_ids}
    down = mid = None
    if control is not None:
        down, mid = models.controlnet(latents, t, encoder_hidden_states=cond.embeds, controlnet_cond=control.image,
                                      conditioning_scale=control.scale, added_cond_kwargs=added, return_dict=False)
    eps = models.unet(latents, t, encoder_hidden_states=cond.embeds, added_cond_kwargs=added,
                      down_block_additional_residuals=down, mid_block_additional_residual=mid,
                      return_dict=False)[0].float()
    eps_neg, eps_pos = eps.chunk(2)
    eps = eps_neg + guidance.view(-1, 1, 1, 1) * (eps_pos - eps_neg)
    return x - sigma * eps


def sample_step(models: SdxlModels, x: torch.Tensor, denoised_prev: torch.Tensor, noise: torch.Tensor,
                row: torch.Tensor, cond: Cond, control: Control | None, guidance: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole step: denoise, then the sampler update. Returns (x_next, denoised)."""
    denoised = denoise(models, x, row[SIGMA], row[TIMESTEP], cond, control, guidance)
    return update(x, denoised, denoised_prev, noise, row), denoised


class EagerEngine:
    """Runs the loop in plain PyTorch, one launch per kernel. Works on any device."""

    name = "eager"

    def __init__(self, models: SdxlModels):
        self.models = models

    @torch.no_grad()
    def sample(self, x: torch.Tensor, sched: Schedule, noise: torch.Tensor | None, cond: Cond,
               control: Control | None, guidance: torch.Tensor) -> torch.Tensor:
        """x [B, 4, h, w] initial latents on the device -> final latents [B, 4, h, w] float32."""
        table = sched.table.to(x.device)
        prev = torch.zeros_like(x)
        zero = torch.zeros_like(x)
        for i in range(sched.steps):
            x, prev = sample_step(self.models, x, prev, zero if noise is None else noise[i], table[i], cond,
                                  control, guidance)
        return x

    def describe(self) -> list[dict]:
        return []
