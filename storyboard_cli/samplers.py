"""The sampler registry: each sampler's name, its diffusers scheduler class and its A1111 label, in one
table. No torch here: job validation reads it, and so do the PNG metadata and the bench."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STEPS = 200  # the longest schedule a job may ask for; the graphs' coefficient table has this many rows


@dataclass(frozen=True)
class Sampler:
    name: str  # as a job file spells it
    scheduler: str  # the diffusers scheduler class whose sigmas and timesteps it follows
    label: str  # as A1111 writes it in a PNG's `parameters`


SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("euler", "EulerDiscreteScheduler", "Euler"),
    Sampler("euler_a", "EulerAncestralDiscreteScheduler", "Euler a"),
    Sampler("dpmpp_2m", "DPMSolverMultistepScheduler", "DPM++ 2M"),
)}
