"""The sampler registry: each sampler's name, its diffusers scheduler class, its A1111 label and its
step coefficients, in one table: adding a sampler is one entry. No torch here: job validation reads it,
and so do the PNG metadata and the bench; engine/sampling.py turns the coefficients into a device table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

MAX_STEPS = 200  # the longest schedule a job may ask for; the graphs' coefficient table has this many rows

# (sigma_prev or None on the first step, sigma, sigma_next) -> (a, b, c, s) of one step,
# x_next = a * x + b * denoised + c * denoised_prev + s * noise (sampling.update)
Coefficients = Callable[[float | None, float, float], tuple[float, float, float, float]]


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


def _euler(sigma_prev: float | None, sigma: float, sigma_next: float) -> tuple[float, float, float, float]:
    return (*euler_coeffs(sigma, sigma_next), 0.0, 0.0)


def _euler_ancestral(sigma_prev: float | None, sigma: float, sigma_next: float) -> tuple[float, float, float, float]:
    down, up = ancestral_split(sigma, sigma_next)
    return (*euler_coeffs(sigma, down), 0.0, up)


def _dpmpp_2m(sigma_prev: float | None, sigma: float, sigma_next: float) -> tuple[float, float, float, float]:
    return (*dpmpp_2m_coeffs(sigma_prev, sigma, sigma_next), 0.0)


@dataclass(frozen=True)
class Sampler:
    name: str  # as a job file spells it
    scheduler: str  # the diffusers scheduler class whose sigmas and timesteps it follows
    label: str  # as A1111 writes it in a PNG's `parameters`
    coefficients: Coefficients
    # DPM-Solver works in the variance-preserving form, whose unit noise is sqrt(1 + sigma^2) in the form we
    # use; diffusers' Euler schedulers scale the first noise by their init_noise_sigma
    variance_preserving: bool = False


SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("euler", "EulerDiscreteScheduler", "Euler", _euler),
    Sampler("euler_a", "EulerAncestralDiscreteScheduler", "Euler a", _euler_ancestral),
    Sampler("dpmpp_2m", "DPMSolverMultistepScheduler", "DPM++ 2M", _dpmpp_2m, variance_preserving=True),
)}
