"""LoRA weights: read through diffusers' own converters and applied IN PLACE from pristine copies of
the layers they touch. Inspecting a file without torch (for `bcg plan`) is job/lora_files.py.

- `read_lora(path, unet_config)` -> LoraWeights: `StableDiffusionXLPipeline.lora_state_dict` (Kohya/A1111,
  PEFT and diffusers files), then diffusers' own key converters, as `load_lora_weights` does.
- `LoraApplier(models).apply({name: (weights, scale)})`: W = W0 + sum(scale * alpha/r * up @ down),
  in fp32, cast once, written with `param.data.copy_` into the same storage, always from W0.
  Captured graphs and compiled kernels hold pointers to those storages: they stay valid.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from storyboard_cli.errors import BadInput, ModelError, first_line
from storyboard_cli.job.lora_files import COMPONENTS, SCALE_RANGE, LoraFileError, inspect_lora, lora_set_label

if TYPE_CHECKING:
    import torch

    from storyboard_cli.models.loader import SdxlModels


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
        first = first_line(e) or e.__class__.__name__
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

    @property
    def labels(self) -> tuple[str, str]:
        """The sets it left and applied, as people read them: ("none", "mei 0.8, ink 0.4")."""
        return tuple(lora_set_label((name, scale) for name, _, scale in key) for key in (self.before, self.after))


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
        if layer.up.shape[1] != layer.down.shape[0]:
            raise ModelError(f"LoRA '{weights.name}' ({weights.path.name}): {layer.component}.{name}: its up "
                             f"factor has rank {layer.up.shape[1]}, its down factor {layer.down.shape[0]}")
        if tuple(weight.shape) != tuple(delta):
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
            for target, layer_terms in terms.items():
                self._write(self._targets[target], layer_terms)
            # and the copies compiled kernels read (channels_last convolutions, FP8 weights): once, after every write
            self.models.written(*(self._targets[t].param for t in self._dirty | terms.keys()))
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
