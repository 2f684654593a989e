"""The `reference` kind on the engine side: IP-Adapter references. Each row's references' image tokens in the adapter's
slots (models/ip_adapter.py IpAdapter.slots images), a per-row scale, empty slots masked: rows with and without
references share one batch and one graph. The adapter's attention processors read them (cross_attention_kwargs). The
job half is job/conditions/ (the same name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from storyboard_cli.engine.conditioning import image_rows
from storyboard_cli.engine.conditions.kind import DECODE_ERRORS, Kind, Pair, Plain, Unreadable

NAME = "reference"
# the names that are this kind's alone: the WorkItem's fields it reads, the attention processors' keyword arguments
FIELDS = ("references", "reference_scale", "ref_tokens", "ref_scale", "ref_mask")


@dataclass(frozen=True)
class Refs(Plain):
    """IP-Adapter image tokens for one batch, CFG-doubled like the embeds (negative rows first). Every row has the same
    number of token slots; a row's empty slots are masked, and a row without a reference has scale 0."""

    tokens: torch.Tensor  # [2B, S, C]: S = slots x tokens per image, C the UNet's cross-attention width
    scale: torch.Tensor  # [2B, 1, 1]
    mask: torch.Tensor  # [2B, 1, 1, S] additive: 0 for a reference's tokens, -inf for an empty slot's
    kind: str = NAME

    def half(self, b: int) -> Refs:
        """The conditional rows' (a step without guidance); clones: compiled kernels and SDPA want aligned rows."""
        return Refs(self.tokens[b:], self.scale[b:].clone(), self.mask[b:].clone())

    def first_images(self, n: int, b: int) -> Refs:
        return Refs(image_rows(self.tokens, n, b), image_rows(self.scale, n, b), image_rows(self.mask, n, b))

    def attention(self) -> dict[str, torch.Tensor]:
        """What the adapter's attention processors read (models/ip_adapter.py), in the exported UNet's input order."""
        return {"ref_tokens": self.tokens, "ref_scale": self.scale, "ref_mask": self.mask}

    def pairs(self, value: Refs) -> list[Pair]:
        return [(self.tokens, value.tokens), (self.scale, value.scale), (self.mask, value.mask)]


def references(tokens: list[list[torch.Tensor]], negative: torch.Tensor, scales: list[float], slots: int) -> Refs:
    """One row per image: its references' projected tokens (each [T, C]), the adapter's negative tokens [T, C] (the
    unconditional half's, one per filled slot as diffusers builds them), its scale -> the CFG-doubled Refs with
    `slots` image slots per row."""
    t, c = negative.shape
    rows = len(tokens)
    pos = negative.new_zeros(rows, slots * t, c)
    neg = negative.new_zeros(rows, slots * t, c)
    mask = negative.new_zeros(rows, 1, 1, slots * t)
    for i, row in enumerate(tokens):
        if len(row) > slots:
            raise ValueError(f"{len(row)} references in one row; at most {slots}")
        for j, tok in enumerate(row):
            pos[i, j * t:(j + 1) * t] = tok
            neg[i, j * t:(j + 1) * t] = negative
        if row:  # a row without a reference masks nothing: its scale is 0, and SDPA of no key would be NaN
            mask[i, ..., len(row) * t:] = float("-inf")
    scale = negative.new_tensor([s if row else 0.0 for s, row in zip(scales, tokens)]).view(-1, 1, 1)
    return Refs(torch.cat([neg, pos]), scale.repeat(2, 1, 1), mask.repeat(2, 1, 1, 1))


def width(models: Any) -> int:
    """Reference tokens per row (slots x tokens per image); 0 without an adapter."""
    adapter = models.ip_adapter
    return 0 if adapter is None else adapter.slots * adapter.tokens


class Reader:
    """The references of one job's batches, each encoded once per job and adapter (the adapter's caches)."""

    def __init__(self, adapter: Any):
        self.adapter = adapter

    def check(self, item: Any, timings: Any) -> None:
        for ref in item.references:
            try:
                with timings.stage("references"):  # encoded here once, then read from the adapter's cache
                    self.adapter.encode(ref.image, ref.sha256)
            except DECODE_ERRORS as e:
                raise Unreadable("reference", ref.image, ref.file, e) from e

    def batch(self, items: Sequence[Any], key: Any) -> Refs:
        """Every batch has them: rows without a reference ride at scale 0."""
        a = self.adapter
        tokens = [[a.encode(r.image, r.sha256) for r in it.references] for it in items]
        return references(tokens, a.negative, [it.reference_scale for it in items], a.slots)


class Buffers:
    """The tokens, scales and masks at the largest batch: every graph reads them."""

    def __init__(self, models: Any, max_batch: int):
        rows, n, dev, dtype = 2 * max_batch, width(models), models.device, models.dtype
        self.refs = Refs(torch.zeros(rows, n, models.ip_adapter.dim, device=dev, dtype=dtype),
                         torch.zeros(rows, 1, 1, device=dev, dtype=dtype), torch.zeros(rows, 1, 1, n, device=dev,
                                                                                    dtype=dtype))

    def view(self, key: Any) -> Refs:
        r, rows = self.refs, 2 * key.batch
        return Refs(r.tokens[:rows], r.scale[:rows], r.mask[:rows])


def synthetic(models: Any, batch: int, width_: int, height: int, bits: int) -> Refs | None:
    """Every row with one reference slot filled (random tokens: the kernels are the same for any)."""
    a = models.ip_adapter
    if a is None:
        return None
    tokens = torch.randn(a.tokens, a.dim, generator=torch.Generator("cpu").manual_seed(0))
    tokens = tokens.to(models.device, models.dtype)
    return references([[tokens]] * batch, a.negative, [0.6] * batch, a.slots)


KIND = Kind(NAME, FIELDS, lambda models: None if models.ip_adapter is None else Reader(models.ip_adapter),
            lambda models, max_batch, max_pixels: None if models.ip_adapter is None else Buffers(models, max_batch),
            synthetic, width)
