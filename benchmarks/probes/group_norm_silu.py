"""The VAE decoder's GroupNorm and the SiLU after it in one pass of Triton, NCHW or channels_last (vae_scout.py's
`fused` and `fused_cl`; issue 41).

A decode at 1024x1024 (benchmarks/results/decode/2026-12-01-3ca5b6d-vae.json, `profile_wide_ms`) spends about 13 ms in
the GroupNorms and SiLUs around its convolutions: the statistics (2.7 ms), the normalisation and affine (`addcmul`,
6.7 ms) and the SiLU (3.4 ms), each a pass over the activations, and 9.9 ms in cuDNN's NCHW <-> NHWC conversions
around the convolutions. Here:
- `fused`: the wide GroupNorm's statistics (torch's `var_mean`), then one kernel that normalises, applies the affine
  and the SiLU: two passes where there were three (SiLU's read and write gone);
- `fused_cl`: the decoder channels_last (cuDNN's convolutions take and give NHWC: no conversions), the statistics of a
  channels_last input in a Triton kernel (each program a run of positions, all channels, per-group partial means and
  centred sums of squares combined as Chan et al. combine them), then the same one-pass normalise + affine + SiLU.
The same function as the wide GroupNorm and SiLU in float32 (the statistics in float32, combined in float64).

`fuse(decoder, channels_last)` swaps every GroupNorm of a diffusers VAE decoder for `FusedGroupNorm`, with the SiLU
inside where a resnet block or the decoder's output applies one right after it, and that SiLU then taken out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tests' torch has no Triton: torch's path below
    triton = tl = None

STATS_BLOCK_P = 32  # positions a chunk of the statistics kernel reads (all channels)
STATS_PROGRAMS = 264  # programs per image for the statistics: 2 per H200 multiprocessor
NORM_BLOCK = 4096  # elements a program of the normalising kernels writes

if triton is not None:
    @triton.jit
    def norm_nchw_kernel(x_ptr, a_ptr, b_ptr, y_ptr, HW, SILU: tl.constexpr, BLOCK: tl.constexpr):
        """y[nc, p] = f(x[nc, p] a[nc] + b[nc]), f SiLU or the identity; x, y [N C, HW] contiguous."""
        nc = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < HW
        base = nc.to(tl.int64) * HW
        y = tl.load(x_ptr + base + offs, mask=ok, other=0.0) * tl.load(a_ptr + nc) + tl.load(b_ptr + nc)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + base + offs, y, mask=ok)

    @triton.jit
    def norm_nhwc_kernel(x_ptr, a_ptr, b_ptr, y_ptr, P, C: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_P: tl.constexpr):
        """y[n, p, c] = f(x[n, p, c] a[n, c] + b[n, c]); x, y [N, P, C] contiguous (a channels_last NCHW tensor)."""
        n = tl.program_id(0)
        rp = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        rc = tl.arange(0, C)
        ok = rp[:, None] < P
        off = (n * P + rp).to(tl.int64)[:, None] * C + rc[None, :]
        a = tl.load(a_ptr + n * C + rc)
        b = tl.load(b_ptr + n * C + rc)
        y = tl.load(x_ptr + off, mask=ok, other=0.0) * a[None, :] + b[None, :]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + off, y, mask=ok)

    @triton.jit
    def stats_nhwc_kernel(x_ptr, mean_ptr, m2_ptr, P, PER_PROG, C: tl.constexpr, G: tl.constexpr,
                          BLOCK_P: tl.constexpr):
        """Per image n and program j: over positions [j PER_PROG, (j + 1) PER_PROG) of x [N, P, C] (contiguous), each
        group's mean and centred sum of squares (float32), written to mean, m2 [N, programs, G]. Chunks of BLOCK_P
        positions are combined as Chan et al. combine partial moments. PER_PROG a multiple of BLOCK_P."""
        n = tl.program_id(0)
        j = tl.program_id(1)
        rc = tl.arange(0, C)
        count = tl.zeros((G,), dtype=tl.float32)
        mean = tl.zeros((G,), dtype=tl.float32)
        m2 = tl.zeros((G,), dtype=tl.float32)
        for start in range(j * PER_PROG, (j + 1) * PER_PROG, BLOCK_P):
            rp = start + tl.arange(0, BLOCK_P)
            ok = rp < P
            x = tl.load(x_ptr + (n * P + rp).to(tl.int64)[:, None] * C + rc[None, :], mask=ok[:, None], other=0.0)
            valid = tl.sum(ok.to(tl.float32), axis=0) * (C // G)  # elements of each group in this chunk
            if valid > 0:
                x3 = tl.reshape(x, (BLOCK_P, G, C // G))
                okf = tl.reshape(tl.broadcast_to(ok[:, None], (BLOCK_P, C)).to(tl.float32), (BLOCK_P, G, C // G))
                c_mean = tl.sum(tl.sum(x3, axis=2), axis=0) / valid
                d = (x3 - c_mean[None, :, None]) * okf
                c_m2 = tl.sum(tl.sum(d * d, axis=2), axis=0)
                total = count + valid
                delta = c_mean - mean
                mean = mean + delta * (valid / total)
                m2 = m2 + c_m2 + delta * delta * (count * valid / total)
                count = total
        out = (n * tl.num_programs(1) + j) * G + tl.arange(0, G)
        tl.store(mean_ptr + out, mean)
        tl.store(m2_ptr + out, m2)


def triton_takes(x: torch.Tensor) -> bool:
    """Whether `x` takes the kernels: float32, 4 dimensions, NCHW-contiguous or channels_last, on a device Triton
    runs on (a CUDA GPU, or the CPU under Triton's interpreter: TRITON_INTERPRET=1, the smoke run)."""
    import os

    if triton is None or x.dim() != 4 or x.dtype != torch.float32:
        return False
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)


def stats(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) [N, groups] float32 of each image's groups (biased variance, as GroupNorm's)."""
    n, c, h, w = x.shape
    if x.is_contiguous():
        var, mean = torch.var_mean(x.view(n, groups, -1), dim=2, correction=0)
        return mean, var
    p = h * w
    progs = min(STATS_PROGRAMS, triton.cdiv(p, STATS_BLOCK_P))
    per = triton.cdiv(triton.cdiv(p, progs), STATS_BLOCK_P) * STATS_BLOCK_P
    progs = triton.cdiv(p, per)
    mean = torch.empty(n, progs, groups, device=x.device, dtype=torch.float32)
    m2 = torch.empty_like(mean)
    stats_nhwc_kernel[(n, progs)](x, mean, m2, p, per, C=c, G=groups, BLOCK_P=STATS_BLOCK_P, num_warps=4)
    # the programs' partial moments combined in float64: counts, their means, centred sums of squares
    counts = torch.tensor([min(per, p - i * per) * (c // groups) for i in range(progs)], device=x.device,
                          dtype=torch.float64).view(1, progs, 1)
    mean64, m264 = mean.double(), m2.double()
    total = counts.sum()
    gmean = (counts * mean64).sum(dim=1) / total
    gm2 = (m264 + counts * (mean64 - gmean[:, None, :]) ** 2).sum(dim=1)
    return gmean.float(), (gm2 / total).float()


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               silu: bool) -> torch.Tensor:
    """F.group_norm (then F.silu where `silu`) of a `triton_takes` x, in its memory format."""
    n, c, h, w = x.shape
    mean, var = stats(x, groups)
    a = torch.rsqrt(var + eps).view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
    a = a * weight if weight is not None else a
    b = -mean.view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c) * a
    b = b + bias if bias is not None else b
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(x)
    if x.is_contiguous():
        norm_nchw_kernel[(n * c, triton.cdiv(h * w, NORM_BLOCK))](x, a, b, y, h * w, SILU=silu, BLOCK=NORM_BLOCK,
                                                                 num_warps=8)
    else:
        block_p = max(1, NORM_BLOCK // c)
        norm_nhwc_kernel[(n, triton.cdiv(h * w, block_p))](x, a, b, y, h * w, C=c, SILU=silu, BLOCK_P=block_p,
                                                          num_warps=8)
    return y


class FusedGroupNorm(nn.GroupNorm):
    """nn.GroupNorm (its parameters and state dict), with the SiLU after it inside where `silu` is set."""

    silu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_takes(x) and self.num_channels % self.num_groups == 0 and _pow2(self.num_channels):
            return group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.silu)
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y


def _pow2(c: int) -> bool:
    return c & (c - 1) == 0


def fuse(decoder: nn.Module) -> int:
    """Every GroupNorm of a diffusers VAE decoder becomes a FusedGroupNorm; where a resnet block (no time embedding
    projection) or the decoder's output applies a SiLU after it, the SiLU moves inside and leaves the block (a
    block's norm2 comes straight before its SiLU unless it shifts and scales by a time embedding, which the decoder's
    do not). Returns how many norms took a SiLU."""
    from diffusers.models.resnet import ResnetBlock2D

    took = 0
    for m in decoder.modules():
        if isinstance(m, nn.GroupNorm):
            m.__class__ = FusedGroupNorm
    for m in decoder.modules():
        if (isinstance(m, ResnetBlock2D) and isinstance(m.nonlinearity, nn.SiLU) and m.time_emb_proj is None
                and m.time_embedding_norm != "scale_shift"):
            m.norm1.silu = m.norm2.silu = True
            m.nonlinearity = nn.Identity()
            took += 2
    if isinstance(getattr(decoder, "conv_act", None), nn.SiLU) and isinstance(decoder.conv_norm_out, FusedGroupNorm):
        decoder.conv_norm_out.silu = True
        decoder.conv_act = nn.Identity()
        took += 1
    return took
