"""SDXL conditioning, as diffusers' StableDiffusionXLPipeline builds it.

Both CLIP encoders' penultimate hidden states, concatenated; pooled embeds from the second;
zeros for an empty negative prompt (force_zeros_for_empty_prompt); add_time_ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import torch

from storyboard_cli.models.loader import SdxlModels


def image_rows(t: torch.Tensor, n: int, b: int, dim: int = 0) -> torch.Tensor:
    """The rows of a batch's first `n` images in `t`, CFG-doubled rows of `b` images (negative rows first) along
    `dim`: a tensor of its own (compiled kernels want aligned rows)."""
    return torch.cat([t.narrow(dim, 0, n), t.narrow(dim, b, n)], dim)


@dataclass(frozen=True)
class Cond:
    """The text conditioning of one batch; what else conditions it (guides, references) are the kinds' values
    (engine/conditions/), handed beside it."""

    embeds: torch.Tensor  # [2B, 77, C]  negative rows first, as diffusers' CFG
    pooled: torch.Tensor  # [2B, P]
    time_ids: torch.Tensor  # [2B, 6]

    def half(self, b: int) -> Cond:
        """The conditional rows alone (clones: compiled kernels assume 16-byte aligned inputs, and half of a small
        table is not)."""
        return Cond(self.embeds[b:], self.pooled[b:].clone(), self.time_ids[b:].clone())

    def first_images(self, n: int, b: int) -> Cond:
        """The rows of the batch's first `n` of `b` images (image_rows)."""
        return Cond(image_rows(self.embeds, n, b), image_rows(self.pooled, n, b), image_rows(self.time_ids, n, b))


@torch.no_grad()
def encode_text(models: SdxlModels, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 77, C1 + C2] penultimate hidden states and [N, P] pooled embeds."""
    hidden, pooled = [], None
    for tokenizer, encoder in zip(models.tokenizers, models.text_encoders):
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids
        out = encoder(ids.to(models.device), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])  # as diffusers SDXL encode_prompt (clip_skip=None)
        pooled = out[0]  # the last encoder's: CLIPTextModelWithProjection.text_embeds
    return torch.cat(hidden, dim=-1), pooled


class BoundedCache(OrderedDict):
    """Least recently used entries go first once the tensors held pass `max_bytes`: memory stays flat
    however many distinct prompts or control images a job has."""

    def __init__(self, max_bytes: int):
        super().__init__()
        self.max_bytes, self.nbytes = max_bytes, 0

    @staticmethod
    def _size(value) -> int:
        tensors = value if isinstance(value, tuple) else (value,)
        return sum(t.numel() * t.element_size() for t in tensors)

    def lookup(self, key: Hashable):
        """The value (now the most recently used), or None."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def put(self, key: Hashable, value):
        self[key] = value
        self.nbytes += self._size(value)
        while self.nbytes > self.max_bytes and len(self) > 1:
            _, old = self.popitem(last=False)
            self.nbytes -= self._size(old)
        return value


PROMPT_CACHE_BYTES = 256 << 20  # ~800 SDXL prompts (77 x 2048 fp16 + pooled)


class PromptCache:
    """Encodes each distinct prompt once per job (per text-encoder LoRA set: those change the embeddings),
    keeping the most recently used within PROMPT_CACHE_BYTES."""

    def __init__(self, models: SdxlModels, max_bytes: int = PROMPT_CACHE_BYTES):
        self.models = models
        self._cache = BoundedCache(max_bytes)

    def get(self, prompts: list[str], lora_key: Hashable = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 77, C] embeds and [N, P] pooled for these prompts; "" gives zeros (diffusers'
        force_zeros_for_empty_prompt: only negative prompts are ever empty). `lora_key` names the
        text-encoder LoRAs applied now (models.lora.set_key(active, text_only=True))."""
        rows = self.fill(prompts, lora_key)
        some = next(iter(rows.values()), None)
        if some is None:  # every prompt empty: shapes from one encode of ""
            e, p = encode_text(self.models, [""])
            some = (e[0], p[0])
        zeros = (torch.zeros_like(some[0]), torch.zeros_like(some[1]))
        picked = [rows[p] if p else zeros for p in prompts]
        return torch.stack([r[0] for r in picked]), torch.stack([r[1] for r in picked])


    def missing(self, prompts: list[str], lora_key: Hashable = ()) -> list[str]:
        """The distinct non-empty prompts not in the cache under `lora_key`, in the order `fill` encodes them."""
        return sorted({p for p in prompts if p and (lora_key, p) not in self._cache})

    def fill(self, prompts: list[str], lora_key: Hashable = ()) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """prompt -> (embeds [77, C], pooled [P]) for each non-empty prompt, the ones not in the cache encoded now
        and cached: what `get` stacks, and what a batch's prompts encoded ahead of it (run/batch.py) put in."""
        rows = {}  # held here for this call: the cache may drop some as it fills
        for p in {p for p in prompts if p}:
            found = self._cache.lookup((lora_key, p))
            if found is not None:
                rows[p] = found
        # each prompt encoded on its own: in a batch of prompts the matrix shapes, and so the kernels and
        # their rounding on a GPU, depend on which other prompts were new at the time; a prompt's
        # embedding, and its images, must not depend on the batch, the job's order or the worker
        for p in sorted({p for p in prompts if p and p not in rows}):
            embeds, pooled = encode_text(self.models, [p])
            rows[p] = self._cache.put((lora_key, p), (embeds[0], pooled[0]))
        return rows


def guided_rows(prompts: list[str], negatives: list[str], guidance: list[float]
                ) -> tuple[list[str], list[float]]:
    """(negative prompts, guidance) for the CFG-doubled step, as diffusers decides: guidance_scale <= 1
    means no classifier-free guidance, the prompt alone. Such a row's negative half repeats its prompt
    with guidance 1, so eps_neg == eps_pos and the combine gives the prompt's eps exactly."""
    cfg = [g > 1 for g in guidance]
    return ([n if on else p for p, n, on in zip(prompts, negatives, cfg)],
            [g if on else 1.0 for g, on in zip(guidance, cfg)])


def time_ids(width: int, height: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # as diffusers SDXL _get_add_time_ids: original size, crop top-left, target size
    ids = torch.tensor([height, width, 0, 0, height, width], dtype=dtype, device=device)
    return ids.expand(rows, 6)


def conditioning(cache: PromptCache, positives: list[str], negatives: list[str], width: int, height: int,
                 lora_key: Hashable = ()) -> Cond:
    """CFG-doubled conditioning for one batch: [negatives..., positives...]."""
    embeds, pooled = cache.get(list(negatives) + list(positives), lora_key)
    m = cache.models
    return Cond(embeds, pooled, time_ids(width, height, embeds.shape[0], m.dtype, m.device))


def read_control_image(path: Path, width: int, height: int) -> torch.Tensor:
    """uint8 [3, H, W]: RGB, resized as diffusers' ControlNet image processor (a quarter of the float's
    memory while cached). Raises what PIL raises for a file it cannot decode."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.size != (width, height):
            im = im.resize((width, height), Image.LANCZOS)
        data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return data.view(height, width, 3).permute(2, 0, 1)


def control_pixels(image: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float in [0, 1], not normalised (as diffusers' ControlNet image processor)."""
    return image.float() / 255.0


def device_pixels(image: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`control_pixels(image)` in `dtype` on `device`, bit for bit: a uint8 image is copied as it is (a quarter of
    float32's bytes) and its values looked up in a table of `control_pixels`' 256, made on the host as it makes them;
    the host's float conversion of a batch's guides (4 x 832x1216: 92 ms on a two-core host, docs/PERFORMANCE.md)
    leaves the gap between two loops. Another dtype is taken as pixels already."""
    if image.dtype != torch.uint8:
        return image.to(device, dtype)
    table = control_pixels(torch.arange(256, dtype=torch.uint8)).to(device, dtype)
    return table[image.to(device).long()]


def load_control_image(path: Path, width: int, height: int) -> torch.Tensor:
    """[3, H, W] in [0, 1], as diffusers' ControlNet image processor (RGB, resized, not normalised)."""
    return control_pixels(read_control_image(path, width, height))
