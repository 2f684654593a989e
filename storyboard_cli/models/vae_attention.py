"""The VAE decoder's self-attention, on the GPU's matrix units.

SDXL's decoder has one attention block, in its middle: one head of 512 channels over every position of the latent
(16384 at 1024x1024). bcg decodes in float32 (models/loader.py), and torch's float32 attention for a head of 512
channels is its memory-efficient kernel on the plain float units: 13.4 ms of a 75 ms decode on an H200
(docs/PERFORMANCE.md, "The VAE decode"). The convolutions around it already run in TF32 (cuDNN's default).

`DecoderAttention` computes the same function with TF32's precision: query, key and value rounded to fp16 after
each is scaled by its own largest magnitude (so nothing overflows, whatever the weights), both products accumulated
and written in float32 (`torch.bmm`'s `out_dtype`), the softmax in float32 and its probabilities rounded to fp16 (as
flash attention rounds them). The query rows go through in chunks, so the logits take at most 128 MB. Only on a CUDA
device, in float32, without a mask, cross-attention or spatial norm (SDXL's decoder has none of these), and where it
gives diffusers' answer on this device and torch (`attend` checks it once, on a small input: `bmm`'s `out_dtype` came
with torch 2.8); anything else takes diffusers' own processor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 2048  # query rows at a time: 2048 x 16384 float32 logits = 128 MB


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, chunk: int = CHUNK) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for float32 [B, N, heads * d] tensors, per head: [B, N, heads * d] float32."""
    b, n, inner = q.shape
    d = inner // heads

    def split(t: torch.Tensor) -> torch.Tensor:  # [B, N, heads * d] -> [B * heads, N, d]
        return t.view(b, -1, heads, d).transpose(1, 2).reshape(b * heads, -1, d)

    q, k, v = split(q), split(k), split(v)
    sq, sk, sv = (t.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-30) for t in (q, k, v))
    q16, kt16, v16 = (q / sq).half(), (k / sk).half().transpose(1, 2), (v / sv).half()
    scale = sq * sk * d ** -0.5  # [B * heads, 1, 1]: the logits' scale, undone in float32
    out = torch.empty(b * heads, n, d, dtype=torch.float32, device=q.device)
    for i in range(0, n, chunk):
        logits = _mm(q16[:, i:i + chunk], kt16).mul_(scale)
        p = torch.softmax(logits, dim=-1).half()
        del logits
        out[:, i:i + chunk] = _mm(p, v16)
    out.mul_(sv)
    return out.view(b, heads, n, d).transpose(1, 2).reshape(b, n, inner)


def takes(hidden_states: torch.Tensor) -> bool:
    """Whether this input takes `attention`: float32 on a CUDA device (on the CPU, `bmm` has no `out_dtype`, and
    diffusers' processor is already float32 throughout)."""
    return hidden_states.is_cuda and hidden_states.dtype == torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of fp16 [B, n, m] and [B, m, p], accumulated and written in float32 (on the CPU, in float32: the tests'
    path, the same rounding of the inputs)."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


class DecoderAttention:
    """A diffusers attention processor for the VAE's `Attention` blocks (see the module's docstring)."""

    def __init__(self):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.plain = AttnProcessor2_0()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args, **kwargs):
        if not (takes(hidden_states) and hidden_states.dim() == 4 and encoder_hidden_states is None
                and attention_mask is None and attn.spatial_norm is None
                and attn.norm_q is None and attn.norm_k is None):
            return self.plain(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        residual = hidden_states
        b, c, h, w = hidden_states.shape
        # the norm over [B, C, H, W] is diffusers' over [B, C, H * W]; 4D, a channels_last decoder's (models/
        # groupnorm.py) takes its kernels, and the tokens [B, H * W, C] come out contiguous
        normed = hidden_states if attn.group_norm is None else attn.group_norm(hidden_states)
        x = normed.view(b, c, h * w).transpose(1, 2)
        out = attention(attn.to_q(x), attn.to_k(x), attn.to_v(x), attn.heads)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def attend(decoder: nn.Module) -> int:
    """Every attention block under `decoder` computes through DecoderAttention from now on (same parameters).
    Returns how many."""
    blocks = _blocks(decoder, lambda p: not isinstance(p, DecoderAttention))
    if blocks and not works_on(next(decoder.parameters()).device):
        return 0
    for a in blocks:
        a.set_processor(DecoderAttention())
    return len(blocks)


def unattend(decoder: nn.Module) -> int:
    """The inverse of `attend`: diffusers' own processor again (for a copy of the VAE that is to run as users run
    it)."""
    blocks = _blocks(decoder, lambda p: isinstance(p, DecoderAttention))
    for a in blocks:
        a.set_processor(a.processor.plain)
    return len(blocks)


def works_on(device: torch.device) -> bool:
    """Whether `attention` runs on `device` with this torch and gives the float32 attention's answer, on a small input
    (one sync, at load); on the CPU it is float32 throughout (`_mm`)."""
    if device.type != "cuda":
        return True
    try:
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(1, 300, 64, device=device, generator=g) for _ in range(3))
        ours = attention(q, k, v, 1, chunk=128)
        theirs = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return bool(((ours - theirs).norm() / theirs.norm()) < 1e-2)
    except (RuntimeError, TypeError, NotImplementedError):  # no out_dtype for bmm here
        return False


def _blocks(decoder: nn.Module, which) -> list:
    from diffusers.models.attention_processor import Attention

    return [m for m in decoder.modules() if isinstance(m, Attention) and which(m.processor)]
