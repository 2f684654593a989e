"""Synthetic LoRA files, written as trainers write them, from random low-rank factors: for `bcg bench`'s LoRA part
(SDXL-sized, to time swaps and a job with LoRAs), which needs them at run time, so they ship with the bench; the
tests (tiny preset) and `benchmarks/loras.py` (the committed example, swap timing) read them from here too.

- Kohya / A1111 (sd-scripts' SDXL networks): `lora_unet_<sgm block name>` and `lora_te1_` / `lora_te2_`
  keys, `.lora_down.weight`, `.lora_up.weight` and `.alpha` per layer; LoCon adds the resnets' convolutions.
- PEFT (diffusers' save_lora_weights): `unet.<module>.lora_A.weight` / `.lora_B.weight`, optionally
  with diffusers' `lora_adapter_metadata` (the LoraConfig: r, lora_alpha).

The factors are recorded by the model's own module names, so a test can check where they land.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from storyboard_cli.job.unet_layers import sgm_name

TE_LAYERS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
CONV_LAYERS = ("conv1", "conv2")
Factors = dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]  # (component, module) -> (down, up)


def unet_targets(unet, convs: bool = False) -> list[str]:
    """Every linear layer of the transformer blocks (as sd-scripts' default LoRA), plus the resnets'
    3x3 convolutions for LoCon."""
    names = [n for n, m in unet.named_modules()  # not the fused projections made for compiled kernels:
             if ".attentions." in n and isinstance(m, torch.nn.Linear)  # no LoRA file names them (their
             and not n.endswith((".to_qkv", ".to_kv"))]  # to_q/to_k/to_v, views into them, are listed)
    if convs:
        names += [n for n, m in unet.named_modules()
                  if ".resnets." in n and n.endswith(CONV_LAYERS) and isinstance(m, torch.nn.Conv2d)]
    return names


def te_targets(encoder) -> list[str]:
    return [n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(TE_LAYERS)]


def random_factors(models, seed: int, rank: int = 4, text_encoders: bool = True, convs: bool = False,
                   std: float = 0.15, relative: float | None = None) -> Factors:
    """Random (down, up) factors for every target layer, each entry N(0, std). With `relative`, std is
    chosen per layer so that up @ down has entries of `relative` x the layer's weight std, as a trained
    LoRA's update is small beside the weights (on SDXL's weights a fixed std would swamp them)."""
    g = torch.Generator().manual_seed(seed)
    parts = [("unet", models.unet, unet_targets(models.unet, convs))]
    if text_encoders:
        parts += [("text_encoder", models.text_encoders[0], te_targets(models.text_encoders[0])),
                  ("text_encoder_2", models.text_encoders[1], te_targets(models.text_encoders[1]))]
    out: Factors = {}
    for component, root, names in parts:
        for name in names:
            w = root.get_submodule(name).weight
            down_shape = (rank, *w.shape[1:])
            up_shape = (w.shape[0], rank, 1, 1) if w.dim() == 4 else (w.shape[0], rank)
            if relative is not None:  # an entry of up @ down sums `rank` products: std_u * std_d * sqrt(rank)
                std = (relative * w.detach().float().std().item() / rank ** 0.5) ** 0.5
            out[(component, name)] = (torch.randn(down_shape, generator=g) * std,
                                      torch.randn(up_shape, generator=g) * std)
    return out


def kohya_state(factors: Factors, layers_per_block: int, alpha: float,
                conv_alpha: float | None = None) -> dict[str, torch.Tensor]:
    prefix = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
    state = {}
    for (component, module), (down, up) in factors.items():
        if component == "unet":
            name = sgm_name(module, layers_per_block)
        else:  # sd-scripts names CLIP layers from text_model (transformers' flattened te1 has none)
            name = module if module.startswith("text_model.") else f"text_model.{module}"
        key = prefix[component] + name.replace(".", "_")
        state[f"{key}.lora_down.weight"] = down.contiguous()
        state[f"{key}.lora_up.weight"] = up.contiguous()
        a = conv_alpha if (conv_alpha is not None and down.dim() == 4) else alpha
        state[f"{key}.alpha"] = torch.tensor(float(a))
    return state


def save_kohya(path: Path, factors: Factors, layers_per_block: int, alpha: float,
               conv_alpha: float | None = None, metadata: dict | None = None) -> Path:
    save_file(kohya_state(factors, layers_per_block, alpha, conv_alpha), str(path), metadata=metadata)
    return path


def save_peft(path: Path, factors: Factors, lora_alpha: float | None = None) -> Path:
    """diffusers' layout; with lora_alpha, its `lora_adapter_metadata` as save_lora_weights writes it."""
    state, targets = {}, {}
    for (component, module), (down, up) in factors.items():
        name = module
        if component != "unet" and not name.startswith("text_model."):
            name = f"text_model.{name}"  # as files written before transformers flattened CLIPTextModel
        state[f"{component}.{name}.lora_A.weight"] = down.contiguous()
        state[f"{component}.{name}.lora_B.weight"] = up.contiguous()
        targets.setdefault(component, set()).add(module)
    metadata = None
    if lora_alpha is not None:
        rank = next(iter(factors.values()))[0].shape[0]
        config = {}
        for component, names in targets.items():
            config.update({f"{component}.r": rank, f"{component}.lora_alpha": lora_alpha,
                           f"{component}.target_modules": sorted(names)})
        metadata = {"lora_adapter_metadata": json.dumps(config), "format": "pt"}
    save_file(state, str(path), metadata=metadata)
    return path

