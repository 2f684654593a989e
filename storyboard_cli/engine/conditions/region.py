"""The `region` kind on the engine side: regional prompts and regional references. Each row's regions' prompts in the
key slots after the shot's prompt (one slot of 77 tokens per region; the negative rows' and an unused slot's masked),
the additive masks that let each region's image tokens see only their own prompt, one per attention level of the UNet,
and, with an IP-Adapter, the regions' references in their own slots, each weighted by its region's mask and scale.
Every batch of models made for regions has them (a row without regions has every slot masked), so rows with and
without regions share one batch and one graph. The UNet's processors read them (models/regions.py). The job half is
job/conditions/region.py (the same name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from storyboard_cli.engine.conditioning import PromptCache, image_rows
from storyboard_cli.engine.conditions.kind import DECODE_ERRORS, Export, Kind, Pair, Plain, Unreadable
from storyboard_cli.errors import ModelError
from storyboard_cli.models.regions import LEVELS, Layout, install
from storyboard_cli.models.tokenizers import CLIP_TOKENS

NAME = "region"
# by attention level (models/regions.py LEVELS of them): the processors' keyword arguments
BIAS = ("region_bias_0", "region_bias_1", "region_bias_2", "region_bias_3")
WEIGHT = ("region_ref_weight_0", "region_ref_weight_1", "region_ref_weight_2", "region_ref_weight_3")
assert len(BIAS) == len(WEIGHT) == LEVELS
# the names that are this kind's alone: the WorkItem's fields it reads, the attention processors' keyword arguments
FIELDS = ("regions", "region_embeds", "region_ref_tokens", *BIAS, *WEIGHT)
MASK_LEVEL = 128  # as job/conditions/region.py: a mask's pixels at this grey level and above are inside
INSIDE = 0.5  # a query token is inside a region when the region covers at least half of its pixels


@dataclass(frozen=True)
class Regions(Plain):
    """One batch's regions, CFG-doubled like the embeds (negative rows first), or a graph's views of the buffers."""

    embeds: torch.Tensor  # [2B, N*77, C]: the regions' prompts
    bias: tuple[torch.Tensor, ...]  # per attention level: [2B, 1, L_l, 77 + N*77] additive (0 seen, -inf not)
    levels: tuple[int, ...]  # the UNet's attention levels, one per entry of `bias` and `weight`
    ref_tokens: torch.Tensor | None = None  # [2B, M*T, C]: the regional references' tokens (with an IP-Adapter)
    weight: tuple[torch.Tensor, ...] = ()  # per level: [2B, L_l, M], each slot's scale times its region's mask
    kind: str = NAME

    def half(self, b: int) -> Regions:
        return Regions(self.embeds[b:], tuple(t[b:] for t in self.bias), self.levels,
                       None if self.ref_tokens is None else self.ref_tokens[b:], tuple(t[b:] for t in self.weight))

    def first_images(self, n: int, b: int) -> Regions:
        def rows(t: torch.Tensor) -> torch.Tensor:
            return image_rows(t, n, b)

        return Regions(rows(self.embeds), tuple(rows(t) for t in self.bias), self.levels,
                       None if self.ref_tokens is None else rows(self.ref_tokens), tuple(rows(t) for t in self.weight))

    def attention(self) -> dict[str, torch.Tensor]:
        out = {"region_embeds": self.embeds, **{BIAS[lv]: t for lv, t in zip(self.levels, self.bias)}}
        if self.ref_tokens is not None:
            out["region_ref_tokens"] = self.ref_tokens
            out.update({WEIGHT[lv]: t for lv, t in zip(self.levels, self.weight)})
        return out

    def pairs(self, value: Regions) -> list[Pair]:
        out = [(self.embeds, value.embeds), *zip(self.bias, value.bias)]
        if self.ref_tokens is not None and value.ref_tokens is not None:
            out += [(self.ref_tokens, value.ref_tokens), *zip(self.weight, value.weight)]
        return out


def pixel_mask(region: Any, width: int, height: int, masks: dict) -> torch.Tensor:
    """A region's pixels [H, W] (1 inside): its box, or its mask image resized to the frame (`masks`: decoded once)."""
    if region.mask is None:
        x, y, w, h = region.box
        out = torch.zeros(height, width)
        out[y:y + h, x:x + w] = 1
        return out
    key = (region.mask_sha256, width, height)
    if key not in masks:
        masks[key] = read_mask(region.mask, width, height)
    return masks[key]


def read_mask(path: Any, width: int, height: int) -> torch.Tensor:
    """A mask image at the frame's size, as the job half checked it (job/conditions/region.py mask_box)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        grey = im.convert("L").resize((width, height), Image.Resampling.BILINEAR)
    return torch.from_numpy((np.asarray(grey) >= MASK_LEVEL).astype("float32"))


def tokens(h: int, w: int, level: int) -> int:
    """Query tokens of an attention level for latents h x w: each down block halves a side, rounding up (a stride-2
    convolution with padding 1)."""
    for _ in range(level):
        h, w = -(-h // 2), -(-w // 2)
    return h * w


def capacity(max_pixels: int, level: int) -> int:
    """The most query tokens of a level over the sizes of at most `max_pixels` pixels (sides multiples of 8)."""
    latent = max_pixels // 64
    return max(tokens(h, latent // h, level) for h in range(1, latent + 1))


def level_masks(pixels: torch.Tensor, level: int) -> torch.Tensor:
    """Pixel masks [..., H, W] -> which query tokens of an attention level are inside [..., L] (flattened row-major,
    as the UNet flattens its image tokens): a token's 8 * 2^level pixels square (cut at the frame's edge) covered at
    least half."""
    side = 8 * 2 ** level
    covered = F.avg_pool2d(pixels.reshape(-1, 1, *pixels.shape[-2:]), side, ceil_mode=True)
    return (covered >= INSIDE).float().reshape(*pixels.shape[:-2], -1)


def regions_value(layout: Layout, dim: int, embeds: list[list[torch.Tensor]], pixels: list[torch.Tensor],
                  refs: list[list[tuple[int, torch.Tensor, float]]] | None, negative: torch.Tensor | None,
                  dtype: torch.dtype, device: torch.device) -> Regions:
    """The CFG-doubled Regions of a batch: per row, its regions' prompt embeddings (each [77, C]), their pixel masks
    [n, H, W] (n regions), and with an adapter its regional references (region index, tokens [T, C], scale) and the
    adapter's negative tokens [T, C] (the negative rows', one per filled slot, as diffusers builds them)."""
    rows, slots, t = len(embeds), layout.slots, CLIP_TOKENS
    width = layout.keys
    h, w = pixels[0].shape[-2] // 8, pixels[0].shape[-1] // 8
    region_embeds = torch.zeros(2 * rows, slots * t, dim, dtype=dtype, device=device)
    bias, weight = [], []
    level_of = {lv: [level_masks(p.to(device), lv) if p.shape[0] else None for p in pixels] for lv in layout.levels}
    for lv in layout.levels:
        length = tokens(h, w, lv)
        b = torch.full((2 * rows, 1, length, width), float("-inf"), dtype=dtype, device=device)
        b[..., :t] = 0  # the shot's prompt: seen everywhere
        for i, masks in enumerate(level_of[lv]):
            for k in range(0 if masks is None else masks.shape[0]):
                seen = masks[k].to(dtype).view(-1, 1)  # [L, 1]
                b[rows + i, 0, :, t * (1 + k):t * (2 + k)] = torch.where(seen > 0, 0.0, float("-inf")).to(dtype)
        bias.append(b)
    for i, row in enumerate(embeds):
        for k, e in enumerate(row):
            region_embeds[rows + i, k * t:(k + 1) * t] = e
    ref_tokens = None
    if refs is not None and negative is not None:
        m, tt = layout.ref_slots, negative.shape[0]
        ref_tokens = negative.new_zeros(2 * rows, m * tt, negative.shape[-1])
        for lv in layout.levels:
            weight.append(torch.zeros(2 * rows, tokens(h, w, lv), m, dtype=dtype, device=device))
        for i, row in enumerate(refs):
            if len(row) > m:
                raise ValueError(f"{len(row)} regional references in one row; at most {m}")
            for j, (k, tok, scale) in enumerate(row):
                ref_tokens[i, j * tt:(j + 1) * tt] = negative
                ref_tokens[rows + i, j * tt:(j + 1) * tt] = tok
                for n, lv in enumerate(layout.levels):
                    inside = level_of[lv][i][k].to(dtype) * scale
                    weight[n][i, :, j] = inside  # the negative rows' references weighted as the positive ones
                    weight[n][rows + i, :, j] = inside
    return Regions(region_embeds, tuple(bias), layout.levels, ref_tokens, tuple(weight))


class Reader:
    """The regions of one job's batches: their prompts encoded once per prompt and text-encoder LoRA set, their masks
    decoded once, their references encoded once per job and adapter (the adapter's cache)."""

    def __init__(self, models: Any):
        self.models = models
        self.prompts = PromptCache(models)
        self.masks: dict = {}

    def check(self, item: Any, timings: Any) -> None:
        for r in item.regions:
            if r.mask is not None:
                try:
                    pixel_mask(r, item.width, item.height, self.masks)
                except DECODE_ERRORS as e:
                    raise Unreadable("region mask", r.mask, r.mask_file, e) from e
            for ref in r.references:
                try:
                    with timings.stage("references"):
                        self._adapter().encode(ref.image, ref.sha256)
                except DECODE_ERRORS as e:
                    raise Unreadable("reference", ref.image, ref.file, e) from e

    def _adapter(self) -> Any:
        if self.models.ip_adapter is None:
            raise ModelError("a region's reference needs the job's ip_adapter, and these models were loaded without")
        return self.models.ip_adapter

    def batch(self, items: Sequence[Any], key: Any) -> Regions | None:
        """Every batch of models made for regions has them: a row without regions rides with every slot masked."""
        layout = self.models.region_layout
        if layout is None:
            if any(it.regions for it in items):
                raise ModelError("regions: these models were loaded without the regions' attention "
                                 "(load_sdxl(..., regions=SLOTS))")
            return None
        most = max(len(it.regions) for it in items)
        if most > layout.slots:
            raise ModelError(f"regions: a shot with {most} regions, on models loaded for {layout.slots} "
                             f"(load_sdxl(..., regions={most}))")
        m = self.models
        lora_key = tuple((f.sha256, s) for f, s in items[0].loras)  # one LoRA set per batch: the bucket key's
        embeds = []
        for it in items:
            prompts = [r.prompt for r in it.regions]
            embeds.append(list(self.prompts.get(prompts, lora_key)[0]) if prompts else [])
        pixels = [torch.stack([pixel_mask(r, it.width, it.height, self.masks) for r in it.regions])
                  if it.regions else torch.zeros(0, it.height, it.width) for it in items]
        adapter = m.ip_adapter
        refs = None if adapter is None else [
            [(k, adapter.encode(x.image, x.sha256), x.scale) for k, r in enumerate(it.regions) for x in r.references]
            for it in items]
        return regions_value(layout, m.unet.config.cross_attention_dim, embeds, pixels, refs,
                             None if adapter is None else adapter.negative, m.dtype, m.device)


class Buffers:
    """The regions' embeddings, masks and references at the largest batch and size: every graph reads views of them.
    A mask's rows are KEY_ALIGN keys apart (models/regions.py), so SDPA reads its views without a copy."""

    def __init__(self, models: Any, max_batch: int, max_pixels: int):
        layout, dev, dtype = models.region_layout, models.device, models.dtype
        rows, c = 2 * max_batch, models.unet.config.cross_attention_dim
        self.layout = layout
        self.embeds = torch.zeros(rows, layout.slots * CLIP_TOKENS, c, device=dev, dtype=dtype)
        most = {lv: capacity(max_pixels, lv) for lv in layout.levels}  # flat: each size views its own length
        self.bias = {lv: torch.zeros(rows * n * layout.padded_keys, device=dev, dtype=dtype) for lv, n in most.items()}
        adapter = models.ip_adapter
        self.ref_tokens = None if adapter is None else torch.zeros(rows, layout.ref_slots * adapter.tokens,
                                                                   adapter.dim, device=dev, dtype=dtype)
        self.weight = {} if adapter is None else {lv: torch.zeros(rows * n * layout.ref_slots, device=dev,
                                                                  dtype=dtype) for lv, n in most.items()}

    def view(self, key: Any) -> Regions:
        rows, lay = 2 * key.batch, self.layout
        length = {lv: tokens(key.height // 8, key.width // 8, lv) for lv in lay.levels}
        bias = tuple(self.bias[lv][:rows * length[lv] * lay.padded_keys].view(rows, 1, length[lv], lay.padded_keys)
                     [..., :lay.keys] for lv in lay.levels)
        weight = tuple(self.weight[lv][:rows * length[lv] * lay.ref_slots].view(rows, length[lv], lay.ref_slots)
                       for lv in lay.levels) if self.weight else ()
        return Regions(self.embeds[:rows], bias, lay.levels,
                       None if self.ref_tokens is None else self.ref_tokens[:rows], weight)


def synthetic(models: Any, batch: int, width: int, height: int, bits: int) -> Regions | None:
    """Every row with every slot filled (random prompts, boxes side by side: the kernels are the same for any)."""
    layout = models.region_layout
    if layout is None:
        return None
    g = torch.Generator("cpu").manual_seed(0)
    c = models.unet.config.cross_attention_dim
    embeds = [[torch.randn(CLIP_TOKENS, c, generator=g).to(models.device, models.dtype)
               for _ in range(layout.slots)]] * batch
    strip = torch.zeros(layout.slots, height, width)
    for k in range(layout.slots):
        strip[k, :, k * width // layout.slots:(k + 1) * width // layout.slots] = 1
    adapter = models.ip_adapter
    refs = None
    if adapter is not None:
        tok = torch.randn(adapter.tokens, adapter.dim, generator=g).to(models.device, models.dtype)
        refs = [[(k, tok, 0.6) for k in range(min(layout.slots, layout.ref_slots))]] * batch
    return regions_value(layout, c, embeds, [strip] * batch, refs, None if adapter is None else adapter.negative,
                         models.dtype, models.device)


TAG = "regions"  # a UNet artifact built with the regions' inputs (Export.artifact): "regions<slots>", and with an
# IP-Adapter "regions<slots>x<reference slots>x<tokens>", its regional references' slots and tokens per image


def artifact(models: Any) -> str:
    """The tag of the UNet artifacts these models' regions want: their slot count and, with an adapter, the regional
    reference slots and its tokens per image name the inputs' widths."""
    layout = models.region_layout
    if layout is None:
        return ""
    adapter = models.ip_adapter
    return f"{TAG}{layout.slots}" + ("" if adapter is None else f"x{layout.ref_slots}x{adapter.tokens}")


def _parse(tag: str) -> tuple[int, int, int]:
    """(slots, reference slots, the adapter's tokens per image: 0 and 0 without one)."""
    slots, *refs = (int(n) for n in tag.removeprefix(TAG).split("x"))
    ref_slots, tokens = refs or (0, 0)
    return slots, ref_slots, tokens


def prepare_export(unet: Any, tag: str) -> None:
    """The regions' processors into a UNet a build made (an adapter's, put in first, stay: they take regions too)."""
    slots, ref_slots, _ = _parse(tag)
    install(unet, slots, ref_slots)


def export_inputs(unet: Any, tag: str, rows: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """The regions' inputs of an exported UNet: views of the static buffers at `rows` (CFG-doubled) and this size, the
    masks' rows KEY_ALIGN keys apart as every graph hands them over; every key seen (values do not matter)."""
    from types import SimpleNamespace

    slots, ref_slots, tokens = _parse(tag)
    p = next(unet.parameters())
    adapter = SimpleNamespace(tokens=tokens, dim=unet.config.cross_attention_dim) if tokens else None
    models = SimpleNamespace(region_layout=Layout.of(unet, slots, ref_slots), device=p.device, dtype=p.dtype,
                             unet=unet, ip_adapter=adapter)
    view = Buffers(models, rows // 2, height * width).view(SimpleNamespace(batch=rows // 2, height=height, width=width))
    view.embeds.normal_()
    if view.ref_tokens is not None:
        view.ref_tokens.normal_()
    return view.attention()


KIND = Kind(NAME, FIELDS, lambda models: Reader(models),
            lambda models, max_batch, max_pixels: None if models.region_layout is None else Buffers(models, max_batch,
                                                                                               max_pixels),
            synthetic, export=Export(TAG, artifact, prepare_export, export_inputs))
