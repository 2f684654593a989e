"""SDXL conditioning, as diffusers' StableDiffusionXLPipeline builds it.

Both CLIP encoders' penultimate hidden states, concatenated; pooled embeds from the second;
zeros for an empty negative prompt (force_zeros_for_empty_prompt); add_time_ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from storyboard_cli.models.loader import SdxlModels


@dataclass
class Cond:
    embeds: torch.Tensor  # [2B, 77, C]  negative rows first, as diffusers' CFG
    pooled: torch.Tensor  # [2B, P]
    time_ids: torch.Tensor  # [2B, 6]


@dataclass
class Control:
    """ControlNet inputs for one batch, CFG-doubled like Cond (build with `control`)."""

    image: torch.Tensor  # [2B, 3, H, W] in [0, 1], negative rows first
    scale: torch.Tensor  # [2B, 1, 1, 1]


def control(images: torch.Tensor, scales: list[float], device: torch.device, dtype: torch.dtype) -> Control:
    """images [B, 3, H, W], one scale per image -> the CFG-doubled Control (the same image on both halves)."""
    image = images.to(device, dtype).repeat(2, 1, 1, 1)  # [2B, 3, H, W]
    scale = torch.tensor(list(scales) * 2, device=device, dtype=dtype)
    return Control(image, scale.view(-1, 1, 1, 1))


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


class PromptCache:
    """Encodes each distinct prompt once per job."""

    def __init__(self, models: SdxlModels):
        self.models = models
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        todo = sorted({p for p in prompts if p and p not in self._cache})
        if todo:
            embeds, pooled = encode_text(self.models, todo)
            for i, p in enumerate(todo):
                self._cache[p] = (embeds[i], pooled[i])
        some = next(iter(self._cache.values()), None)
        if some is None:  # every prompt empty: shapes from one encode of ""
            e, p = encode_text(self.models, [""])
            some = (e[0], p[0])
        rows = [self._cache[p] if p else (torch.zeros_like(some[0]), torch.zeros_like(some[1])) for p in prompts]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def time_ids(width: int, height: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # as diffusers SDXL _get_add_time_ids: original size, crop top-left, target size
    ids = torch.tensor([height, width, 0, 0, height, width], dtype=dtype, device=device)
    return ids.expand(rows, 6)


def conditioning(cache: PromptCache, positives: list[str], negatives: list[str], width: int, height: int) -> Cond:
    """CFG-doubled conditioning for one batch: [negatives..., positives...]."""
    embeds, pooled = cache.get(list(negatives) + list(positives))
    m = cache.models
    return Cond(embeds, pooled, time_ids(width, height, embeds.shape[0], m.dtype, m.device))


def load_control_image(path: Path, width: int, height: int) -> torch.Tensor:
    """[3, H, W] in [0, 1], as diffusers' ControlNet image processor (RGB, resized, not normalised)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.size != (width, height):
            im = im.resize((width, height), Image.LANCZOS)
        data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return data.view(height, width, 3).permute(2, 0, 1).float() / 255.0
