"""The denoising step's static buffers: allocated once at the largest batch and latent size a job
needs, sliced per graph (`Views`); CUDA graphs hold pointers into them, so they never move. Each conditioning kind's
own buffers are its row's (engine/conditions/): allocated here, viewed per graph and loaded with the rest in one
grouped copy."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.conditioning import Cond
from storyboard_cli.engine.conditions import KINDS
from storyboard_cli.engine.conditions.kind import Conditions
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
        # each kind's, where the models run it (a ControlNet's guides, an IP-Adapter's tokens)
        self.kinds = [s for row in KINDS.values() if (s := row.static(m, max_batch, max_pixels)) is not None]
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
        self.key, self.buf = key, r  # buf: whose step counter and sampler table the step reads
        b, h, w = key.batch, key.height // 8, key.width // 8
        n = b * 4 * h * w
        self.x = r.x[:n].view(b, 4, h, w)
        self.prev = r.prev[:n].view(b, 4, h, w)
        self.noise = r.noise[:n].view(b, 4, h, w)
        self.guidance = r.guidance[:b]
        self.cond = Cond(r.embeds[: 2 * b], r.pooled[: 2 * b], r.time_ids[: 2 * b])
        self.conds = Conditions.of(*(s.view(key) for s in r.kinds))  # the kinds this graph runs
        self.feature = r.feature_of(key) if key.step.cache else None

    def load(self, buf: Buffers, x: torch.Tensor, sched: Schedule, cond: Cond, conds: Conditions,
             guidance: torch.Tensor) -> None:
        """A batch's inputs into the buffers: the latents, text conditioning, guidance and every kind's tensors (the
        kinds this graph runs: none of a step after the ControlNet's end) in one grouped copy."""
        self.prev.zero_()
        self.noise.zero_()
        buf.table[: sched.steps].copy_(sched.table, non_blocking=True)
        buf.index.zero_()
        pairs = [(self.x, x), (self.cond.embeds, cond.embeds), (self.cond.pooled, cond.pooled),
                 (self.cond.time_ids, cond.time_ids), (self.guidance, guidance), *self.conds.pairs(conds)]
        torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
