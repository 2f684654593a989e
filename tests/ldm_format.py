"""Writes a diffusers SDXL folder as one original-layout (.safetensors) checkpoint, for tests of the
single-file loader. The inverse of diffusers' single_file_utils conversions, for any UNet/VAE width."""

from __future__ import annotations

import torch

RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
          "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _rename(state: dict, src: str, dst: str, inner: dict | None = None) -> dict:
    out = {}
    for key, value in state.items():
        if not key.startswith(src + "."):
            continue
        rest = key[len(src) + 1:]
        for a, b in (inner or {}).items():
            if rest.startswith(a + "."):
                rest = b + rest[len(a):]
        out[f"{dst}.{rest}"] = value
    return out


def unet_to_ldm(unet) -> dict:
    sd, cfg = unet.state_dict(), unet.config
    n = cfg.layers_per_block
    out = {}
    out |= _rename(sd, "conv_in", "input_blocks.0.0")
    out |= _rename(sd, "time_embedding.linear_1", "time_embed.0") | _rename(sd, "time_embedding.linear_2", "time_embed.2")
    out |= _rename(sd, "add_embedding.linear_1", "label_emb.0.0") | _rename(sd, "add_embedding.linear_2", "label_emb.0.2")
    for i in range(len(cfg.block_out_channels)):
        for j in range(n):
            k = 1 + i * (n + 1) + j
            out |= _rename(sd, f"down_blocks.{i}.resnets.{j}", f"input_blocks.{k}.0", RESNET)
            out |= _rename(sd, f"down_blocks.{i}.attentions.{j}", f"input_blocks.{k}.1")
        out |= _rename(sd, f"down_blocks.{i}.downsamplers.0.conv", f"input_blocks.{1 + i * (n + 1) + n}.0.op")
    out |= _rename(sd, "mid_block.resnets.0", "middle_block.0", RESNET)
    out |= _rename(sd, "mid_block.attentions.0", "middle_block.1")
    out |= _rename(sd, "mid_block.resnets.1", "middle_block.2", RESNET)
    for i in range(len(cfg.block_out_channels)):
        has_attn = any(k.startswith(f"up_blocks.{i}.attentions.") for k in sd)
        for j in range(n + 1):
            k = i * (n + 1) + j
            out |= _rename(sd, f"up_blocks.{i}.resnets.{j}", f"output_blocks.{k}.0", RESNET)
            out |= _rename(sd, f"up_blocks.{i}.attentions.{j}", f"output_blocks.{k}.1")
        out |= _rename(sd, f"up_blocks.{i}.upsamplers.0.conv",
                       f"output_blocks.{i * (n + 1) + n}.{2 if has_attn else 1}.conv")
    out |= _rename(sd, "conv_norm_out", "out.0") | _rename(sd, "conv_out", "out.2")
    assert len(out) == len(sd), "unmapped UNet keys"
    return {f"model.diffusion_model.{k}": v for k, v in out.items()}


def vae_to_ldm(vae) -> dict:
    sd, cfg = vae.state_dict(), vae.config
    blocks = len(cfg.block_out_channels)
    out = {}
    for part in ("encoder", "decoder"):
        out |= _rename(sd, f"{part}.conv_in", f"{part}.conv_in") | _rename(sd, f"{part}.conv_out", f"{part}.conv_out")
        out |= _rename(sd, f"{part}.conv_norm_out", f"{part}.norm_out")
        out |= _rename(sd, f"{part}.mid_block.resnets.0", f"{part}.mid.block_1", VAE_RESNET)
        out |= _rename(sd, f"{part}.mid_block.resnets.1", f"{part}.mid.block_2", VAE_RESNET)
        attn = _rename(sd, f"{part}.mid_block.attentions.0", f"{part}.mid.attn_1", VAE_ATTN)
        out |= {k: (v[..., None, None] if k.endswith("weight") and v.ndim == 2 else v) for k, v in attn.items()}
    for i in range(blocks):
        for j in range(cfg.layers_per_block):
            out |= _rename(sd, f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", VAE_RESNET)
        out |= _rename(sd, f"encoder.down_blocks.{i}.downsamplers.0.conv", f"encoder.down.{i}.downsample.conv")
        for j in range(cfg.layers_per_block + 1):
            out |= _rename(sd, f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{blocks - 1 - i}.block.{j}",
                           VAE_RESNET)
        out |= _rename(sd, f"decoder.up_blocks.{i}.upsamplers.0.conv", f"decoder.up.{blocks - 1 - i}.upsample.conv")
    out |= _rename(sd, "quant_conv", "quant_conv") | _rename(sd, "post_quant_conv", "post_quant_conv")
    assert len(out) == len(sd), "unmapped VAE keys"
    return {f"first_stage_model.{k}": v for k, v in out.items()}


def clip_l_to_ldm(encoder) -> dict:
    sd = encoder.state_dict()
    return {"conditioner.embedders.0.transformer." + (k if k.startswith("text_model.") else f"text_model.{k}"): v
            for k, v in sd.items() if "position_ids" not in k}


def open_clip_to_ldm(encoder) -> dict:
    sd = {k.removeprefix("text_model."): v for k, v in encoder.state_dict().items()}
    p = "conditioner.embedders.1.model."
    out = {p + "positional_embedding": sd["embeddings.position_embedding.weight"],
           p + "token_embedding.weight": sd["embeddings.token_embedding.weight"],
           p + "ln_final.weight": sd["final_layer_norm.weight"], p + "ln_final.bias": sd["final_layer_norm.bias"],
           p + "text_projection": sd["text_projection.weight"].T.contiguous()}
    for i in range(encoder.config.num_hidden_layers):
        src, dst = f"encoder.layers.{i}.", f"{p}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[dst + f"attn.in_proj_{kind}"] = torch.cat([sd[src + f"self_attn.{x}_proj.{kind}"] for x in "qkv"])
            out[dst + f"attn.out_proj.{kind}"] = sd[src + f"self_attn.out_proj.{kind}"]
            out[dst + f"ln_1.{kind}"] = sd[src + f"layer_norm1.{kind}"]
            out[dst + f"ln_2.{kind}"] = sd[src + f"layer_norm2.{kind}"]
            out[dst + f"mlp.c_fc.{kind}"] = sd[src + f"mlp.fc1.{kind}"]
            out[dst + f"mlp.c_proj.{kind}"] = sd[src + f"mlp.fc2.{kind}"]
    return out


def save_single_file(models, path) -> None:
    from safetensors.torch import save_file

    state = (unet_to_ldm(models.unet) | vae_to_ldm(models.vae) | clip_l_to_ldm(models.text_encoders[0])
             | open_clip_to_ldm(models.text_encoders[1]))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
