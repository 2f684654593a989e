"""LoRA files: inspected without torch (for `bcg plan`), read through diffusers' own converters,
and applied IN PLACE from pristine copies of the layers they touch.

Three rooms, one file:
- `inspect_lora(path)` reads only the safetensors header (8-byte little-endian length + JSON) and
  the tensor bytes for the hash: format, architecture, rank, A1111's hash. No torch: job/plan use it.
- `read_lora(path, unet_config)` -> LoraWeights: `StableDiffusionXLPipeline.lora_state_dict` (Kohya/A1111,
  PEFT and diffusers files), then diffusers' own key converters, as `load_lora_weights` does.
- `LoraApplier(models).apply({name: (weights, scale)})`: W = W0 + sum(scale * alpha/r * up @ down),
  in fp32, cast once, written with `param.data.copy_` into the same storage, always from W0.
  Captured graphs and compiled kernels hold pointers to those storages: they stay valid.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from storyboard_cli.errors import BadInput, ModelError
from storyboard_cli.models.tiny import TEXT_2 as TINY_TEXT_2
from storyboard_cli.models.tiny import UNET as TINY_UNET

if TYPE_CHECKING:
    import torch

    from storyboard_cli.models.loader import SdxlModels

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
    """What a job's `model:` is, without loading it: tiny, a diffusers folder's UNet config, else SDXL."""
    if model == "tiny":
        return TINY
    config = Path(model).expanduser() / "unet" / "config.json"
    try:
        width = json.loads(config.read_text()).get("cross_attention_dim")
    except (OSError, ValueError, AttributeError):
        return SDXL  # "sdxl-random", a single file, a hub id: bcg loads these as SDXL
    return CONTEXT_WIDTHS.get(width, SDXL) if isinstance(width, int) else SDXL


def architecture_mismatch(info: LoraInfo, model: str) -> str | None:
    """"a LoRA for SD 1.5, this job's model is SDXL", or None where it fits (or the file does not tell)."""
    want = model_architecture(model)
    if info.architecture is None or info.architecture == want:
        return None
    return f"a LoRA for {info.architecture}, this job's model is {want}"


def lora_problem(path: str | Path, model: str) -> str | None:
    """One line saying why `path` cannot be used with `model`, or None. For job validation (no torch)."""
    try:
        info = inspect_lora(path)
    except LoraFileError as e:
        return str(e)
    return architecture_mismatch(info, model)


# ---------------------------------------------------------------------------------------------
# The A1111 prompt syntax and infotext (no torch)

# as A1111 modules/extra_networks.re_extra_net, for the one network kind bcg reads
LORA_TAG = re.compile(r"<lora:([^:>]+)((?::[^:>]*)*)>")


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


def lora_tags(loras: Mapping[str, float]) -> str:
    """"<lora:mei:0.8> <lora:ink:0.4>": the prompt suffix A1111's infotext carries for these LoRAs."""
    return " ".join(f"<lora:{name}:{format_scale(s)}>" for name, s in loras.items())


def a1111_lora_hashes(shorthashes: Mapping[str, str]) -> str:
    """The value of A1111's `Lora hashes` entry: "mei: 0123456789ab, ink: ...". The infotext writer
    quotes it (it holds ':' and ','), as A1111's infotext_utils.quote: `Lora hashes: "mei: 0123..."`."""
    # as A1111 extra_networks_lora: the name loses ':' and ',' (remove_symbols)
    return ", ".join(f"{name.replace(':', '').replace(',', '')}: {h}" for name, h in shorthashes.items())


# ---------------------------------------------------------------------------------------------
# Reading (torch, diffusers)


@dataclass
class LoraLayer:
    component: str  # one of COMPONENTS
    module: str  # its name as diffusers' converters give it (PEFT naming), e.g. "down_blocks.1.attentions.0.proj_in"
    down: "torch.Tensor"  # [r, in] or [r, in, kh, kw]
    up: "torch.Tensor"  # [out, r] or [out, r, 1, 1]
    alpha: float  # the file's alpha for this layer (= r where it has none): the layer adds alpha/r * up @ down

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class LoraWeights:
    name: str
    path: Path
    hash: str  # LoraInfo.hash
    layers: list[LoraLayer]

    @property
    def text_encoders(self) -> bool:
        """Whether it changes the prompt embeddings (the prompt cache must know)."""
        return any(layer.component != "unet" for layer in self.layers)


def _peft_names(component: str, keys: list[str]) -> dict[str, str]:
    """new (PEFT) key -> the key lora_state_dict gave, through diffusers' own converters, as
    load_lora_into_unet / _load_lora_into_text_encoder call them. Keys only: the converters rename."""
    from diffusers.utils.state_dict_utils import (convert_state_dict_to_diffusers, convert_state_dict_to_peft,
                                                  convert_unet_state_dict_to_peft)

    names = {k: k for k in keys}
    if component == "unet":
        # as diffusers PeftAdapterMixin.load_lora_adapter: "check with first key if is not in peft format"
        if "lora_A" not in next(iter(names)):
            names = convert_unet_state_dict_to_peft(names)
        return names
    return convert_state_dict_to_peft(convert_state_dict_to_diffusers(names))


def _pattern_key(patterns, module: str) -> str:
    # as peft.utils.other.get_pattern_key (peft is not needed at run time for this one regex)
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), module)


def _alpha_rule(component: str, alphas: dict, metadata: dict | None):
    """module name, down key (lora_state_dict naming), rank -> alpha, as diffusers + PEFT scale a layer."""
    if metadata:  # a PEFT/diffusers file that carries its LoraConfig (diffusers' lora_adapter_metadata)
        config = {k.removeprefix(f"{component}."): v for k, v in metadata.items() if k.startswith(f"{component}.")}
        alpha_pattern, lora_alpha = config.get("alpha_pattern") or {}, config.get("lora_alpha")
        rslora = bool(config.get("use_rslora"))

        def rule(module: str, down_key: str, rank: int) -> float:
            alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module), lora_alpha)
            alpha = rank if alpha is None else alpha
            # PEFT's rsLoRA scales by alpha/sqrt(r): return the alpha that gives that under alpha/r
            return alpha * math.sqrt(rank) if rslora else alpha
        return rule

    def rule(module: str, down_key: str, rank: int) -> float:
        # a Kohya file's alpha per layer, under the name diffusers' _get_alpha_name gives it
        return float(alphas.get(f"{component}.{down_key.split('.lora.')[0]}.alpha", rank))
    return rule


def read_lora(name: str, path: str | Path, unet_config: Any = None) -> LoraWeights:
    """The LoRA's layers (CPU tensors, as stored), through `StableDiffusionXLPipeline.lora_state_dict`.
    `unet_config` lets diffusers map sd-scripts' SDXL block names (input_blocks...), as load_lora_weights
    passes it. Raises LoraFileError / ModelError."""
    from diffusers import StableDiffusionXLPipeline

    path = Path(path)
    info = inspect_lora(path)
    try:
        state, alphas, metadata = StableDiffusionXLPipeline.lora_state_dict(
            str(path), unet_config=unet_config, return_lora_metadata=True)
    except Exception as e:  # noqa: BLE001 - diffusers' reasons, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise ModelError(f"LoRA '{name}' ({path.name}): diffusers cannot read it: {first}") from e
    layers = []
    for component in COMPONENTS:
        part = [k.removeprefix(f"{component}.") for k in state if k.split(".", 1)[0] == component]
        if not part:
            continue
        try:
            names = _peft_names(component, part)
        except ValueError as e:  # diffusers cannot tell the naming of these keys
            raise ModelError(f"LoRA '{name}' ({path.name}): {component}: {e}") from e
        alpha_of = _alpha_rule(component, alphas or {}, metadata)
        for key, old in names.items():
            if ".lora_A." not in key:
                if ".lora_B." not in key:
                    raise ModelError(f"LoRA '{name}' ({path.name}): cannot place {component}.{old}")
                continue
            module = key.split(".lora")[0]  # as diffusers get_peft_kwargs' target_modules
            up_key = key.replace(".lora_A.", ".lora_B.")
            old_up = names.get(up_key)
            if old_up is None:
                raise ModelError(f"LoRA '{name}' ({path.name}): {component}.{old} has no up/B factor")
            down, up = state[f"{component}.{old}"], state[f"{component}.{old_up}"]
            layers.append(LoraLayer(component, module, down, up, alpha_of(module, old, down.shape[0])))
    if not layers:
        raise LoraFileError(f"{path.name}: diffusers found no UNet or text-encoder layers in it")
    return LoraWeights(name, path, info.hash, layers)


# ---------------------------------------------------------------------------------------------
# Applying in place

LoraSet = Mapping[str, tuple[LoraWeights, float]]  # name -> (weights, scale)


def set_key(active: LoraSet, text_only: bool = False) -> tuple[tuple[str, str, float], ...]:
    """A hashable identity of a LoRA set (names, file hashes, scales; zero scales left out).
    text_only: only the LoRAs that change the text encoders: the prompt cache's part of the key."""
    return tuple(sorted((n, w.hash, float(s)) for n, (w, s) in active.items()
                        if s != 0 and (w.text_encoders or not text_only)))


@dataclass
class Swap:
    before: tuple  # set_key of the set it left
    after: tuple  # set_key of the set it applied
    layers: int  # layers written
    seconds: float


@dataclass
class _Target:
    param: Any  # the module's weight Parameter: written only through .data.copy_
    w0: Any  # pristine copy: same dtype (a restore is bit-exact), on the device or in pinned CPU memory


@dataclass
class LoraApplier:
    """Puts a LoRA set into the models' weights, in place. Pristine copies (W0) of every layer any
    registered LoRA touches are taken before that layer is first written, so a set is always
    computed from W0 (no unfuse, no drift) and the empty set restores W0 bit for bit."""

    models: "SdxlModels"
    headroom: float = 0.1  # of the GPU's memory left free when deciding where W0 copies live
    swaps: list[Swap] = field(default_factory=list)
    _targets: dict[tuple[str, str], _Target] = field(default_factory=dict)
    _dirty: set[tuple[str, str]] = field(default_factory=set)  # layers that differ from W0 now
    _key: tuple = ()
    _resolved: dict[int, list[tuple[tuple[str, str], LoraLayer]]] = field(default_factory=dict)

    @property
    def active_key(self) -> tuple:
        return self._key

    def _roots(self) -> dict[str, Any]:
        m = self.models
        return {"unet": m.unet, "text_encoder": m.text_encoders[0], "text_encoder_2": m.text_encoders[1]}

    def _module(self, weights: LoraWeights, layer: LoraLayer) -> tuple[str, Any]:
        root = self._roots()[layer.component]
        name = layer.module
        # as diffusers _load_lora_into_text_encoder: transformers may flatten CLIPTextModel (no text_model)
        if layer.component != "unet" and not hasattr(root, "text_model"):
            name = name.removeprefix("text_model.")
        try:
            module = root.get_submodule(name)
        except AttributeError:
            module = None
        weight = getattr(module, "weight", None)
        if weight is None:
            raise ModelError(f"LoRA '{weights.name}' ({weights.path.name}): no layer {layer.component}.{name} "
                             f"in this model (a LoRA for another model?)")
        delta = (layer.up.shape[0], *layer.down.shape[1:])
        if layer.up.dim() == 4 and tuple(layer.up.shape[2:]) != (1, 1):
            raise ModelError(f"LoRA '{weights.name}' ({weights.path.name}): {layer.component}.{name}: "
                             f"up factors with a {tuple(layer.up.shape[2:])} kernel are not supported")
        if tuple(weight.shape) != tuple(delta) or layer.up.shape[1] != layer.down.shape[0]:
            raise ModelError(f"LoRA '{weights.name}' ({weights.path.name}): {layer.component}.{name} is "
                             f"{list(weight.shape)} in this model, the LoRA makes {list(delta)}")
        return name, weight

    def register(self, weights: LoraWeights) -> None:
        """Check every layer against the model, take W0 of layers not yet covered, move the factors
        to the device. Called by apply; call it up front for all of a job's LoRAs to fail early."""
        import torch

        if id(weights) in self._resolved:
            return
        resolved, new = [], {}
        for layer in weights.layers:
            name, param = self._module(weights, layer)
            key = (layer.component, name)
            resolved.append((key, layer))
            if key not in self._targets:
                new[key] = param
        device = self.models.device
        need = sum(p.numel() * p.element_size() for p in new.values())
        need += sum(t.numel() * t.element_size() for layer in weights.layers for t in (layer.up, layer.down))
        on_device = device.type != "cuda" or self._fits(need)
        with torch.no_grad():
            for key, param in new.items():
                # W0 is taken now: a layer not yet in _targets has never been written by us
                if on_device:
                    w0 = param.detach().clone()
                else:
                    w0 = torch.empty(param.shape, dtype=param.dtype, pin_memory=True).copy_(param)
                self._targets[key] = _Target(param, w0)
            if on_device:
                for layer in weights.layers:
                    layer.down, layer.up = layer.down.to(device), layer.up.to(device)
        self._resolved[id(weights)] = resolved

    def _fits(self, nbytes: int) -> bool:
        import torch

        free, total = torch.cuda.mem_get_info(self.models.device)
        return nbytes < free - self.headroom * total

    def apply(self, active: LoraSet) -> float:
        """Make the weights W0 + this set. Returns the seconds the swap took (0.0: already active)."""
        import torch

        key = set_key(active)
        if key == self._key:
            return 0.0
        t0 = time.perf_counter()
        terms: dict[tuple[str, str], list[tuple[LoraLayer, float]]] = {}
        for name in sorted(active):
            weights, scale = active[name]
            lo, hi = SCALE_RANGE
            if not lo <= scale <= hi:
                raise BadInput(f"LoRA '{name}': scale {scale} is outside {lo:g}..{hi:g}")
            self.register(weights)
            if scale == 0:
                continue
            for target, layer in self._resolved[id(weights)]:
                terms.setdefault(target, []).append((layer, float(scale)))
        with torch.no_grad():
            for target in self._dirty - terms.keys():
                t = self._targets[target]
                t.param.data.copy_(t.w0, non_blocking=True)  # bit-exact: W0 has the parameter's dtype
                self.models.written(t.param)
            for target, layer_terms in terms.items():
                self._write(self._targets[target], layer_terms)
        if self.models.device.type == "cuda":
            torch.cuda.synchronize(self.models.device)
        seconds = time.perf_counter() - t0
        self.swaps.append(Swap(self._key, key, len(terms.keys() | self._dirty), seconds))
        self._dirty, self._key = set(terms), key
        return seconds

    def _write(self, target: _Target, layer_terms: list[tuple[LoraLayer, float]]) -> None:
        import torch

        param = target.param
        dev = param.device
        # [out, sum r] @ [sum r, in]: every LoRA on this layer in one matmul, fp32, its scale on the up side
        ups = [layer.up.to(dev, torch.float32).flatten(1) * (scale * layer.alpha / layer.rank)
               for layer, scale in layer_terms]
        downs = [layer.down.to(dev, torch.float32).flatten(1) for layer, _ in layer_terms]
        up = ups[0] if len(ups) == 1 else torch.cat(ups, dim=1)
        down = downs[0] if len(downs) == 1 else torch.cat(downs, dim=0)
        w0 = target.w0.to(dev, torch.float32, non_blocking=True).flatten(1)
        w = torch.addmm(w0, up, down)  # W0 + sum(scale * alpha/r * up @ down)
        param.data.copy_(w.view(param.shape))  # cast once; same storage: graphs and kernels stay valid
        self.models.written(param)  # and the copies compiled kernels read (channels_last convolutions)

    def restore(self) -> float:
        """Back to W0 everywhere (the empty set)."""
        return self.apply({})

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the W0 copies hold, on the device and in pinned CPU memory (for the report)."""
        out = {"device": 0, "pinned": 0}
        for t in self._targets.values():
            place = "device" if t.w0.device == t.param.device else "pinned"
            out[place] += t.w0.numel() * t.w0.element_size()
        return out
