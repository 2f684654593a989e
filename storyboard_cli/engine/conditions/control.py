"""The `control` kind on the engine side: ControlNet guides. One guide per ControlNet a batch runs, in the job's order
of nets, their residuals summed in that order as diffusers' MultiControlNetModel; each net's own end as a per-step
keep. The job half is job/conditions/ (the same name)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from storyboard_cli.engine.base import nets_of
from storyboard_cli.engine.conditioning import BoundedCache, device_pixels, image_rows, read_control_image
from storyboard_cli.engine.conditions.kind import DECODE_ERRORS, Kind, Pair, Plain, Step, Unreadable
from storyboard_cli.samplers import MAX_STEPS
from storyboard_cli.steps import control_steps

NAME = "control"
# the names that are this kind's alone: the WorkItem's and BucketKey's fields it reads
FIELDS = ("controls", "control_ends")
CACHE_BYTES = 256 << 20  # decoded control images kept (uint8: a 1024x1024 one is 3 MB)


def embedding_apart(controlnet: torch.nn.Module) -> torch.nn.Module:
    """`controlnet` without its conditioning embedding: the same modules and parameters (a shallow copy: what is
    written to or swapped inside the net later is the copy's too), its `controlnet_cond_embedding` an identity, so
    its `controlnet_cond` is the guide `embed_guide` made. The embedding (SDXL's: eight convolutions from the pixels
    to the latent's size) is the same at every step of a batch and on both halves of the guidance: made once per
    batch, not at every step for every row."""
    apart = copy.copy(controlnet)
    apart._modules = {**controlnet._modules, "controlnet_cond_embedding": torch.nn.Identity()}
    return apart


def guide_channels(controlnet: torch.nn.Module) -> int:
    """The channels of a net's embedded guide (its first block's: 320 in SDXL's)."""
    return controlnet.config.block_out_channels[0]


@torch.no_grad()
def embed_guide(controlnet: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
    """image [B, 3, H, W] pixels in [0, 1] -> the guide `embedding_apart(controlnet)` takes [B, C, H/8, W/8],
    channels_last (as the compiled ControlNet's convolutions read it): the net's own embedding of it, what the whole
    net computed at every step (bit for bit on the CPU: tests/test_multi_control.py). A "bgr" net flips its
    `controlnet_cond` before the embedding; the apart net flips the guide instead, so it gets the embedding of the
    flipped image flipped once more."""
    bgr = controlnet.config.controlnet_conditioning_channel_order == "bgr"
    guide = controlnet.controlnet_cond_embedding(image.flip(1) if bgr else image)
    return (guide.flip(1) if bgr else guide).contiguous(memory_format=torch.channels_last)


@dataclass(frozen=True)
class Control(Plain):
    """ControlNet inputs for one batch, CFG-doubled like the embeds (build with `control`): one guide per ControlNet
    the batch runs, in the job's order of nets, embedded by its net (`embed_guide`)."""

    guide: torch.Tensor  # [N, 2B, C, h, w] at the latent's size, negative rows first, each net's channels_last
    scale: torch.Tensor  # [N, 2B, 1, 1, 1]
    nets: tuple[int, ...] = (0,)  # which of the models' ControlNets, one per guide
    # [steps, N]: 1 while a net runs, 0 after its own `end` (several nets ending apart; the step plan stops them all
    # after the last end). None: every net runs every step the plan gives the ControlNets
    keep: torch.Tensor | None = None
    kind: str = NAME

    @property
    def bits(self) -> int:
        """Shape.control: bit i for net i."""
        return sum(1 << n for n in self.nets)

    def at(self, index: int | torch.Tensor) -> Control:
        """The guides of one step: each net's scale times its keep, as diffusers'
        `cond_scale = controlnet_conditioning_scale * controlnet_keep[i]`."""
        if self.keep is None:
            return self
        keep = self.keep[index] if isinstance(index, int) else self.keep.index_select(0, index)
        return Control(self.guide, self.scale * keep.view(-1, 1, 1, 1, 1).to(self.scale.dtype), self.nets)

    def half(self, b: int) -> Control:
        return Control(self.guide[:, b:], self.scale[:, b:].clone(), self.nets, self.keep)

    def first_images(self, n: int, b: int) -> Control:
        return Control(image_rows(self.guide, n, b, 1), image_rows(self.scale, n, b, 1), self.nets, self.keep)

    def residuals(self, step: Step) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Every guide's ControlNet (none after the ControlNets' end: `StepKind.control`), residuals summed in the
        job's order of nets (as diffusers' MultiControlNetModel)."""
        if not step.kind.control:
            return None
        mid = down = None
        for i, net in enumerate(self.nets):
            m, *d = step.calls.net(net)(step.latents, step.t, step.embeds, step.pooled, step.time_ids, self.guide[i],
                                        self.scale[i])
            mid, down = (m, d) if mid is None else (mid + m, [a + b for a, b in zip(down, d)])
        return mid, down

    def pairs(self, value: Control) -> list[Pair]:
        # a value without keep runs every net every step: the buffer's whole keep is 1
        keep = value.keep if value.keep is not None else torch.ones_like(self.keep)
        return [(self.guide, value.guide), (self.scale, value.scale), (self.keep[: keep.shape[0]], keep)]


def control(models: Any, images: list[torch.Tensor], scales: list[list[float]], nets: tuple[int, ...] = (0,),
            keep: torch.Tensor | None = None) -> Control:
    """images: per net [B, 3, H, W], uint8 or pixels in [0, 1]; scales: per net one per image -> the CFG-doubled
    Control: each image embedded once by its net (`embed_guide`), the same guide on both halves."""
    device, dtype = models.device, models.dtype
    guides = [embed_guide(models.controlnets[n], device_pixels(i, device, dtype)) for n, i in zip(nets, images)]
    b, ch, h, w = guides[0].shape
    guide = torch.empty(len(guides), 2 * b, h, w, ch, device=device, dtype=dtype)  # each net's rows channels_last
    for g, out in zip(guides, guide):
        out.view(2, b, h, w, ch).copy_(g.permute(0, 2, 3, 1).unsqueeze(0).expand(2, -1, -1, -1, -1))
    scale = torch.tensor([list(s) * 2 for s in scales], device=device, dtype=dtype)
    return Control(guide.permute(0, 1, 4, 2, 3), scale.view(len(images), -1, 1, 1, 1), tuple(nets),
                   None if keep is None else keep.to(device))


def guides(item: Any) -> list[tuple[Path, float, str]]:
    """(control image, scale, the name the job gives the file) of each ControlNet a WorkItem runs, in the job's order
    of nets."""
    return [(c.image, c.scale, c.file) for c in item.controls]


class Reader:
    """The control images of one job's batches, decoded once each while they stay in a bounded cache."""

    def __init__(self, models: Any):
        self.models = models
        self.images = BoundedCache(CACHE_BYTES)

    def image(self, path: Path, width: int, height: int) -> torch.Tensor:
        """uint8 [3, H, W], decoded once while it stays in the bounded cache."""
        key = (path, width, height)
        found = self.images.lookup(key)
        return found if found is not None else self.images.put(key, read_control_image(path, width, height))

    def check(self, item: Any, timings: Any) -> None:
        for path, _, shown in guides(item):
            try:
                self.image(path, item.width, item.height)
            except DECODE_ERRORS as e:
                raise Unreadable("control image", path, shown, e) from e

    def batch(self, items: Sequence[Any], key: Any) -> Control | None:
        """The batch's guides, one per ControlNet it runs (its rows share the nets: they are in the bucket key), each
        net's end as a per-step keep where the nets end apart."""
        nets = key.nets
        if not nets:
            return None
        rows = [guides(it) for it in items]  # per row: (image, scale, file) per net
        images = [torch.stack([self.image(row[j][0], it.width, it.height) for it, row in zip(items, rows)])
                  for j in range(len(nets))]  # uint8: made pixels on the device (`control`)
        scales = [[row[j][1] for row in rows] for j in range(len(nets))]
        keep = None
        if key.control_ends:  # 1 while each net runs, as diffusers' controlnet_keep (over the steps that run)
            runs = torch.tensor([control_steps(key.runs, end) for end in key.control_ends])
            keep = (torch.arange(key.runs)[:, None] < runs[None, :]).float()  # [steps, N]
        return control(self.models, images, scales, nets, keep)


class Buffers:
    """One embedded guide and scale per ControlNet of the models, and each net's per-step keep, at the largest
    shape."""

    def __init__(self, models: Any, max_batch: int, max_pixels: int):
        nets, rows, dev, dtype = len(models.controlnets), 2 * max_batch, models.device, models.dtype
        self.channels = guide_channels(models.controlnets[0])  # every net's: their residuals feed one UNet
        self.guide = torch.zeros(nets * rows * self.channels * (max_pixels // 64), device=dev, dtype=dtype)
        self.scale = torch.zeros(nets, rows, 1, 1, 1, device=dev, dtype=dtype)
        self.keep = torch.ones(MAX_STEPS, nets, device=dev)  # each net's keep per step (Control.keep)

    def view(self, key: Any) -> Control | None:
        """A shape's `control` is the bits of the nets it runs: `+control` for the first alone, `+control 0+1` for
        two; none for a graph without (a step after the ControlNets' end is keyed so)."""
        if not key.control:
            return None
        nets = nets_of(key.control)
        n, rows, h, w, ch = len(nets), 2 * key.batch, key.height // 8, key.width // 8, self.channels
        guide = self.guide[: n * rows * h * w * ch].view(n, rows, h, w, ch).permute(0, 1, 4, 2, 3)  # channels_last
        return Control(guide, self.scale[:n, :rows], nets, self.keep[:, :n])


def buffers(models: Any, max_batch: int, max_pixels: int) -> Buffers | None:
    return Buffers(models, max_batch, max_pixels) if models.controlnets else None


def synthetic(models: Any, batch: int, width: int, height: int, bits: int) -> Control | None:
    """Every net of `bits` on the same random image at scale 1."""
    if not bits:
        return None
    nets = nets_of(bits)
    images = torch.rand((batch, 3, height, width), generator=torch.Generator("cpu").manual_seed(0))
    return control(models, [images] * len(nets), [[1.0] * batch] * len(nets), nets)


KIND = Kind(NAME, FIELDS, Reader, buffers, synthetic)
