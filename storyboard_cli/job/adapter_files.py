"""IP-Adapter files without torch: which files a job's `ip_adapter:` names, and whether they fit its model.

- `adapter_files(spec, image_encoder)`: a folder in h94/IP-Adapter's layout (one `ip-adapter*sdxl*` file in it,
  `image_encoder/` beside it; for h94's `sdxl_models/*vit-h*` files the ViT-H encoder of `../models/image_encoder`),
  or a file, with `image_encoder:` naming the encoder's folder or left to the same search.
- `adapter_kind(keys)`: "base" (ImageProjection on the encoder's image embedding) or "plus" (the Resampler on its
  penultimate hidden states), from the state dict's keys.
- `weight_mismatch`: every `to_k_ip` / `to_v_ip` weight and the image projection's widths against the UNet's
  cross-attention layers and the image encoder's config; the loader (models/ip_adapter.py) runs the same check on
  the tensors it read.
- `adapter_problem(spec, image_encoder, model)`: all of it before any model loads, for job validation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from storyboard_cli.errors import BadInput
from storyboard_cli.job.lora_files import model_configs, tensor_shapes
from storyboard_cli.job.preflight import ADAPTER_PRESETS
from storyboard_cli.job.unet_layers import unet_layers
from storyboard_cli.models.tiny import IMAGE_ENCODER_FOLDER
from storyboard_cli.models.tiny import UNET as TINY_UNET

TINY_PRESETS = ("tiny", "tiny-plus")  # saved for the tiny model's UNet; the sdxl-random ones are drawn for the UNet loaded
SUFFIXES = (".safetensors", ".bin")  # safetensors first: of a pair of the same name, it is the one read
PATTERN = "ip-adapter*sdxl*"  # h94's SDXL adapter files: ip-adapter_sdxl, ip-adapter-plus_sdxl_vit-h, ...
VIT_H = "vit-h"  # h94's sdxl_models/*vit-h* files read the ViT-H encoder of models/, not the bigG one beside them
VIT_H_ENCODER = Path("..", "models", IMAGE_ENCODER_FOLDER)
# the image projection's input: its weight, and the encoder config's width it reads, by kind
PROJECTION_IN = {"base": ("image_proj.proj.weight", "projection_dim"), "plus": ("image_proj.proj_in.weight", "hidden_size")}
# the projection's output, by kind: its weight and how many rows each of the UNet's context width takes
PROJECTION_OUT = {"base": ("image_proj.proj.weight", 4), "plus": ("image_proj.proj_out.weight", 1)}
BLOCK_ORDER = ("down_blocks.", "up_blocks.", "mid_block.")  # diffusers' attn_processors order (its module order)

Shape = tuple[int, ...]


class AdapterFileError(BadInput):
    """An IP-Adapter that cannot be used: the message says why, in one line, naming the file."""


@dataclass(frozen=True)
class AdapterFiles:
    weights: Path  # the adapter file: image_proj.* and ip_adapter.* (.safetensors) or {"image_proj", "ip_adapter"} (.bin)
    encoder: Path  # the CLIPVisionModelWithProjection folder (config.json + weights)


def _adapter_file(folder: Path) -> Path:
    found = {p.stem: p for suffix in reversed(SUFFIXES) for p in sorted(folder.glob(PATTERN + suffix)) if p.is_file()}
    if not found:
        raise AdapterFileError(f"{folder}: no IP-Adapter file in it (expected one {PATTERN}.safetensors or .bin)")
    if len(found) > 1:
        names = ", ".join(sorted(p.name for p in found.values()))
        raise AdapterFileError(f"{folder}: several IP-Adapter files ({names}): name the one to use")
    return next(iter(found.values()))


def encoder_problem(image_encoder: str, shown: str | None = None) -> str | None:
    """Why `image_encoder:` names no image encoder's folder, in one line naming it as `shown` (else as given), or
    None."""
    folder, shown = Path(image_encoder).expanduser(), shown or image_encoder
    if not folder.exists():
        return f"{shown}: no such folder (image_encoder: names the CLIP vision encoder's folder)"
    if not (folder / "config.json").is_file():
        return f"{shown}: not an image encoder folder (no config.json in it)"
    return None


def _encoder_folder(weights: Path, image_encoder: str | None) -> Path:
    if image_encoder is not None:
        problem = encoder_problem(image_encoder)
        if problem:
            raise AdapterFileError(problem)
        return Path(image_encoder).expanduser()
    beside = weights.parent / IMAGE_ENCODER_FOLDER
    candidates = [weights.parent / VIT_H_ENCODER, beside] if VIT_H in weights.name.lower() else [beside]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder.resolve()
    raise AdapterFileError(f"{weights.name}: no {IMAGE_ENCODER_FOLDER}/ with a config.json beside it "
                           f"(looked in {', '.join(str(c) for c in candidates)}); name one with image_encoder:")


def adapter_files(spec: str, image_encoder: str | None) -> AdapterFiles:
    """The adapter file and image encoder folder a path spec names. Raises AdapterFileError."""
    path = Path(spec).expanduser()
    if path.is_dir():
        weights = _adapter_file(path)
    elif path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise AdapterFileError(f"{path.name}: not an IP-Adapter file (.safetensors or .bin)")
        weights = path
    else:
        raise AdapterFileError(f"{spec}: no such file or folder (ip_adapter: names a preset "
                               f"({', '.join(ADAPTER_PRESETS)}), a folder or a file)")
    return AdapterFiles(weights, _encoder_folder(weights, image_encoder))


def adapter_kind(name: str, keys: Sequence[str]) -> str:
    """"base" or "plus", from the image projection's keys (as diffusers' _convert_ip_adapter_image_proj_to_diffusers
    tells them apart). Raises AdapterFileError for the other kinds (full face, FaceID) and for what is no adapter."""
    keys = set(keys)
    if "image_proj.proj.weight" in keys:
        return "base"
    if "image_proj.latents" in keys and "image_proj.proj_in.weight" in keys:
        return "plus"
    if not any(k.startswith("image_proj.") for k in keys) or not any(k.startswith("ip_adapter.") for k in keys):
        raise AdapterFileError(f"{name}: not an IP-Adapter file (no image_proj.* and ip_adapter.* weights)")
    raise AdapterFileError(f"{name}: an IP-Adapter of a kind bcg does not run (full-face or FaceID); "
                           f"only the base and plus SDXL adapters are read")


def cross_attention_layers(shapes: Mapping[str, Shape]) -> list[tuple[str, Shape]]:
    """(name, to_k weight shape [hidden, cross]) of every cross-attention layer (`...attn2`) of a UNet's layer table
    (job/unet_layers.py), in the order diffusers numbers the adapter's ip_adapter.{n} keys: attn_processors'."""
    layers = [(name.removesuffix(".to_k"), shape) for name, shape in shapes.items() if name.endswith(".attn2.to_k")]
    return sorted(layers, key=lambda layer: next(i for i, p in enumerate(BLOCK_ORDER) if layer[0].startswith(p)))


def ip_key(k: int, part: str) -> str:
    """The key of the k-th cross-attention layer's `part` ("to_k_ip", "to_v_ip"): diffusers' key_id, 1 + 2k (h94
    numbers self- and cross-attention layers alike, and only cross-attention has an adapter)."""
    return f"ip_adapter.{2 * k + 1}.{part}.weight"


def weight_mismatch(name: str, kind: str, shapes: Mapping[str, Sequence[int]],
                    layers: Sequence[tuple[str, Shape]], encoder_config: Mapping | None) -> str | None:
    """The first weight of the adapter (`shapes`: key -> shape, h94's keys) that does not fit the UNet's
    cross-attention `layers` (cross_attention_layers) or the image encoder (its config.json), as one line, or None."""
    present = sorted({int(k.split(".")[1]) for k in shapes if k.startswith("ip_adapter.") and k.endswith("_ip.weight")
                      and k.split(".")[1].isdigit()})
    if len(present) != len(layers):
        return (f"{name}: it has {len(present)} cross-attention layers, the model's UNet has {len(layers)} "
                f"(an adapter for another model)")
    for k, (layer, (hidden, cross)) in enumerate(layers):
        for part in ("to_k_ip", "to_v_ip"):
            key = ip_key(k, part)
            got = list(shapes.get(key, ()))
            if got != [hidden, cross]:
                what = f"is {got}" if got else "is missing"
                return f"{name}: {key} {what}, the model's {layer} needs {[hidden, cross]}"
    dim = layers[0][1][1] if layers else None
    key, rows = PROJECTION_OUT[kind]
    got = list(shapes.get(key, ()))
    if dim is not None and (len(got) != 2 or got[0] != rows * dim):
        return f"{name}: {key} is {got}, the model's cross-attention needs {rows} x {dim} = {rows * dim} rows"
    return encoder_mismatch(name, kind, shapes, encoder_config)


def encoder_mismatch(name: str, kind: str, shapes: Mapping[str, Sequence[int]], encoder_config: Mapping | None) -> str | None:
    """Whether the adapter's image projection reads what its image encoder gives (`encoder_config`: its config.json),
    as one line, or None."""
    key, width = PROJECTION_IN[kind]
    want = (encoder_config or {}).get(width)
    got = list(shapes.get(key, ()))
    if isinstance(want, int) and (len(got) != 2 or got[1] != want):
        return f"{name}: {key} is {got}, its image encoder's {width} is {want} (another image encoder)"
    return None


def given_encoder_problem(spec: str, image_encoder: str) -> str | None:
    """Why the encoder `image_encoder:` names does not serve the adapter file `spec` names (their widths), or None
    (also where the adapter itself cannot be read: `adapter_problem` says why)."""
    try:
        files = adapter_files(spec, image_encoder)
        if files.weights.suffix.lower() != ".safetensors":
            return None
        shapes = tensor_shapes(files.weights)
        config = json.loads((files.encoder / "config.json").read_text())
        return encoder_mismatch(files.weights.name, adapter_kind(files.weights.name, list(shapes)), shapes,
                                config if isinstance(config, dict) else None)
    except (BadInput, OSError, ValueError):
        return None


def _tiny_mismatch(spec: str, unet: Mapping | None) -> str | None:
    want = unet_layers(TINY_UNET)
    have = unet_layers(unet) if unet is not None else None
    if want is None or have is None:
        return None
    if cross_attention_layers(have.shapes) != cross_attention_layers(want.shapes):
        twin = "sdxl-random-plus" if ADAPTER_PRESETS[spec] == "plus" else "sdxl-random"
        return f"{spec} is made for the tiny model's UNet, not this model's; use {twin} or an adapter folder"
    return None


def adapter_problem(spec: str, image_encoder: str | None, model: str) -> str | None:
    """Why this adapter cannot work with the job's model, found before any model loads (None: it looks fine, or it
    cannot be told without loading: a .bin file, a model whose UNet config is not read here). One line."""
    unet = model_configs(model).get("unet")
    if spec in ADAPTER_PRESETS:
        return _tiny_mismatch(spec, unet) if spec in TINY_PRESETS else None
    try:
        files = adapter_files(spec, image_encoder)
        if files.weights.suffix.lower() != ".safetensors":
            return None  # a pickle: read by the loader (weights_only), not here
        shapes = tensor_shapes(files.weights)
        kind = adapter_kind(files.weights.name, list(shapes))
    except BadInput as e:
        return str(e)
    try:
        encoder_config = json.loads((files.encoder / "config.json").read_text())
    except (OSError, ValueError):
        return f"{files.encoder / 'config.json'}: not a JSON image encoder config"
    layers = unet_layers(unet) if unet is not None else None
    if layers is None:
        return None
    return weight_mismatch(files.weights.name, kind, shapes, cross_attention_layers(layers.shapes),
                           encoder_config if isinstance(encoder_config, dict) else None)
