"""The hires pass of a shot (`hires: {scale, strength, steps, upscaler}`, on a shot or in `defaults`): the frame
rendered at the shot's size is upscaled (`scale`, at most `MAX_HIRES_SIDE` px a side) and denoised again at the new
size over the tail of a `steps` schedule, as diffusers' img2img does: of S steps, the last `int(S * strength)` run.
What it is (`Hires`), its keys read and checked at file:line, shot and field (`read_hires`), the size it makes
(`hires_size`), its settings and A1111 fields. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storyboard_cli.job.values import Context, as_float, as_int, as_str, line_of, sub_mapping
from storyboard_cli.job.yaml_loader import short_repr
from storyboard_cli.samplers import MAX_STEPS

HIRES_KEYS = ("scale", "strength", "steps", "upscaler")
UPSCALERS = {"latent": "Latent", "lanczos": "Lanczos"}  # name -> A1111's `Hires upscaler` label
MAX_HIRES_SIDE = 2048
MAX_SCALE = 4.0
DEFAULT_STRENGTH = 0.5
DEFAULT_UPSCALER = "latent"


@dataclass(frozen=True, order=True)
class Hires:
    """A hires pass: `steps` is the schedule's length (None: the shot's steps), `strength` the tail of it that runs."""

    scale: float
    strength: float = DEFAULT_STRENGTH
    steps: int | None = None
    upscaler: str = DEFAULT_UPSCALER

    def schedule(self, shot_steps: int) -> int:
        return self.steps if self.steps is not None else shot_steps

    def steps_run(self, shot_steps: int) -> int:
        """The steps the pass runs: diffusers' img2img `get_timesteps`, `int(S * strength)` of S."""
        return min(int(self.schedule(shot_steps) * self.strength), self.schedule(shot_steps))

    def settings(self, width: int, height: int, shot_steps: int) -> dict:
        """What an image records of it (PNG chunk, manifest, fingerprint): its keys and the size it makes."""
        w, h = hires_size(width, height, self.scale)
        return {"scale": self.scale, "strength": self.strength, "steps": self.schedule(shot_steps),
                "upscaler": self.upscaler, "width": w, "height": h}


def hires_size(width: int, height: int, scale: float) -> tuple[int, int]:
    """The upscaled size, each side rounded down to a multiple of 8 (the latents' grid), as A1111 sizes its hires
    pass from `Hires upscale`."""
    return int(width * scale) // 8 * 8, int(height * scale) // 8 * 8


def a1111_fields(hires: dict) -> list[tuple[str, Any]]:
    """A hires pass in the A1111 infotext, from an image's settings: `Denoising strength`, `Hires upscale`, `Hires
    steps`, `Hires upscaler`, `Hires resize`."""
    return [("Denoising strength", hires.get("strength")), ("Hires upscale", hires.get("scale")),
            ("Hires steps", hires.get("steps")), ("Hires upscaler", UPSCALERS.get(hires.get("upscaler"), "Latent")),
            ("Hires resize", f"{hires.get('width')}x{hires.get('height')}")]


def read_hires(ctx: Context, raw: Any, line: int | None, shot_id: str, width: int, height: int,
               steps: int) -> Hires | None:
    """`hires: {scale, strength, steps, upscaler}`; `off`, `false` or nothing: none. The size it makes must fit
    `MAX_HIRES_SIDE`, and the pass must run a step."""
    raw = sub_mapping(ctx, raw, line, shot_id, "hires", HIRES_KEYS, "{scale: 1.5, strength: 0.35, steps: 12}",
                      "scale", "the upscale factor, e.g. 1.5")
    if raw is None:
        return None
    scale_line = line_of(raw, "scale")
    scale = as_float(ctx, raw["scale"], scale_line, shot_id, "hires.scale", 1.0, MAX_SCALE)
    w, h = hires_size(width, height, scale)
    if max(w, h) > MAX_HIRES_SIDE:
        raise ctx.fail(scale_line, shot_id, "hires.scale", f"{width}x{height} x {scale:g} is {w}x{h}: over "
                       f"{MAX_HIRES_SIDE} px a side")
    strength_line = line_of(raw, "strength", raw.line)
    strength = raw.get("strength", DEFAULT_STRENGTH)
    strength = as_float(ctx, strength, strength_line, shot_id, "hires.strength", 0.0, 1.0)
    if strength == 0:
        raise ctx.fail(strength_line, shot_id, "hires.strength", "must be in (0, 1], got 0 (nothing would change)")
    n = None
    if raw.get("steps") is not None:
        n = as_int(ctx, raw["steps"], line_of(raw, "steps"), shot_id, "hires.steps", 1, MAX_STEPS)
    upscaler = raw.get("upscaler", DEFAULT_UPSCALER)
    up_line = line_of(raw, "upscaler", raw.line)
    upscaler = as_str(ctx, upscaler, up_line, shot_id, "hires.upscaler", empty_ok=False)
    if upscaler not in UPSCALERS:
        raise ctx.fail(up_line, shot_id, "hires.upscaler", f"must be one of {', '.join(UPSCALERS)}, got "
                       f"{short_repr(upscaler)}")
    hires = Hires(scale, strength, n, upscaler)
    if hires.steps_run(steps) < 1:
        raise ctx.fail(strength_line, shot_id, "hires.strength", f"{strength:g} of {hires.schedule(steps)} steps "
                       f"runs no step (int(steps * strength) is 0): raise the strength or the steps")
    return hires
