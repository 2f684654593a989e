"""The `source` kind on the engine side: img2img and inpainting on the base UNet, as diffusers'
StableDiffusionXLImg2ImgPipeline and StableDiffusionXLInpaintPipeline (4-channel UNet) run them.

A batch's rows share the schedule's tail (the bucket key's `init_skip`: the batch runner builds the schedule from that
step, engine/sampling.py `schedule(..., start)`, so no replay is spent on a skipped step). `begin` gives each row its
first latents: a source's, noised to the tail's first sigma (`add_noise`); pure noise for a plain row and for an
inpainting at strength 1 (as diffusers' `is_strength_max`). After every sampler update (`after_step`) a row's latents
outside its mask are the source's noised to the next sigma with the row's one fixed noise (the inpainting pipeline's
`init_latents_proper` blend); a row without a mask has mask 1 and keeps its update exactly, so rows with and without
masks, with and without a source, share a batch and a graph. The source's latents, the noise, the mask and the
tail's next sigmas live in static buffers. A source is VAE-encoded once per job (the reader's cache), its sample drawn
from a generator seeded by its own digest: an image's refinement is the same in any batch. The job half is
job/conditions/source.py (the same name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from storyboard_cli.engine.conditioning import BoundedCache
from storyboard_cli.engine.conditions.kind import DECODE_ERRORS, Kind, Pair, Plain, Unreadable
from storyboard_cli.engine.sampling import schedule
from storyboard_cli.samplers import MAX_STEPS

NAME = "source"
# the names that are this kind's alone: the WorkItem's and BucketKey's fields it reads, its tensors'
FIELDS = ("init", "mask", "init_skip", "source_latents", "source_noise", "source_mask", "next_sigma")
CACHE_BYTES = 512 << 20  # encoded sources and masks kept (a 1024x1024 source's latents are 256 kB)


@dataclass(frozen=True)
class Blend(Plain):
    """A batch's sources, per image (not CFG-doubled: the blend is on the sampler's latents)."""

    source_latents: torch.Tensor  # [B, 4, h, w] float32: each row's source (0 for a row without one)
    source_noise: torch.Tensor  # [B, 4, h, w] float32: each row's noise, the first draw of its seed (unscaled)
    source_mask: torch.Tensor  # [B, 1, h, w] float32: 1 where the row repaints (everywhere without a mask)
    next_sigma: torch.Tensor  # [steps] float32: the sigma after each step of the tail (at(): the step's, [1])
    first: torch.Tensor | None = None  # [B, 4, h, w]: each row's first latents (None on a graph's views)
    fresh: torch.Tensor | None = None  # [B, 1, 1, 1] bool: rows that start from the initial noise as drawn
    kind: str = NAME

    def half(self, b: int) -> Blend:
        return self  # per image already

    def first_images(self, n: int, b: int) -> Blend:
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:n].clone()

        return Blend(rows(self.source_latents), rows(self.source_noise), rows(self.source_mask), self.next_sigma,
                     rows(self.first), rows(self.fresh))

    def at(self, index: int | torch.Tensor) -> Blend:
        sigma = self.next_sigma[index:index + 1] if isinstance(index, int) else self.next_sigma.index_select(0, index)
        return Blend(self.source_latents, self.source_noise, self.source_mask, sigma)

    def after_step(self, x, x_next, denoised, index):
        """As the inpainting pipeline's 4-channel loop: `(1 - mask) * add_noise(source, noise, t_next) + mask *
        latents` (the source itself after the last step: its next sigma is 0)."""
        proper = self.source_latents + self.source_noise * self.next_sigma.view(-1, 1, 1, 1)
        return (1 - self.source_mask) * proper + self.source_mask * x_next

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.first is None else torch.where(self.fresh, x, self.first)

    def pairs(self, value: Blend) -> list[Pair]:
        n = value.next_sigma.shape[0]
        return [(self.source_latents, value.source_latents), (self.source_noise, value.source_noise),
                (self.source_mask, value.source_mask), (self.next_sigma[:n], value.next_sigma)]

    def idle(self) -> list[Pair]:
        """A batch without sources on a graph that blends: every row repaints everywhere (its update kept)."""
        return [(self.source_mask, torch.ones_like(self.source_mask))]


def encode(models: Any, pixels: torch.Tensor, seed: int) -> torch.Tensor:
    """pixels [1, 3, H, W] in [-1, 1] -> the VAE's latents [1, 4, h, w] float32, scaled, its sample drawn from a CPU
    generator seeded with `seed` (as diffusers' `retrieve_latents(..., generator)`)."""
    vae = models.vae
    dist = vae.encode(pixels.to(models.device, models.vae_dtype)).latent_dist
    eps = torch.randn(dist.mean.shape, generator=torch.Generator("cpu").manual_seed(seed)).to(models.device)
    return ((dist.mean.float() + dist.std.float() * eps) * vae.config.scaling_factor).float()


def processors():
    """diffusers' image and mask processors, as the inpainting pipeline makes them."""
    from diffusers.image_processor import VaeImageProcessor

    return (VaeImageProcessor(vae_scale_factor=8),
            VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True, do_convert_grayscale=True))


def mode_of(item: Any) -> str:
    """How the source (and its mask) become the shot's size: diffusers' "fill" for a cropped inpainting (its crop is
    grown to the shot's aspect), else the init's own mode."""
    return "fill" if item.mask is not None and item.mask.padding is not None else item.init.resize_mode


class Reader:
    """The sources of one job's batches: each source (crop, size) encoded and each mask made once, kept in a bounded
    cache; the schedules' tails, for the noise levels."""

    def __init__(self, models: Any):
        self.models = models
        self.cache = BoundedCache(CACHE_BYTES)
        self.images, self.masks = processors()
        self.sigmas: dict[tuple[str, int, int], torch.Tensor] = {}

    def latents(self, item: Any) -> torch.Tensor:
        """The item's source, cropped and resized to its size as diffusers preprocesses it, encoded: [1, 4, h, w]."""
        i, crop = item.init, item.mask.crop if item.mask is not None else None
        key = ("source", i.sha256, crop, mode_of(item), item.width, item.height)
        found = self.cache.lookup(key)
        if found is None:
            from PIL import Image

            with Image.open(i.image) as im:
                image = im.convert("RGB")
            latent = mode_of(item) == "latent"  # encoded at its own size, its latents resized (A1111's "Latent")
            height, width = (i.height, i.width) if latent else (item.height, item.width)
            pixels = self.images.preprocess(image, height=height, width=width, crops_coords=crop,
                                            resize_mode="default" if latent else mode_of(item))
            with torch.no_grad():
                z = encode(self.models, pixels, int(i.sha256[:15], 16))
                if latent:  # as A1111's hires fix: F.interpolate(..., mode="bilinear", antialias=False)
                    z = torch.nn.functional.interpolate(z, size=(item.height // 8, item.width // 8), mode="bilinear",
                                                        align_corners=False)
                found = self.cache.put(key, z)
        return found

    def mask(self, item: Any) -> torch.Tensor:
        """The item's mask binarised at its size, then at the latents' (nearest, as the pipeline's
        prepare_mask_latents): [1, 1, h, w]; ones without a mask."""
        h, w = item.height // 8, item.width // 8
        if item.mask is None:
            return torch.ones(1, 1, h, w, device=self.models.device)
        m = item.mask
        mode = "default" if mode_of(item) == "latent" else mode_of(item)  # a mask is resized as pixels
        key = ("mask", m, item.init.width, item.init.height, mode, item.width, item.height)
        found = self.cache.lookup(key)
        if found is None:
            full = self.masks.preprocess(m.pil((item.init.width, item.init.height)), height=item.height,
                                         width=item.width, resize_mode=mode, crops_coords=m.crop)
            found = self.cache.put(key, torch.nn.functional.interpolate(full, size=(h, w)).to(self.models.device))
        return found

    def check(self, item: Any, timings: Any) -> None:
        if item.init is None:
            return
        with timings.stage("sources"):  # encoded here once, then read from the cache
            try:
                self.latents(item)
            except DECODE_ERRORS as e:
                raise Unreadable("source image", item.init.image, item.init.file, e) from e
            try:
                self.mask(item)
            except DECODE_ERRORS as e:
                raise Unreadable("mask image", item.mask.image, item.mask.file, e) from e

    def tail(self, sampler: str, steps: int, start: int) -> torch.Tensor:
        """The sigmas of the tail from `start` of an S-step schedule [steps - start + 1] (its first: where the sources
        start; the rest: the sigma after each step), on the device."""
        key = (sampler, steps, start)
        if key not in self.sigmas:
            self.sigmas[key] = schedule(sampler, steps, self.models.scheduler_config, start).sigmas.float() \
                .to(self.models.device)
        return self.sigmas[key]

    def batch(self, items: Sequence[Any], key: Any) -> Blend | None:
        """Every row's source, noise and mask; None where no row has a source."""
        if not any(it.init is not None for it in items):
            return None
        dev, h, w = self.models.device, key.height // 8, key.width // 8
        zero = torch.zeros(1, 4, h, w, device=dev)
        latents = torch.cat([self.latents(it) if it.init is not None else zero for it in items])
        noise = torch.cat([torch.randn((1, 4, h, w), generator=torch.Generator("cpu").manual_seed(it.seed))
                           for it in items]).to(dev)
        mask = torch.cat([self.mask(it) for it in items])
        sigmas = self.tail(key.sampler, key.steps, key.init_skip)
        # pure noise: a row without a source, and an inpainting at strength 1 (diffusers' is_strength_max)
        fresh = torch.tensor([it.init is None or (it.mask is not None and it.init.strength == 1.0) for it in items],
                             device=dev).view(-1, 1, 1, 1)
        return Blend(latents, noise, mask, sigmas[1:], latents + noise * sigmas[0], fresh)  # add_noise(x0, noise, t0)


class Buffers:
    """The sources, noise, masks and next sigmas at the largest batch and size: every graph blends through them."""

    def __init__(self, models: Any, max_batch: int, max_pixels: int):
        dev, n = models.device, max_batch * max_pixels // 64
        self.latents = torch.zeros(4 * n, device=dev)
        self.noise = torch.zeros(4 * n, device=dev)
        self.mask = torch.ones(n, device=dev)
        self.next_sigma = torch.zeros(MAX_STEPS, device=dev)

    def view(self, key: Any) -> Blend:
        b, h, w = key.batch, key.height // 8, key.width // 8
        n = b * h * w
        return Blend(self.latents[: 4 * n].view(b, 4, h, w), self.noise[: 4 * n].view(b, 4, h, w),
                     self.mask[:n].view(b, 1, h, w), self.next_sigma)


def synthetic(models: Any, batch: int, width: int, height: int, bits: int, repaint: float = 1.0) -> Blend:
    """Every row repainting the left `repaint` of a random source (values do not change the blend's kernels; 1.0, as
    timing and checks take it: img2img, every row's mask 1, its update kept exactly)."""
    g = torch.Generator("cpu").manual_seed(0)
    h, w, dev = height // 8, width // 8, models.device
    mask = torch.zeros(batch, 1, h, w)
    mask[..., : round(w * repaint)] = 1
    return Blend(torch.randn(batch, 4, h, w, generator=g).to(dev), torch.randn(batch, 4, h, w, generator=g).to(dev),
                 mask.to(dev), torch.linspace(10, 0, MAX_STEPS).to(dev))


KIND = Kind(NAME, FIELDS, Reader, Buffers, synthetic)
