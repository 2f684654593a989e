"""LoRA files without torch: what `bcg plan` and job validation need to know about a LoRA.

- `inspect_lora(path)` reads only the safetensors header (8-byte little-endian length + JSON) and the
  tensor bytes for the hash: format, architecture, rank, A1111's hash.
- `lora_problem(path, model)`: why a LoRA does not fit the job's model, from the header and the configs the
  model is built from: its architecture, then every layer's name and widths (the text encoders' from their
  configs, the UNet's from the table job/unet_layers.py derives from its config).
- The A1111 prompt syntax (`<lora:mei:0.8>`) and infotext (`Lora hashes`).
- `lora_set_label`: the one way a LoRA set is written for people (`mei 0.8, ink 0.4`, or `none`).

Reading the tensors and writing them into a model's weights (torch) is models/lora.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from storyboard_cli.errors import BadInput
from storyboard_cli.job.unet_layers import unet_layers
from storyboard_cli.models.tiny import SCHEDULER_CONFIG
from storyboard_cli.models.tiny import TEXT as TINY_TEXT
from storyboard_cli.models.tiny import TEXT_2 as TINY_TEXT_2
from storyboard_cli.models.tiny import UNET as TINY_UNET

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")  # diffusers' prefixes in a LoRA state dict
SCALE_RANGE = (-2.0, 2.0)
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# The architectures a LoRA can be for, told apart by the width of the UNet's cross-attention context
# (attn2.to_k / to_v input): SD 1.x CLIP-L 768, SD 2.x OpenCLIP-H 1024, SDXL both encoders 768 + 1280.
# The tiny preset is SDXL-shaped at toy widths: it has its own row.
SD15, SD2, SDXL, TINY = "SD 1.5", "SD 2.x", "SDXL", "tiny"
CONTEXT_WIDTHS = {768: SD15, 1024: SD2, 2048: SDXL, TINY_UNET["cross_attention_dim"]: TINY}
# widths of the text encoders' hidden states: a single encoder (SD 1.x/2.x) or the second one (SDXL)
TE1_WIDTHS = {768: SD15, 1024: SD2}
TE2_WIDTHS = {1280: SDXL, TINY_TEXT_2["hidden_size"]: TINY}

# the key endings that mark a LoRA's down (A) factor, in each format diffusers reads
DOWN_KEYS = (".lora_down.weight", ".lora_A.weight", ".lora.down.weight", "_lora.down.weight",
             ".lora_linear_layer.down.weight")
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
KOHYA_PARTS = (".lora_down.weight", ".lora_up.weight", ".alpha")
# LyCORIS variants whose weights are not up @ down (diffusers' SDXL loader does not read them)
UNSUPPORTED = {"hada_w1": "LoHa", "lokr_w1": "LoKr", "dora_scale": "DoRA", "lora_magnitude_vector": "DoRA",
               ".diff": "full-weight difference", "ia3_": "IA3"}


# ---------------------------------------------------------------------------------------------
# Inspection (no torch)


@dataclass(frozen=True)
class LoraInfo:
    path: Path
    format: str  # "kohya" (A1111 / sd-scripts: lora_unet_...), "peft" (lora_A/lora_B) or "diffusers" (lora.down/up)
    architecture: str | None  # SD15 / SD2 / SDXL / TINY; None where the file does not tell
    components: tuple[str, ...]  # which of COMPONENTS it changes
    rank: int  # the most common rank
    layers: int
    hash: str  # sha256 of the tensor bytes (everything after the header): "addnet" hash, full length
    shorthash: str  # what A1111 writes in `Lora hashes`: metadata sshs_model_hash, else the addnet hash; 12 hex

    @property
    def text_encoders(self) -> bool:
        return any(c != "unet" for c in self.components)


class LoraFileError(BadInput):
    """A LoRA file that cannot be used: the message says why, in one line, without a location."""


def _header(path: Path) -> tuple[dict, int, int]:
    """The safetensors header (JSON), its length and the file size. Raises LoraFileError."""
    if path.suffix.lower() != ".safetensors":
        raise LoraFileError(f"{path.name}: only .safetensors LoRA files are read "
                            f"(pickled .pt/.ckpt files can run code when loaded)")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoraFileError(f"{path.name}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise LoraFileError(f"{path.name}: not a safetensors file (header length {n}, file {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoraFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LoraFileError(f"{path}: is a folder, not a .safetensors file") from None
    except OSError as e:
        raise LoraFileError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoraFileError(f"{path.name}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise LoraFileError(f"{path.name}: not a safetensors file (its header is not a JSON object)")
    return header, n, size


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """A .safetensors file's tensors (name -> shape), read from its header without torch, each checked to lie inside
    the file. Raises LoraFileError (a BadInput) for a file that is not one."""
    header, n, size = _header(path)
    return _tensors(path, header, n, size)


def _tensors(path: Path, header: dict, n: int, size: int) -> dict[str, list[int]]:
    """name -> shape, after checking that every tensor lies inside the file (a cut download fails here)."""
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (start, stop) = list(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise LoraFileError(f"{path.name}: not a safetensors file (bad entry for {name!r})") from None
        shapes[name], end = shape, max(end, stop)
    if 8 + n + end > size:
        raise LoraFileError(f"{path.name}: truncated ({size} bytes, its header lists {8 + n + end})")
    return shapes


def _format(path: Path, keys: list[str]) -> str:
    for marker, kind in UNSUPPORTED.items():
        if any(marker in k for k in keys):
            raise LoraFileError(f"{path.name}: a {kind} (LyCORIS) file; only LoRA / LoCon files (up @ down) are read")
    if not keys:
        raise LoraFileError(f"{path.name}: holds no tensors")
    if all(k.startswith(tuple(KOHYA_PREFIXES)) and k.endswith(KOHYA_PARTS) for k in keys):
        return "kohya"
    if all(k.split(".", 1)[0] in COMPONENTS for k in keys):
        if any(".lora_A." in k for k in keys):
            return "peft"
        if any(k.endswith(DOWN_KEYS) for k in keys):
            return "diffusers"
    first = sorted(keys)[0]
    if first.startswith(("transformer.", "lora_transformer_", "diffusion_model.", "lora_unet_double_blocks")):
        raise LoraFileError(f"{path.name}: a LoRA for a transformer model (Flux, SD3...), not for SDXL")
    raise LoraFileError(f"{path.name}: not a LoRA file that diffusers reads for SDXL (keys like {first!r}: "
                        f"expected lora_unet_.../lora_te1_... or unet./text_encoder. keys)")


def _component(key: str) -> str:
    for prefix, component in KOHYA_PREFIXES.items():
        if key.startswith(prefix):
            return component
    return key.split(".", 1)[0]


def _architecture(shapes: dict[str, list[int]], metadata: dict) -> str | None:
    """From the down factors' input widths; the trainer's metadata only where the shapes do not tell."""
    downs = {k: s for k, s in shapes.items() if k.endswith(DOWN_KEYS) and len(s) >= 2}
    for key, shape in downs.items():
        if _component(key) == "unet" and "attn2" in key and re.search(r"to_[kv]", key):
            return CONTEXT_WIDTHS.get(shape[1], f"a model with a {shape[1]}-wide text context")
    te2 = [s[1] for k, s in downs.items() if _component(k) == "text_encoder_2" and ("q_proj" in k or "fc1" in k)]
    if te2:
        return TE2_WIDTHS.get(te2[0], f"a model with a {te2[0]}-wide second text encoder")
    te1 = [s[1] for k, s in downs.items() if _component(k) == "text_encoder" and ("q_proj" in k or "fc1" in k)]
    single_te = any(k.startswith("lora_te_") for k in shapes)  # sd-scripts names SDXL's first encoder lora_te1_
    if te1 and single_te:
        return TE1_WIDTHS.get(te1[0])
    # as A1111's NetworkOnDisk.detect_version
    base = str(metadata.get("ss_base_model_version", ""))
    if base.startswith("sdxl_"):
        return SDXL
    if str(metadata.get("ss_v2", "")) == "True":
        return SD2
    if base.startswith("sd_v1"):
        return SD15
    return None


def _addnet_hash(path: Path, n: int) -> str:
    # as A1111 modules/hashes.addnet_hash_safetensors (from sd-scripts' train_util): sha256 of the bytes
    # after the header, so editing the metadata does not change it
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(8 + n)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_INFO_CACHE: dict[tuple[str, int, int], LoraInfo] = {}


def inspect_lora(path: str | Path) -> LoraInfo:
    """Format, architecture, rank and hash of a LoRA file, without torch. Raises LoraFileError."""
    path = Path(path)
    try:
        st = path.stat()
        cache_key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        cache_key = None
    if cache_key in _INFO_CACHE:
        return _INFO_CACHE[cache_key]
    header, n, size = _header(path)
    metadata = header.get("__metadata__") or {}
    shapes = _tensors(path, header, n, size)
    keys = list(shapes)
    kind = _format(path, keys)
    ranks = Counter(s[0] for k, s in shapes.items() if k.endswith(DOWN_KEYS) and s)
    if not ranks:
        raise LoraFileError(f"{path.name}: no LoRA down/A factors in it")
    addnet = _addnet_hash(path, n)
    # as A1111 extensions-builtin/Lora/network.py NetworkOnDisk: the metadata's hash wins, first 12 hex
    short = (str(metadata.get("sshs_model_hash") or "") or addnet)[:12]
    info = LoraInfo(path, kind, _architecture(shapes, metadata),
                    tuple(c for c in COMPONENTS if any(_component(k) == c for k in keys)),
                    ranks.most_common(1)[0][0], sum(ranks.values()), addnet, short)
    if cache_key is not None:
        _INFO_CACHE[cache_key] = info
    return info


def model_architecture(model: str) -> str:
    """What a job's `model:` is, without loading it: its UNet config's context width tells; SDXL where
    there is no config to read (a hub id: bcg loads these as SDXL)."""
    width = model_configs(model).get("unet", {}).get("cross_attention_dim")
    return CONTEXT_WIDTHS.get(width, SDXL) if isinstance(width, int) else SDXL


def architecture_mismatch(info: LoraInfo, model: str) -> str | None:
    """"a LoRA for SD 1.5, this job's model is SDXL", or None where it fits (or the file does not tell)."""
    want = model_architecture(model)
    if info.architecture is None or info.architecture == want:
        return None
    return f"a LoRA for {info.architecture}, this job's model is {want}"


SDXL_CONFIGS = SCHEDULER_CONFIG.parents[1]  # the SDXL-base configs the loader ships (single files, sdxl-random)
# a CLIP layer's LoRA key, in every naming diffusers reads: layer index, module, factor
TE_LAYER = re.compile(r"layers[._](\d+)[._](self_attn[._][qkv]_proj|self_attn[._]out_proj|mlp[._]fc[12])"
                      r"[._](lora[._]down|lora_A|lora[._]up|lora_B|lora_linear_layer[._](?:down|up))")
# a UNet factor's key ending, in each naming diffusers' SDXL loader reads for the UNet -> which factor; the
# old attention-processor naming keeps `_lora` in the layer's part (`attn1.processor.to_q_lora.down.weight`)
UNET_FACTORS = {".lora_down.weight": "down", ".lora_up.weight": "up", ".lora_A.weight": "down",
                ".lora_B.weight": "up", ".lora.down.weight": "down", ".lora.up.weight": "up",
                "_lora.down.weight": "down", "_lora.up.weight": "up"}
# as diffusers' _maybe_map_sgm_blocks_to_diffusers: a Kohya file with both block namings loses its SGM keys
SGM_BLOCKS = ("input_blocks", "middle_block", "output_blocks")
DIFFUSERS_BLOCKS = ("down_blocks", "mid_block", "up_blocks")


def model_configs(model: str) -> dict[str, dict]:
    """The configs of `model`'s UNet and text encoders, by component, without loading it (tiny, a diffusers
    folder, the SDXL-base configs for sdxl-random and single files); empty for a hub id, and without a
    component whose config cannot be read (its load says why)."""
    if model == "tiny":
        return {"unet": TINY_UNET, "text_encoder": TINY_TEXT, "text_encoder_2": TINY_TEXT_2}
    path = Path(model).expanduser()
    folder = path if path.is_dir() else SDXL_CONFIGS if model == "sdxl-random" or path.is_file() else None
    configs = {}
    for component in COMPONENTS if folder else ():
        try:
            config = json.loads((folder / component / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            configs[component] = config
    return configs


def _clip_shape(config: dict, module: str) -> tuple[int, int]:
    """[out, in] of a CLIP layer's weight, from its config."""
    h, i = config["hidden_size"], config["intermediate_size"]
    return (i, h) if module.endswith("fc1") else (h, i) if module.endswith("fc2") else (h, h)


def _text_encoder_mismatch(file: str, shapes: dict[str, list[int]], configs: dict[str, dict]) -> str | None:
    """The first text-encoder layer of the LoRA that the model lacks or whose width differs, or None."""
    for key, shape in shapes.items():
        component, m = _component(key), TE_LAYER.search(key)
        if component == "unet" or component not in configs or m is None or len(shape) != 2:
            continue
        config, layer, module = configs[component], int(m[1]), re.sub(r"^(self_attn|mlp)[._]", "", m[2])
        name = f"{component} layer {layer} {module}"
        if layer >= config["num_hidden_layers"]:
            return f"{file}: {name}: this model's {component} has {config['num_hidden_layers']} layers"
        out, inp = _clip_shape(config, module)
        down = "down" in m[3] or m[3] == "lora_A"
        got, want = (shape[1], inp) if down else (shape[0], out)
        if got != want:
            return f"{file}: {name}: its {'down' if down else 'up'} factor is {got} wide, this model's layer {want}"
    return None


def _unet_factor(key: str) -> tuple[str, str] | None:
    """(the key's layer part, "down" | "up") of a UNet factor in a naming the loader reads, else None."""
    if _component(key) != "unet":
        return None
    for end, factor in UNET_FACTORS.items():
        if key.endswith(end):
            return key[: -len(end)] + ("_lora" if end.startswith("_lora") else ""), factor
    return None


def _layer_kind(kernel: tuple[int, ...]) -> str:
    return f"a {kernel[0]}x{kernel[1]} convolution" if kernel else "linear"


def _unet_mismatch(file: str, shapes: dict[str, list[int]], config: dict) -> str | None:
    """The first UNet layer of the LoRA that the model lacks or whose factor does not fit it (width, kernel),
    or None. The table is the one `config` builds (job/unet_layers.py); a config it does not describe
    leaves the UNet's layers to the loaded model, at render."""
    layers = unet_layers(config)
    if layers is None:
        return None
    factors = {key: f for key in shapes if (f := _unet_factor(key))}
    if any(k.startswith("lora_unet_") and any(p in k for p in SGM_BLOCKS) for k in factors) and \
            any(k.startswith("lora_unet_") and any(p in k for p in DIFFUSERS_BLOCKS) for k in factors):
        factors = {k: f for k, f in factors.items() if not any(p in k for p in SGM_BLOCKS)}
    for key, (part, factor) in factors.items():
        module = layers.module(part)
        if module is None:
            return f"{file}: {part}: this model's UNet has no such layer"
        weight, shape = layers.shapes[module], shapes[key]
        out, inp, kernel = weight[0], weight[1], tuple(weight[2:])
        if factor == "down":  # [rank, in] for a linear layer, [rank, in, kh, kw] for a convolution
            if len(shape) != 2 + len(kernel) or tuple(shape[2:]) != kernel:
                return f"{file}: {part}: its down factor is {list(shape)}, this model's layer is {_layer_kind(kernel)}"
            if shape[1] != inp:
                return f"{file}: {part}: its down factor is {shape[1]} wide, this model's layer {inp}"
        else:  # [out, rank] or [out, rank, 1, 1], whatever the layer
            if len(shape) not in (2, 4) or tuple(shape[2:]) not in ((), (1, 1)):
                return f"{file}: {part}: its up factor is {list(shape)}, only [out, rank] or [out, rank, 1, 1] is read"
            if shape[0] != out:
                return f"{file}: {part}: its up factor is {shape[0]} wide, this model's layer {out}"
    return None


def layer_mismatch(path: str | Path, model: str) -> str | None:
    """The first layer of the LoRA that `model` lacks or whose factor does not fit it, or None: the text
    encoders' and the UNet's, against the configs `model` is built from. A hub id's configs are not read
    before it loads: its layers are checked against the loaded model, at render."""
    configs = model_configs(model)
    if not configs:
        return None
    path = Path(path)
    shapes = tensor_shapes(Path(path))
    return (_text_encoder_mismatch(path.name, shapes, configs)
            or ("unet" in configs and _unet_mismatch(path.name, shapes, configs["unet"])) or None)


def lora_problem(path: str | Path, model: str) -> str | None:
    """One line saying why `path` cannot be used with `model`, or None. For job validation (no torch)."""
    try:
        info = inspect_lora(path)
        return architecture_mismatch(info, model) or layer_mismatch(path, model)
    except LoraFileError as e:
        return str(e)


# ---------------------------------------------------------------------------------------------
# The A1111 prompt syntax and infotext (no torch)

# as A1111 modules/extra_networks.re_extra_net, for the one network kind bcg reads; prompts copied from
# model sites also write it <LORA:...> or, for LyCORIS' LoCon files, <lyco:...>
LORA_TAG = re.compile(r"<(?:lora|lyco):([^:>]+)((?::[^:>]*)*)>", re.IGNORECASE)


def split_lora_tags(prompt: str) -> tuple[str, list[tuple[str, float]]]:
    """"a girl <lora:mei:0.8>" -> ("a girl", [("mei", 0.8)]). The tag leaves the text, as in A1111;
    a tag without a weight means 1.0. Raises ValueError (with the tag) for a weight that is not a number
    or separate text-encoder / UNet weights."""
    found: list[tuple[str, float]] = []

    def take(m: re.Match) -> str:
        name, args = m.group(1).strip(), [a for a in m.group(2).split(":")[1:]]
        if len(args) > 1:
            raise ValueError(f"{m.group(0)}: separate text-encoder / UNet weights are not supported; "
                             f"write one weight, <lora:{name}:0.8>")
        try:
            scale = float(args[0]) if args and args[0].strip() else 1.0
        except ValueError:
            raise ValueError(f"{m.group(0)}: the weight {args[0]!r} is not a number") from None
        if not math.isfinite(scale):
            raise ValueError(f"{m.group(0)}: the weight must be a finite number")
        found.append((name, scale))
        return ""

    text = LORA_TAG.sub(take, prompt)
    if found:
        text = re.sub(r"[ \t]{2,}", " ", text).strip()
    return text, found


def format_scale(scale: float) -> str:
    return f"{scale:g}"


NO_LORA = "none"  # the empty set's name: the model's own weights


def lora_set_label(pairs: Iterable[tuple[str, float | None]]) -> str:
    """The one way a LoRA set is written for people: (name, scale) pairs -> "mei 0.8, ink 0.4"; "none".
    A scale of None (a file another tool described) leaves the name alone."""
    return ", ".join(name if scale is None else f"{name} {format_scale(scale)}" for name, scale in pairs) or NO_LORA


def lora_tags(loras: Mapping[str, float]) -> str:
    """"<lora:mei:0.8> <lora:ink:0.4>": the prompt suffix A1111's infotext carries for these LoRAs."""
    return " ".join(f"<lora:{name}:{format_scale(s)}>" for name, s in loras.items())


def a1111_lora_hashes(shorthashes: Mapping[str, str]) -> str:
    """The value of A1111's `Lora hashes` entry: "mei: 0123456789ab, ink: ...". The infotext writer
    quotes it (it holds ':' and ','), as A1111's infotext_utils.quote: `Lora hashes: "mei: 0123..."`."""
    # as A1111 extra_networks_lora: the name loses ':' and ',' (remove_symbols)
    return ", ".join(f"{name.replace(':', '').replace(',', '')}: {h}" for name, h in shorthashes.items())
