"""The torch-free table of the UNet's LoRA-targetable layers (job/unet_layers.py) against the real thing:
diffusers' UNet2DConditionModel built from the same config on the meta device, and diffusers' own LoRA key
converters reading every key form the table accepts."""

import json
from functools import lru_cache

import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

from storyboard_cli.job.lora_files import SDXL_CONFIGS
from storyboard_cli.job.unet_layers import unet_layers
from storyboard_cli.models.lora import _peft_names
from storyboard_cli.models.tiny import UNET as TINY

SDXL = json.loads((SDXL_CONFIGS / "unet" / "config.json").read_text())
CONFIGS = {
    "tiny": TINY,
    "sdxl-base": SDXL,
    "diffusers-defaults": {},  # SD 1.x's shape: four blocks, convolution projections, an UpBlock2D first
    "variant": {**TINY, "use_linear_projection": False, "resnet_time_scale_shift": "scale_shift",
                "layers_per_block": (2, 1), "transformer_layers_per_block": (1, 2), "time_embedding_dim": 96,
                "cross_attention_dim": (80, 48), "attention_head_dim": (2, 3), "conv_in_kernel": 1},
}


@lru_cache
def _unet(name: str) -> UNet2DConditionModel:
    """The real module, built from the config on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        return UNet2DConditionModel.from_config({k: v for k, v in CONFIGS[name].items() if not k.startswith("_")})


@pytest.mark.parametrize("name", CONFIGS)
def test_the_table_is_the_real_unets_linear_and_conv_layers(name):
    layers = unet_layers(CONFIGS[name])
    assert layers is not None
    real = {n: tuple(m.weight.shape) for n, m in _unet(name).named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    assert len(real) > 80
    assert layers.shapes == real


def test_the_sdxl_table_has_sdxls_layers():
    shapes = unet_layers(SDXL).shapes
    assert len(shapes) == 794
    assert shapes["down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k"] == (1280, 2048)
    assert shapes["add_embedding.linear_1"] == (1280, 2816)
    assert shapes["up_blocks.0.resnets.2.conv_shortcut"] == (1280, 1920, 1, 1)


def _read_back(forms: dict[str, str], name: str) -> dict[str, str]:
    """Kohya layer parts -> the module diffusers' SDXL loader places each one on, as read_lora reads them
    (lora_state_dict with the UNet's config, then the PEFT renaming); each factor's value tells it apart."""
    state = {}
    for i, form in enumerate(forms):
        state[f"lora_unet_{form}.lora_down.weight"] = torch.tensor([i])
        state[f"lora_unet_{form}.lora_up.weight"] = torch.tensor([i])
    converted, _ = StableDiffusionXLPipeline.lora_state_dict(state, unet_config=_unet(name).config)
    part = {k.removeprefix("unet."): v for k, v in converted.items()}
    order = list(forms)
    return {order[int(part[old])]: new.split(".lora")[0]
            for new, old in _peft_names("unet", list(part)).items() if ".lora_A." in new}


@pytest.mark.parametrize("name", ["tiny", "sdxl-base"])
def test_every_kohya_form_reads_back_to_its_layer_through_diffusers(name):
    layers = unet_layers(CONFIGS[name])
    sgm = ("input_blocks", "middle_block", "output_blocks", "time_embed_", "label_emb", "out_2")
    for sgm_forms in (False, True):  # a file holds one block naming (diffusers drops SGM keys from a mix)
        forms = {f: m for f, m in layers.kohya.items() if f.startswith(sgm) == sgm_forms}
        assert len(forms) >= len(layers.shapes) - 2  # every layer, both namings (add_embedding: SGM only)
        assert _read_back(forms, name) == forms


def test_the_unet_prefixed_namings_resolve():
    layers = unet_layers(TINY)
    to_out = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0"
    assert layers.module("unet.down_blocks.1.attentions.0.proj_in") == "down_blocks.1.attentions.0.proj_in"
    # the old attention-processor naming: `...attn1.processor.to_out_lora.down.weight`
    assert layers.module("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_out_lora") == to_out
    assert layers.module("unet.down_blocks.1.attentions.1.proj_in") is None
    assert layers.module("lora_unet_input_blocks_3_1_proj_in") == "down_blocks.1.attentions.0.proj_in"
    assert layers.module("lora_unet_input_blocks_4_1_proj_in") is None


@pytest.mark.parametrize("change", [{"time_cond_proj_dim": 8}, {"class_embed_type": "timestep"},
                                    {"down_block_types": ["DownBlock2D", "SimpleCrossAttnDownBlock2D"]},
                                    {"_class_name": "UNet2DModel"}, {"block_out_channels": "wide"}])
def test_a_config_the_table_does_not_describe_is_left_to_the_loaded_model(change):
    assert unet_layers(TINY) is not None
    assert unet_layers({**TINY, **change}) is None
