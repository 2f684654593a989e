"""Sigma schedules and samplers as pure functions over tensors (k-diffusion style).

Every sampler here is one linear update per step,

    x_next = a * x + b * denoised + c * denoised_prev + s * noise

with (a, b, c, s) computed on the host once per schedule. The eager loop and the captured
CUDA graph run the same update, reading the coefficients from a device table, so no host
value is baked into a graph and no host sync sits inside the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from storyboard_cli.samplers import SAMPLERS  # each sampler's coefficients live with its entry

# columns of Schedule.table
SIGMA, TIMESTEP, A, B, C, S = range(6)


@dataclass(frozen=True)
class Schedule:
    sampler: str
    sigmas: torch.Tensor  # [steps + 1] float64, ends in 0
    table: torch.Tensor  # [steps, 6] float32: sigma, timestep, a, b, c, s
    init_sigma: float  # initial noise = randn * init_sigma (VE form, as diffusers' Euler)

    @property
    def steps(self) -> int:
        return self.table.shape[0]

    @property
    def ancestral(self) -> bool:
        return bool((self.table[:, S] != 0).any())


def _diffusers_schedule(sampler: str, steps: int, scheduler_config: dict):
    """sigmas and timesteps exactly as diffusers' scheduler for this sampler computes them."""
    import diffusers

    sched = getattr(diffusers, SAMPLERS[sampler].scheduler).from_config(scheduler_config)
    sched.set_timesteps(steps, device="cpu")
    return sched, sched.sigmas.double(), sched.timesteps.double()


def schedule(sampler: str, steps: int, scheduler_config: dict, start: int = 0) -> Schedule:
    """The `steps`-step schedule, or its tail from step `start` (img2img: diffusers' `get_timesteps` and
    `set_begin_index`): the tail's first step is a multistep sampler's first, as diffusers' solver starts its
    `lower_order_nums` at the tail."""
    sched, sigmas, timesteps = _diffusers_schedule(sampler, steps, scheduler_config)
    spec = SAMPLERS[sampler]
    rows = []
    for i in range(start, steps):
        s, sn = sigmas[i].item(), sigmas[i + 1].item()
        rows.append((s, timesteps[i].item(), *spec.coefficients(sigmas[i - 1].item() if i > start else None, s, sn)))
    s0 = sigmas[0].item()
    unit = math.sqrt(1 + s0**2) if spec.variance_preserving else float(sched.init_noise_sigma)
    return Schedule(sampler, sigmas[start:], torch.tensor(rows, dtype=torch.float32), unit)


def update(x: torch.Tensor, denoised: torch.Tensor, denoised_prev: torch.Tensor, noise: torch.Tensor,
           row: torch.Tensor) -> torch.Tensor:
    """One sampler step. row: [6] (a Schedule.table row, on x's device)."""
    return row[A] * x + row[B] * denoised + row[C] * denoised_prev + row[S] * noise


def draw_noise(seeds: list[int], steps: int, shape: tuple[int, int, int], sched: Schedule
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Initial latents [B, 4, h, w] and, for ancestral samplers, per-step noise [steps, B, 4, h, w].

    Each image draws from its own CPU generator (seeded with its seed) in the order diffusers
    does, so an image does not depend on its batch, its bucket or the device.
    """
    return stack_noise([draw_image_noise(seed, steps, shape, sched) for seed in seeds])


def draw_image_noise(seed: int, steps: int, shape: tuple[int, int, int], sched: Schedule
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One image's part of `draw_noise`: its initial latents [1, 4, h, w] and its per-step noise [steps, 1, 4, h, w]
    (None for a sampler that is not ancestral). An 8-image batch's at 1024x1024 and 30 steps is about 0.2 s of one
    core's time (run/batch.py draws a batch's ahead, beside the loop before it)."""
    g = torch.Generator("cpu").manual_seed(seed)
    first = torch.randn((1, *shape), generator=g) * sched.init_sigma
    later = torch.stack([torch.randn((1, *shape), generator=g) for _ in range(steps)]) if sched.ancestral else None
    return first, later


def noise_key(seed: int, steps: int, shape: tuple[int, int, int], sched: Schedule) -> tuple:
    """What one image's `draw_image_noise` depends on."""
    return seed, steps, shape, sched.init_sigma, sched.ancestral


def stack_noise(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The images' `draw_image_noise` parts as a batch's (initial latents, per-step noise or None)."""
    later = [p[1] for p in parts]
    return torch.cat([p[0] for p in parts]), (torch.cat(later, dim=1) if later[0] is not None else None)
