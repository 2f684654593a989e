"""Regional prompts inside the UNet's cross-attention (InvokeAI's form): one attention over the shot's prompt and the
regions' prompts concatenated, with an additive mask that lets each region's image tokens see only their own prompt
(the shot's prompt stays visible everywhere; an unused slot is masked everywhere), and regional IP-Adapter references
as diffusers' `ip_adapter_masks` apply them (each reference's attention output multiplied by its region's mask).

- The processors take, through cross_attention_kwargs (engine/conditions/region.py Regions.attention):
  `region_embeds` [R, N*77, C] (the regions' prompts, one 77-token slot each), `region_bias_<l>` [R, 1, L_l, 77 + N*77]
  (additive, in the query's dtype: 0 where a query token sees a key, -inf where it does not) for each attention level
  l of the UNet (queries at 1/2^l of the latent side: L_l of them), and, with an IP-Adapter, `region_ref_tokens`
  [R, M*T, C] (M reference slots of T tokens) and `region_ref_weight_<l>` [R, L_l, M] (each slot's scale times its
  region's mask; 0 for an empty slot). Each processor picks its level's tensors by its number of queries: a Python
  choice on a static shape, so CUDA graphs capture it. Without them, the step is diffusers' AttnProcessor2_0.
- `attend`: AttnProcessor2_0's computation, with the region keys and their mask, and what an adapter adds before the
  output projection (models/ip_adapter.py RowScaledIpProcessor reads it, so the adapter's processors take regions too).
- `install`: the processors put into a UNet that has no adapter's (`load_sdxl(..., regions=SLOTS)`); `Layout`: the
  attention levels of a UNet and the slots, what the engine's buffers are shaped by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AttnProcessor2_0

from storyboard_cli.models.tokenizers import CLIP_TOKENS

LEVELS = 4  # attention levels a UNet may have (SDXL's: 1 and 2, the tiny preset's: 1): region_bias_0 .. _3
KEY_ALIGN = 16  # the bias's rows are this many keys apart: SDPA's memory-efficient kernel reads them without a copy


@dataclass(frozen=True)
class Layout:
    """What the regions' buffers are shaped by: the UNet's attention levels (queries at 1/2^l of the latent side),
    the region slots (N prompts of 77 tokens) and the regional reference slots (M)."""

    levels: tuple[int, ...]
    slots: int
    ref_slots: int

    @property
    def keys(self) -> int:
        """Text keys per row: the shot's prompt, then one slot per region."""
        return CLIP_TOKENS * (1 + self.slots)

    @property
    def padded_keys(self) -> int:
        return -(-self.keys // KEY_ALIGN) * KEY_ALIGN

    @classmethod
    def of(cls, unet, slots: int, ref_slots: int) -> Layout:
        """The levels of `unet`'s cross-attention blocks (diffusers' UNet2DConditionModel: a down block's level is its
        index; the mid block's the last; up blocks mirror the down blocks)."""
        cfg = unet.config
        levels = {i for i, t in enumerate(cfg.down_block_types) if "CrossAttn" in t}
        levels |= {len(cfg.up_block_types) - 1 - i for i, t in enumerate(cfg.up_block_types) if "CrossAttn" in t}
        if "CrossAttn" in str(cfg.mid_block_type or ""):
            levels.add(len(cfg.down_block_types) - 1)
        if max(levels, default=0) >= LEVELS:
            raise ValueError(f"a UNet with attention at level {max(levels)}; regions take {LEVELS} levels")
        return cls(tuple(sorted(levels)), slots, ref_slots)


def pick(queries: int, *at_levels: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """The tensor of the level with `queries` query tokens (its size at `dim`), or None."""
    return next((t for t in at_levels if t is not None and t.shape[dim] == queries), None)


def attend(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, region_embeds=None,
           region_bias: torch.Tensor | None = None,
           add: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None = None) -> torch.Tensor:
    """diffusers' AttnProcessor2_0.__call__, with the regions' keys after the prompt's (`region_embeds`, masked by
    `region_bias`, its level's) and `add(query, batch, head_dim)`: what an adapter adds before the output projection
    ([R, L, heads * head_dim] or None)."""
    # as diffusers AttnProcessor2_0.__call__, up to the attention
    residual = hidden_states
    if attn.spatial_norm is not None:
        hidden_states = attn.spatial_norm(hidden_states, temb)
    input_ndim = hidden_states.ndim
    if input_ndim == 4:
        batch_size, channel, height, width = hidden_states.shape
        hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
    if encoder_hidden_states is not None and region_embeds is not None:
        # one key per token of the shot's prompt, then of each region's slot; the bias says which a query sees
        if region_bias is None:
            raise ValueError("the regions' keys without their mask at this attention's level")
        encoder_hidden_states = torch.cat([encoder_hidden_states, region_embeds.to(encoder_hidden_states.dtype)], 1)
        attention_mask = region_bias
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape)
    if attention_mask is not None and region_bias is None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
    query = attn.to_q(hidden_states)
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    elif attn.norm_cross:
        encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
    key = attn.to_k(encoder_hidden_states)
    value = attn.to_v(encoder_hidden_states)
    head_dim = key.shape[-1] // attn.heads
    query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)  # [R, heads, L, head_dim]
    key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                   is_causal=False)
    hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
    hidden_states = hidden_states.to(query.dtype)
    extra = add(query, batch_size, head_dim) if add is not None else None
    if extra is not None:
        hidden_states = hidden_states + extra
    # as AttnProcessor2_0, from the output projection on
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if input_ndim == 4:
        hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
    if attn.residual_connection:
        hidden_states = hidden_states + residual
    return hidden_states / attn.rescale_output_factor


def masked_references(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor,
                      slots: int) -> torch.Tensor:
    """Each reference slot's own attention, weighted per query by its region's mask and scale, summed: diffusers'
    IPAdapterAttnProcessor2_0 with ip_adapter_masks (one SDPA per image, times its downsampled mask and scale) in one
    pass. query [R, heads, L, d], key / value [R, heads, M*T, d], weight [R, L, M] -> [R, L, heads * d]."""
    r, heads, length, d = query.shape
    scores = torch.matmul(query, key.transpose(-1, -2)) * d ** -0.5  # [R, heads, L, M*T]
    probs = scores.view(r, heads, length, slots, -1).float().softmax(-1).to(query.dtype)  # one softmax per slot
    probs = probs * weight.to(query.dtype).view(r, 1, length, slots, 1)
    out = torch.matmul(probs.view(r, heads, length, -1), value)  # [R, heads, L, d]
    return out.transpose(1, 2).reshape(r, length, heads * d)


class RegionProcessor:
    """A UNet attention's processor without an adapter: diffusers' AttnProcessor2_0, and in a cross-attention the
    regions' keys and mask where given. Stateless: one serves every layer."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 region_embeds=None, region_bias_0=None, region_bias_1=None, region_bias_2=None, region_bias_3=None,
                 region_ref_tokens=None, region_ref_weight_0=None, region_ref_weight_1=None,
                 region_ref_weight_2=None, region_ref_weight_3=None, ref_tokens=None, ref_scale=None, ref_mask=None):
        if region_embeds is None or encoder_hidden_states is None:
            return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        queries = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
        bias = pick(queries, region_bias_0, region_bias_1, region_bias_2, region_bias_3, dim=2)
        return attend(attn, hidden_states, encoder_hidden_states, attention_mask, temb, region_embeds, bias)


def install(unet, slots: int, ref_slots: int) -> Layout:
    """The regions' processors put into `unet` where it has none that takes them (an IP-Adapter's processors, which are
    modules, stay: they take regions too); returns the layout its buffers are shaped by."""
    plain = RegionProcessor()
    unet.set_attn_processor({n: p if isinstance(p, torch.nn.Module) else plain
                             for n, p in unet.attn_processors.items()})
    return Layout.of(unet, slots, ref_slots)
