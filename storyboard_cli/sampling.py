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

from storyboard_cli.samplers import SAMPLERS

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


def euler_coeffs(sigma: float, sigma_next: float) -> tuple[float, float]:
    # x + (x - denoised) / sigma * (sigma_next - sigma), regrouped
    return sigma_next / sigma, 1.0 - sigma_next / sigma


def ancestral_split(sigma: float, sigma_next: float) -> tuple[float, float]:
    """(sigma_down, sigma_up) with eta = 1, as k-diffusion's get_ancestral_step."""
    up = math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
    return math.sqrt(sigma_next**2 - up**2), up


def dpmpp_2m_coeffs(sigma_prev: float | None, sigma: float, sigma_next: float) -> tuple[float, float, float]:
    """DPM-Solver++(2M), as k-diffusion's sample_dpmpp_2m: first order on the first and the last step."""
    if sigma_next == 0:
        return 0.0, 1.0, 0.0
    h = math.log(sigma / sigma_next)  # lambda = -log(sigma)
    phi = -math.expm1(-h)
    if sigma_prev is None:
        return sigma_next / sigma, phi, 0.0
    r = math.log(sigma_prev / sigma) / h
    return sigma_next / sigma, phi * (1 + 1 / (2 * r)), -phi / (2 * r)


def schedule(sampler: str, steps: int, scheduler_config: dict) -> Schedule:
    sched, sigmas, timesteps = _diffusers_schedule(sampler, steps, scheduler_config)
    rows = []
    for i in range(steps):
        s, sn = sigmas[i].item(), sigmas[i + 1].item()
        if sampler == "euler":
            a, b = euler_coeffs(s, sn)
            rows.append((s, timesteps[i].item(), a, b, 0.0, 0.0))
        elif sampler == "euler_a":
            down, up = ancestral_split(s, sn)
            a, b = euler_coeffs(s, down)
            rows.append((s, timesteps[i].item(), a, b, 0.0, up))
        else:
            a, b, c = dpmpp_2m_coeffs(sigmas[i - 1].item() if i else None, s, sn)
            rows.append((s, timesteps[i].item(), a, b, c, 0.0))
    s0 = sigmas[0].item()
    # diffusers' Euler schedulers scale the first noise by init_noise_sigma; DPM-Solver works in the
    # variance-preserving form, whose unit noise is sqrt(1 + sigma^2) in the form we use
    init = float(sched.init_noise_sigma) if sampler != "dpmpp_2m" else math.sqrt(1 + s0**2)
    return Schedule(sampler, sigmas, torch.tensor(rows, dtype=torch.float32), init)


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
    first, later = [], []
    for seed in seeds:
        g = torch.Generator("cpu").manual_seed(seed)
        first.append(torch.randn((1, *shape), generator=g) * sched.init_sigma)
        if sched.ancestral:
            later.append(torch.stack([torch.randn((1, *shape), generator=g) for _ in range(steps)]))
    x = torch.cat(first)
    return x, (torch.cat(later, dim=1) if later else None)
