"""The denoising step's static buffers: allocated once at the largest batch and latent size a job
needs, sliced per graph (`Views`); CUDA graphs hold pointers into them, so they never move."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from storyboard_cli.engine.base import Shape, nets_of
from storyboard_cli.engine.conditioning import Cond, Control, Refs
from storyboard_cli.engine.deepcache import feature_capacity, feature_shape
from storyboard_cli.engine.sampling import Schedule
from storyboard_cli.models.loader import SdxlModels
from storyboard_cli.models.tokenizers import CLIP_TOKENS
from storyboard_cli.samplers import MAX_STEPS

if TYPE_CHECKING:
    from storyboard_cli.engine.graph.keys import ShapeKey


class Buffers:
    """The step's static buffers, at the largest batch and size: graphs hold pointers into them."""

    def __init__(self, models: SdxlModels, max_batch: int, max_pixels: int):
        m, dev = models, models.device
        self.max_batch, self.max_pixels = max_batch, max_pixels
        b, rows = max_batch, 2 * max_batch
        latent = b * 4 * max_pixels // 64
        text_dim = m.unet.config.cross_attention_dim
        pooled_dim = m.text_encoders[1].config.projection_dim
        self.x = torch.zeros(latent, device=dev)  # float32: the sampler state
        self.prev = torch.zeros(latent, device=dev)
        self.noise = torch.zeros(latent, device=dev)
        self.table = torch.zeros(MAX_STEPS, 6, device=dev)
        self.index = torch.zeros(1, dtype=torch.long, device=dev)
        self.guidance = torch.zeros(b, device=dev)
        self.embeds = torch.zeros(rows, CLIP_TOKENS, text_dim, device=dev, dtype=m.dtype)
        self.pooled = torch.zeros(rows, pooled_dim, device=dev, dtype=m.dtype)
        self.time_ids = torch.zeros(rows, 6, device=dev, dtype=m.dtype)
        nets = len(m.controlnets)  # one guide per ControlNet a batch may run
        self.control_image = torch.zeros(nets * rows * 3 * max_pixels, device=dev, dtype=m.dtype)
        self.control_scale = torch.zeros(nets, rows, 1, 1, 1, device=dev, dtype=m.dtype)
        self.control_keep = torch.ones(MAX_STEPS, nets, device=dev)  # each net's keep per step (Control.keep)
        self.refs = None  # the IP-Adapter's tokens, scale and mask (engine/conditioning.py Refs)
        if m.ip_adapter is not None:
            from storyboard_cli.models.ip_adapter import REFERENCE_SLOTS  # lazily: it imports diffusers

            width = REFERENCE_SLOTS * m.ip_adapter.tokens
            self.refs = Refs(torch.zeros(rows, width, m.ip_adapter.dim, device=dev, dtype=m.dtype),
                             torch.zeros(rows, 1, 1, device=dev, dtype=m.dtype),
                             torch.zeros(rows, 1, 1, width, device=dev, dtype=m.dtype))
        self.unet, self.dtype, self.device = m.unet, m.dtype, dev
        self.feature: torch.Tensor | None = None  # DeepCache's, made at the first graph that caches

    def feature_of(self, key: ShapeKey) -> torch.Tensor:
        """DeepCache's cached feature for `key` [2B, C, h', w'], in one buffer sized for every branch at the
        largest shape (allocated once, outside any capture: graphs hold its pointer)."""
        if self.feature is None:
            most = feature_capacity(self.unet, 2 * self.max_batch, self.max_pixels // 64)
            self.feature = torch.zeros(most, device=self.device, dtype=self.dtype)
        shape = feature_shape(self.unet, 2 * key.batch, key.height // 8, key.width // 8, key.step.branch)
        return self.feature[: math.prod(shape)].view(shape)

    def fits(self, shape: Shape | ShapeKey) -> bool:
        return shape.batch <= self.max_batch and shape.height * shape.width <= self.max_pixels

    def view(self, key: ShapeKey) -> Views:
        return Views(self, key)


class Views:
    """The static buffers sliced and shaped for one ShapeKey."""

    def __init__(self, r: Buffers, key: ShapeKey):
        self.key = key
        b, h, w = key.batch, key.height // 8, key.width // 8
        n = b * 4 * h * w
        self.x = r.x[:n].view(b, 4, h, w)
        self.prev = r.prev[:n].view(b, 4, h, w)
        self.noise = r.noise[:n].view(b, 4, h, w)
        self.guidance = r.guidance[:b]
        refs = None if r.refs is None else Refs(r.refs.tokens[: 2 * b], r.refs.scale[: 2 * b], r.refs.mask[: 2 * b])
        self.cond = Cond(r.embeds[: 2 * b], r.pooled[: 2 * b], r.time_ids[: 2 * b], refs)
        self.control = None
        if key.control:
            nets = nets_of(key.control)
            n = len(nets)
            self.control = Control(r.control_image[: n * 2 * b * 3 * key.height * key.width]
                                   .view(n, 2 * b, 3, key.height, key.width), r.control_scale[:n, : 2 * b], nets,
                                   r.control_keep[:, :n])
        self.feature = r.feature_of(key) if key.step.cache else None

    def load(self, buf: Buffers, x: torch.Tensor, sched: Schedule, cond: Cond, control: Control | None,
             guidance: torch.Tensor) -> None:
        self.x.copy_(x)
        self.prev.zero_()
        self.noise.zero_()
        buf.table[: sched.steps].copy_(sched.table, non_blocking=True)
        buf.index.zero_()
        self.cond.embeds.copy_(cond.embeds)
        self.cond.pooled.copy_(cond.pooled)
        self.cond.time_ids.copy_(cond.time_ids)
        self.guidance.copy_(guidance)
        if cond.refs is not None and self.cond.refs is not None:
            for mine, theirs in zip((self.cond.refs.tokens, self.cond.refs.scale, self.cond.refs.mask),
                                    (cond.refs.tokens, cond.refs.scale, cond.refs.mask)):
                mine.copy_(theirs)
        if control is not None and self.control is not None:  # None: a step after the ControlNet's end
            self.control.image.copy_(control.image)
            self.control.scale.copy_(control.scale)
            self.control.keep.fill_(1.0)
            if control.keep is not None:
                self.control.keep[: control.keep.shape[0]].copy_(control.keep)
