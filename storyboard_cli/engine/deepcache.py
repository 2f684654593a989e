"""DeepCache (Ma et al., CVPR 2024; horseee/DeepCache) on the diffusers SDXL UNet: the two step kinds.

Branch K pairs down block K with up block U = len(up_blocks) - 1 - K. A full step runs the whole UNet
and writes the hidden state entering up block U (the deep path's output, "the feature") into a static
buffer; a shallow step runs only the time embedding, conv_in and down blocks 0..K, takes the cached
feature as the input of up block U with its own fresh skip connections, and runs up blocks U.. and the
output convolution. The feature changes slowly between adjacent steps, which is what DeepCache bets on.

Both are written against diffusers' UNet2DConditionModel.forward (0.42) and call its own submodules, so
LoRA weights written in place reach them as they reach the full UNet.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def up_block(unet, branch: int) -> int:
    """The up block that reads the cached feature for `branch` (ValueError if the UNet has no such branch)."""
    n = len(unet.up_blocks)
    if not 0 <= branch < n:
        raise ValueError(f"DeepCache branch {branch} does not exist in this UNet (branches 0-{n - 1})")
    return n - 1 - branch


def feature_shape(unet, rows: int, h: int, w: int, branch: int) -> tuple[int, int, int, int]:
    """The cached feature's shape for latents [rows, 4, h, w]: what up block U receives as hidden states."""
    up_block(unet, branch)
    channels = unet.config.block_out_channels
    c = channels[min(branch + 1, len(channels) - 1)]  # the previous up block's output, or the mid block's
    return rows, c, h >> branch, w >> branch


def feature_capacity(unet, rows: int, latent_pixels: int) -> int:
    """Elements that hold the feature of any branch for up to `rows` rows of up to `latent_pixels` (h x w):
    branch k has C_k channels over (h*w) / 4**k pixels."""
    return max(rows * feature_shape(unet, 1, 1, 1, k)[1] * latent_pixels // 4**k for k in range(len(unet.up_blocks)))


@contextmanager
def writing_feature(unet, branch: int, feature: torch.Tensor):
    """Within the block, every call of the full UNet copies the hidden states entering up block U into
    `feature` (a pre-hook: the full step's kernels stay exactly those of a plain step, plus one copy)."""

    def keep(module, args, kwargs):
        feature.copy_(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    handle = unet.up_blocks[up_block(unet, branch)].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def shallow_unet(unet, latents, t, embeds, pooled, time_ids, feature: torch.Tensor, branch: int,
                 attention: dict | None = None) -> torch.Tensor:
    """The UNet's shallow path on a cached feature: eps [rows, 4, h, w]. Mirrors UNet2DConditionModel.forward
    for what SDXL uses (no class labels, masks or ControlNet residuals; the attention processors' keyword arguments,
    `attention` (engine/conditions/kind.py Conditions.attention: an IP-Adapter's tokens), reach the cross-attention
    blocks as forward's cross_attention_kwargs do)."""
    u = up_block(unet, branch)
    # as forward: the time and added (text_time) embeddings
    t_emb = unet.get_time_embed(sample=latents, timestep=t)
    emb = unet.time_embedding(t_emb, None)
    aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=embeds,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})
    emb = emb + aug if aug is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    sample = unet.conv_in(latents)
    skips = (sample,)
    for block in unet.down_blocks[: branch + 1]:
        if getattr(block, "has_cross_attention", False):
            sample, res = block(hidden_states=sample, temb=emb, encoder_hidden_states=embeds,
                                cross_attention_kwargs=attention)
        else:
            sample, res = block(hidden_states=sample, temb=emb)
        skips += res
    need = sum(len(b.resnets) for b in unet.up_blocks[u:])
    skips = skips[:need]  # down block K's downsampled output feeds only the deep path
    sample = feature
    for block in unet.up_blocks[u:]:
        res, skips = skips[-len(block.resnets):], skips[: -len(block.resnets)]
        if getattr(block, "has_cross_attention", False):
            sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res, encoder_hidden_states=embeds,
                           upsample_size=None, cross_attention_kwargs=attention)
        else:
            sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res, upsample_size=None)
    if unet.conv_norm_out:
        sample = unet.conv_act(unet.conv_norm_out(sample))
    return unet.conv_out(sample)
