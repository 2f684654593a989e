"""IP-Adapter for SDXL (a reference image per character): the adapter's weights loaded, its attention processors put
into the UNet, and reference images encoded into the image tokens those processors read.

- `load_ip_adapter(spec, image_encoder, unet, device, dtype)` -> `IpAdapter`: h94's base SDXL adapters (bigG or
  ViT-H image encoder, ImageProjection) and plus adapters (the Resampler on the encoder's penultimate hidden states),
  from a folder in h94's layout, a file, or a preset (`tiny`, `tiny-plus`: saved by models/tiny.py and read back as
  a folder is; `sdxl-random`, `sdxl-random-plus`: SDXL-sized random weights drawn on the device, for timing). The
  state dict is read and converted as diffusers' IPAdapterMixin.load_ip_adapter reads it; the UNet keeps no
  `encoder_hid_proj`: the engine projects the tokens (`IpAdapter.encode`) and hands them to every step.
- The processors: `RowScaledIpProcessor` on every cross-attention layer computes diffusers' AttnProcessor2_0 and,
  given `ref_tokens` [R, S*T, C], `ref_scale` [R, 1, 1] and `ref_mask` [R, 1, 1, S*T] or None (additive, in the
  query's dtype: 0 for a filled slot's tokens, -inf for an empty slot's) through cross_attention_kwargs,
  adds `ref_scale * SDPA(q, to_k_ip(ref_tokens), to_v_ip(ref_tokens), ref_mask)` as IPAdapterAttnProcessor2_0 adds
  one adapter's: each row its own references (S slots of T tokens each, an empty slot masked -inf) and its own scale.
  No host sync and no branch on a tensor's value: CUDA graphs capture them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from storyboard_cli.errors import BadInput, ModelError, one_line
from storyboard_cli.job.adapter_files import (PROJECTION_IN, AdapterFileError, adapter_files, adapter_kind, ip_key,
                                              weight_mismatch)
from storyboard_cli.job.conditions.reference import REFERENCE_SLOTS  # the job's limit: a row's image slots
from storyboard_cli.job.digests import SHORT, weights_digest
from storyboard_cli.job.preflight import ADAPTER_PRESETS
from storyboard_cli.models.regions import RegionProcessor, pick, attend, masked_references
from storyboard_cli.models.tiny import cache_root, h94_adapter, tiny_adapter_folder

REFERENCES = "references"  # cache_root()/references/<digest>/<sha256>.safetensors: one reference's tokens per dtype
# SDXL-sized random presets (GPU timing): h94's image encoders' configs (sdxl_models/image_encoder: OpenCLIP bigG;
# models/image_encoder: ViT-H) and the plus adapter's Resampler width
SDXL_ENCODERS = {
    "base": dict(hidden_size=1664, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=16,
                 image_size=224, patch_size=14, projection_dim=1280, hidden_act="gelu", layer_norm_eps=1e-5),
    "plus": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                 image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5),
}
SDXL_RESAMPLER_WIDTH = 1280  # ip-adapter-plus_sdxl_vit-h: 20 heads of 64


class RowScaledIpProcessor(torch.nn.Module):
    """A cross-attention layer's processor: diffusers' AttnProcessor2_0 for the text (with the regions' keys and mask
    where given: models/regions.py), plus the image tokens' attention of IPAdapterAttnProcessor2_0 for one adapter with
    a scale and a key mask per row, and the regional references' (each slot weighted by its region's mask)."""

    def __init__(self, hidden: int, cross: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.to_k_ip = torch.nn.Linear(cross, hidden, bias=False, device=device, dtype=dtype)
        self.to_v_ip = torch.nn.Linear(cross, hidden, bias=False, device=device, dtype=dtype)

    # __call__, not forward: diffusers' Attention reads the processor's keyword arguments from its __call__
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 ref_tokens=None, ref_scale=None, ref_mask=None, region_embeds=None, region_bias_0=None,
                 region_bias_1=None, region_bias_2=None, region_bias_3=None, region_ref_tokens=None,
                 region_ref_weight_0=None, region_ref_weight_1=None, region_ref_weight_2=None,
                 region_ref_weight_3=None):
        queries = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
        bias = pick(queries, region_bias_0, region_bias_1, region_bias_2, region_bias_3, dim=2)
        weight = pick(queries, region_ref_weight_0, region_ref_weight_1, region_ref_weight_2, region_ref_weight_3,
                       dim=1)

        def add(query: torch.Tensor, batch_size: int, head_dim: int) -> torch.Tensor | None:
            out = None
            if ref_tokens is not None:
                # as IPAdapterAttnProcessor2_0 for one adapter without masks: several images' tokens in one softmax
                # (ref_mask keeps an empty slot's out), scaled per row; a row at scale 0 adds 0 (its mask must leave
                # a key unmasked: a row of -inf only would make NaN, and 0 * NaN stays NaN)
                ip_key = self.to_k_ip(ref_tokens).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                ip_value = self.to_v_ip(ref_tokens).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                ip = F.scaled_dot_product_attention(query, ip_key, ip_value, attn_mask=ref_mask, dropout_p=0.0,
                                                    is_causal=False)
                ip = ip.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
                out = ref_scale.to(query.dtype) * ip
            if region_ref_tokens is not None and weight is not None:
                # as IPAdapterAttnProcessor2_0 with ip_adapter_masks: each reference its own softmax, times its
                # region's mask and its scale (`weight`)
                k = self.to_k_ip(region_ref_tokens).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                v = self.to_v_ip(region_ref_tokens).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
                masked = masked_references(query, k, v, weight, weight.shape[-1])
                out = masked if out is None else out + masked
            return out

        return attend(attn, hidden_states, encoder_hidden_states, attention_mask, temb, region_embeds, bias, add)


@dataclass
class IpAdapter:
    spec: str  # as the job wrote it ("tiny", a folder, a file)
    kind: str  # "base" (ImageProjection on image_embeds) or "plus" (Resampler on the encoder's hidden_states[-2])
    tokens: int  # image tokens per reference after projection (4 base, 16 plus)
    dim: int  # their width: the UNet's cross_attention_dim
    digest: str  # short hex digest of the adapter + image-encoder weights (the reference cache's key)
    encoder: Any  # CLIPVisionModelWithProjection
    projection: Any  # diffusers ImageProjection / IPAdapterPlusImageProjection
    negative: torch.Tensor  # [tokens, dim]: the unconditional half's tokens, as diffusers makes them
    image_processor: Any = None  # transformers CLIPImageProcessor, as IPAdapterMixin makes it for the encoder
    encode_ms: float = 0.0  # time spent encoding references (cache misses), all told
    encoded: int = 0  # how many references the encoder ran for
    _memory: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return self.negative.device

    @property
    def slots(self) -> int:
        """A row's image slots (the job's limit, REFERENCE_SLOTS): the step's references are this many images' tokens
        per row, the empty ones masked."""
        return REFERENCE_SLOTS

    @property
    def dtype(self) -> torch.dtype:
        return self.negative.dtype

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] -> the projected tokens [N, tokens, dim]."""
        return _project(self.kind, self.encoder, self.projection, pixels.to(self.device))

    def encode(self, image: Path, sha256: str) -> torch.Tensor:
        """One reference's projected tokens [tokens, dim] in the model dtype on the device; cached in memory and on
        disk (cache_root()/references/<digest>/<sha256>.safetensors, one entry per dtype)."""
        if sha256 in self._memory:
            return self._memory[sha256]
        from safetensors.torch import load_file, save_file

        path = cache_root() / REFERENCES / self.digest / f"{sha256}.safetensors"
        name = str(self.dtype).removeprefix("torch.")
        stored: dict[str, torch.Tensor] = {}
        if path.is_file():
            try:
                stored = load_file(path)
            except Exception:  # noqa: BLE001 - a torn or foreign file: encode again and replace it
                stored = {}
        if name not in stored:
            stored[name] = self._encode(Path(image)).cpu()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".ref-", dir=path.parent)
            os.close(fd)
            try:
                save_file({k: v.contiguous() for k, v in stored.items()}, tmp)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        tokens = stored[name].to(self.device)
        self._memory[sha256] = tokens
        return tokens

    def _encode(self, image: Path) -> torch.Tensor:
        from PIL import Image

        start = time.perf_counter()
        try:
            with Image.open(image) as im:
                rgb = im.convert("RGB")
        except (OSError, ValueError) as e:
            raise BadInput(f"{image}: cannot read the reference image ({one_line(e)})") from None
        pixels = self.image_processor(images=rgb, return_tensors="pt").pixel_values  # [1, 3, S, S]
        tokens = self.project(pixels)[0]
        if tokens.device.type == "cuda":
            torch.cuda.synchronize(tokens.device)
        self.encode_ms += (time.perf_counter() - start) * 1000
        self.encoded += 1
        return tokens


@torch.no_grad()
def _project(kind: str, encoder, projection, pixels: torch.Tensor) -> torch.Tensor:
    """pixel_values [N, 3, S, S] -> projected tokens [N, tokens, dim], as diffusers' encode_image then the UNet's
    MultiIPAdapterImageProjection (each image on its own)."""
    pixels = pixels.to(encoder.dtype)
    if kind == "base":
        embeds = encoder(pixels).image_embeds  # [N, projection_dim]
    else:
        embeds = encoder(pixels, output_hidden_states=True).hidden_states[-2]  # [N, 1 + patches, hidden]
    return projection(embeds)


def _state_dict(weights: Path) -> dict[str, torch.Tensor]:
    """h94's flat keys (`image_proj.*`, `ip_adapter.*`), as IPAdapterMixin.load_ip_adapter reads either format."""
    if weights.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(("image_proj.", "ip_adapter."))}
    nested = torch.load(weights, map_location="cpu", weights_only=True)
    if not isinstance(nested, dict) or not {"image_proj", "ip_adapter"} <= nested.keys():
        raise AdapterFileError(f"{weights.name}: not an IP-Adapter file (no image_proj and ip_adapter in it)")
    return {f"{part}.{k}": v for part in ("image_proj", "ip_adapter") for k, v in nested[part].items()}


def _cross_attention(unet) -> list[tuple[str, Any]]:
    """(name, Attention) of every layer that gets an adapter, in attn_processors' order (diffusers' key order)."""
    return [(n.removesuffix(".processor"), unet.get_submodule(n.removesuffix(".processor")))
            for n in unet.attn_processors if not n.endswith("attn1.processor")]


def _random(kind: str, unet, device: torch.device, dtype: torch.dtype) -> tuple[dict, Any]:
    """sdxl-random(-plus): h94-shaped weights for `unet` and an SDXL-sized image encoder, drawn on the device."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = SDXL_ENCODERS[kind]
    torch.manual_seed(2)
    with torch.device(device):
        encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**config)).to(dtype)
        layers = [(a.to_k.out_features, a.to_k.in_features) for _, a in _cross_attention(unet)]
        embed = config[PROJECTION_IN[kind][1]]
        weights = h94_adapter(kind, layers, embed, unet.config.cross_attention_dim, SDXL_RESAMPLER_WIDTH)
    return weights, encoder


def _read(spec: str, image_encoder: str | None, unet, device, dtype) -> tuple[str, dict, Any, str]:
    """(name for messages, h94 state dict, image encoder, digest) of what `spec` names."""
    from transformers import CLIPVisionModelWithProjection

    if spec in ADAPTER_PRESETS and spec.startswith("sdxl-random"):
        weights, encoder = _random(ADAPTER_PRESETS[spec], unet, device, dtype)
        return spec, weights, encoder, hashlib.sha256(spec.encode()).hexdigest()[:SHORT]
    if spec in ADAPTER_PRESETS:
        files = adapter_files(str(tiny_adapter_folder(ADAPTER_PRESETS[spec])), None)
    else:
        files = adapter_files(spec, image_encoder)
    name = files.weights.name
    try:
        weights = _state_dict(files.weights)
    except AdapterFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read user-provided weights is reported in one line
        raise ModelError(f"ip_adapter: {name}: cannot load it: {one_line(e)}") from e
    try:
        encoder = CLIPVisionModelWithProjection.from_pretrained(str(files.encoder), dtype=dtype).to(device)
    except Exception as e:  # noqa: BLE001 - likewise
        raise ModelError(f"ip_adapter: {name}: its image encoder {files.encoder} does not load: {one_line(e)}") from e
    both = f"{weights_digest(str(files.weights))}:{weights_digest(str(files.encoder))}"
    return name, weights, encoder, hashlib.sha256(both.encode()).hexdigest()[:SHORT]


def install_processors(unet, device: torch.device, dtype: torch.dtype) -> list[RowScaledIpProcessor]:
    """The adapter's processors put into `unet` (its weights not set: the loader copies them in, a kernel build
    compiles none): one per cross-attention layer in diffusers' order, returned in it."""
    plain = RegionProcessor()  # stateless: one for every self-attention layer (AttnProcessor2_0's, taking the kwargs)
    processors = {n: plain for n in unet.attn_processors}
    made = []
    for n, attn in _cross_attention(unet):
        made.append(RowScaledIpProcessor(attn.to_k.out_features, attn.to_k.in_features, device, dtype))
        processors[f"{n}.processor"] = made[-1].requires_grad_(False)
    unet.set_attn_processor(processors)
    return made


def load_ip_adapter(spec: str, image_encoder: str | None, unet, device, dtype) -> IpAdapter:
    """Loads the adapter, installs the row-scaled attention processors into `unet` (in place) and returns the
    IpAdapter. Raises ModelError (one line, naming the file; for a weight that does not fit: the layer and both
    shapes) on failure."""
    from transformers import CLIPImageProcessor

    device = torch.device(device)
    try:
        name, weights, encoder, digest = _read(spec, image_encoder, unet, device, dtype)
        kind = adapter_kind(name, list(weights))
    except AdapterFileError as e:
        raise ModelError(f"ip_adapter: {e}") from None
    encoder.eval().requires_grad_(False)
    layers = _cross_attention(unet)
    shapes = {k: list(v.shape) for k, v in weights.items()}
    mismatch = weight_mismatch(name, kind, shapes, [(n, tuple(a.to_k.weight.shape)) for n, a in layers],
                               encoder.config.to_dict())
    if mismatch:
        raise ModelError(f"ip_adapter: {mismatch}")
    try:
        proj = {k.removeprefix("image_proj."): v for k, v in weights.items() if k.startswith("image_proj.")}
        with torch.device(device):
            projection = unet._convert_ip_adapter_image_proj_to_diffusers(proj, low_cpu_mem_usage=False)
    except Exception as e:  # noqa: BLE001 - the converter's KeyError / size mismatch, in one line
        raise ModelError(f"ip_adapter: {name}: its image projection does not load: {one_line(e)}") from e
    projection.to(device=device, dtype=dtype).eval().requires_grad_(False)

    with torch.no_grad():
        for k, proc in enumerate(install_processors(unet, device, dtype)):
            proc.to_k_ip.weight.copy_(weights[ip_key(k, "to_k_ip")])
            proc.to_v_ip.weight.copy_(weights[ip_key(k, "to_v_ip")])

    size = encoder.config.image_size
    with torch.no_grad():
        if kind == "base":  # as diffusers' encode_image: zeros in place of the image embedding
            negative = projection(torch.zeros(1, encoder.config.projection_dim, device=device, dtype=dtype))[0]
        else:  # the encoder's hidden states for all-zero pixel_values, as encode_image's uncond_image_enc_hidden_states
            negative = _project(kind, encoder, projection, torch.zeros(1, 3, size, size, device=device))[0]
    return IpAdapter(spec, kind, negative.shape[0], negative.shape[1], digest, encoder, projection, negative,
                     CLIPImageProcessor(size=size, crop_size=size))
