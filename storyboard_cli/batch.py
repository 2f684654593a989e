"""BatchRunner: one batch of work items -> latents -> pixels. Compute only: no files, no policy.

Owns what the batches of one job share: sigma schedules, the prompt cache, the control images (a
bounded cache), the engine it denoises with and the eager engine it falls back to when told.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from storyboard_cli.conditioning import Control, PromptCache, conditioning, control, load_control_image
from storyboard_cli.engine.base import Engine, Shape
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.plan import Batch, WorkItem
from storyboard_cli.report import Timings
from storyboard_cli.sampling import Schedule, draw_noise, schedule

CONTROL_CACHE = 32  # control images kept decoded (a 1024x1024 one is 12 MB as float32)


def batch_shapes(batches: list[Batch]) -> list[Shape]:
    """The shape of each batch's denoising loop: what an engine prepares (a graph is captured) for."""
    return [Shape(b.size, b.key.height, b.key.width, b.key.control) for b in batches]


def bucket_label(batch: Batch) -> str:
    return f"{batch.size} x {batch.key.label}"


@torch.no_grad()
def decode(models: SdxlModels, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 4, h, w] latents -> (float pixels [B, 3, H, W] in [0, 1] on the device, uint8 [B, H, W, 3] on
    the CPU), as diffusers' VAE decode + postprocess."""
    z = (latents / models.vae.config.scaling_factor).to(models.vae_dtype)
    images = []
    for chunk in z.split(4):  # bounds the VAE's activation memory at large sizes
        images.append(models.vae.decode(chunk, return_dict=False)[0].float())
    image = (torch.cat(images) / 2 + 0.5).clamp(0, 1)
    return image, (image * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


@dataclass
class Decoded:
    item: WorkItem
    pixels: torch.Tensor | None  # uint8 [H, W, 3] on the CPU; None when the image failed
    failure: str = ""


class BatchRunner:
    def __init__(self, models: SdxlModels, engine: Engine, timings: Timings | None = None):
        self.models, self.engine = models, engine
        self.fallback: Engine = EagerEngine(models)  # for the out-of-memory policy's last retry
        self.timings = timings or Timings()
        self.prompts = PromptCache(models)
        self.schedules: dict[tuple[str, int], Schedule] = {}
        self.controls: OrderedDict[tuple[Path, int, int], torch.Tensor] = OrderedDict()

    def schedule(self, sampler: str, steps: int) -> Schedule:
        key = (sampler, steps)
        if key not in self.schedules:
            self.schedules[key] = schedule(sampler, steps, self.models.scheduler_config)
        return self.schedules[key]

    def control_image(self, path: Path, width: int, height: int) -> torch.Tensor:
        key = (path, width, height)
        if key not in self.controls:
            self.controls[key] = load_control_image(path, width, height)
            if len(self.controls) > CONTROL_CACHE:
                self.controls.popitem(last=False)
        self.controls.move_to_end(key)
        return self.controls[key]

    def control(self, items: list[WorkItem]) -> Control | None:
        if items[0].control_image is None:
            return None
        images = torch.stack([self.control_image(it.control_image, it.width, it.height) for it in items])
        return control(images, [it.control_scale for it in items], self.models.device, self.models.dtype)

    def run_batch(self, batch: Batch, fallback: bool = False) -> list[tuple[WorkItem, torch.Tensor]]:
        """Denoises one batch (on the fallback engine if told); returns (item, latents [4, h, w]) for its
        real rows."""
        m, key = self.models, batch.key
        rows = list(batch.items) + [batch.items[-1]] * batch.padding  # a padded row copies a real row
        sched = self.schedule(key.sampler, key.steps)
        with self.timings.stage("encode"):
            cond = conditioning(self.prompts, [r.prompt for r in rows], [r.negative for r in rows],
                                key.width, key.height)
            ctl = self.control(rows)
            x, noise = draw_noise([r.seed for r in rows], key.steps, (4, key.height // 8, key.width // 8), sched)
            x = x.to(m.device)
            noise = None if noise is None else noise.to(m.device)
            guidance = torch.tensor([r.guidance for r in rows], device=m.device, dtype=torch.float32)
        engine = self.fallback if fallback else self.engine
        t0 = time.perf_counter()
        with self.timings.stage("denoise"):
            latents = engine.sample(x, sched, noise, cond, ctl, guidance)
        bt = self.timings.bucket(bucket_label(batch))
        bt.batches += 1
        bt.rows += 2 * batch.size
        bt.steps += key.steps
        bt.denoise_s += time.perf_counter() - t0
        return list(zip(batch.items, latents[: len(batch.items)]))

    def decode(self, done: list[tuple[WorkItem, torch.Tensor]]) -> list[Decoded]:
        """Latents -> PNG-ready pixels; an image with NaN/inf in its latents or pixels is a failure."""
        with self.timings.stage("decode"):
            latents = torch.stack([lat for _, lat in done])
            finite_latents = torch.isfinite(latents).flatten(1).all(1)
            pixels_f, pixels = decode(self.models, latents)
            finite_pixels = torch.isfinite(pixels_f).flatten(1).all(1).cpu()
            finite_latents = finite_latents.cpu()
        out = []
        for i, (item, _) in enumerate(done):
            if not finite_latents[i]:
                out.append(Decoded(item, None, "NaN/inf in the denoised latents"))
            elif not finite_pixels[i]:
                out.append(Decoded(item, None, "NaN/inf in the decoded pixels"))
            else:
                out.append(Decoded(item, pixels[i]))
        return out

    def release(self) -> None:
        """After an out-of-memory: the engine gives back what it holds for speed."""
        self.engine.release()
