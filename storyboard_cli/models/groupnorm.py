"""The VAE decoder's GroupNorm, computed with the whole GPU, the SiLU after it in the same pass, channels_last.

bcg decodes one image at a time (run/batch.py decode), and torch's GroupNorm kernel reduces each (image, group) pair
in one thread block: 32 blocks for SDXL's 32 groups, each reading 4-16 million elements at the decoder's largest
sizes, on a GPU with 132 multiprocessors. On the H200 its moments kernel was 45 of the 116 ms of a 1024x1024 fp32
decode (docs/PERFORMANCE.md, "The VAE decode"). `WideGroupNorm` computes the same function: the statistics are one
`torch.var_mean` over the same rows (torch's reductions spread a long row over many blocks), and the normalisation and
affine one `addcmul` per element. Only in float32, SDXL's decode dtype: in fp16 or bf16 the affine would round twice
where torch's kernel rounds once (2x its error against float32 in bf16), so those keep torch's kernel.

On a GPU with Triton (`fuse`, after the check in `works_on`), more passes go:
- the SiLU that a resnet block, or the decoder's output, applies right after a GroupNorm moves into the norm's
  normalising kernel (`norm_nchw_kernel`, `norm_nhwc_kernel`): one pass over the activations where there were two
  (3.4 ms of the 75 ms decode in SiLU kernels);
- the decoder runs channels_last, so that cuDNN's convolutions, whose kernels read and write NHWC, need no conversion
  before and after each (9.9 ms of the decode). A channels_last input's statistics come from `stats_nhwc_kernel`: each
  program reads a run of positions, all channels, and keeps each group's mean and centred sum of squares, combined
  chunk by chunk as Chan et al. combine partial moments; `affine_nhwc_kernel` combines the programs' partials in
  float64 and writes each channel's scale and shift. Three launches a norm, and nothing waits for the device;
- a resnet block's convolutions add no bias in a pass of their own. Torch's convolution adds it after cuDNN's output,
  in an elementwise kernel that does not vectorise a bias broadcast over channels_last: in the profile of a 1024x1024
  decode on an H100 (benchmarks/results/decode/2026-12-07-5f2fe19-vae-h100.json, 53.3 ms) one such kernel ran 36
  times for 7.0 ms, as many calls as the decoder has convolutions with a bias (35) give or take one, and the blocks'
  ends took 3.0 ms in additions and 2.0 in divisions by their output scale of 1. Here the first convolution's bias
  is added as the second norm reads its input, and the second's and the shortcut's at the block's end, in one pass
  with the input's addition (`fused_resnet_forward`, `residual_kernel`; blocks whose output scale is 1, as all of
  SDXL's): 30 of the 35 bias passes and the 14 divisions go, with the same additions in the same order, so the same
  bits.
The same function in float32 as torch's GroupNorm and SiLU. `narrow` undoes all of it for a copy that is to run as
users run diffusers (the bench's diffusers loop).
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU builds have no Triton: the torch paths
    triton = tl = None

STATS_PROGRAMS = 264  # programs per image for a channels_last input's statistics: 2 per H200 multiprocessor
BLOCK = 4096  # elements a program of the normalising kernels writes, and a chunk of the statistics kernel reads

if triton is not None:
    # the sizes are not specialised on (Triton would compile a kernel again for each divisibility of a size): the
    # kernels `works_on` compiles at load are the ones every decode runs, at any size
    @triton.jit(do_not_specialize=["HW"])
    def norm_nchw_kernel(x_ptr, a_ptr, b_ptr, y_ptr, HW, SILU: tl.constexpr, BLOCK: tl.constexpr):
        """y[nc, p] = f(x[nc, p] a[nc] + b[nc]), f the SiLU or the identity; x, y [N C, HW] contiguous."""
        nc = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < HW
        base = nc.to(tl.int64) * HW
        y = tl.load(x_ptr + base + offs, mask=ok, other=0.0) * tl.load(a_ptr + nc) + tl.load(b_ptr + nc)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + base + offs, y, mask=ok)

    @triton.jit(do_not_specialize=["P"])
    def norm_nhwc_kernel(x_ptr, pre_ptr, a_ptr, b_ptr, y_ptr, P, C: tl.constexpr, SILU: tl.constexpr,
                         HAS_PRE: tl.constexpr, BLOCK_P: tl.constexpr):
        """y[n, p, c] = f((x[n, p, c] + pre[c]) a[n, c] + b[n, c]) (`HAS_PRE`: the bias of the convolution before,
        added here as torch's convolution would have added it); x, y [N, P, C] contiguous (a channels_last NCHW
        tensor). The position blocks on the grid's first axis: a 2048 x 2048 decode has 131072 of them, past the
        other axes' 65535."""
        rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.program_id(1)
        rc = tl.arange(0, C)
        ok = rp[:, None] < P
        off = (n * P + rp).to(tl.int64)[:, None] * C + rc[None, :]
        a = tl.load(a_ptr + n * C + rc)
        b = tl.load(b_ptr + n * C + rc)
        x = tl.load(x_ptr + off, mask=ok, other=0.0)
        if HAS_PRE:
            x = x + tl.load(pre_ptr + rc)[None, :]
        y = x * a[None, :] + b[None, :]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + off, y, mask=ok)

    @triton.jit(do_not_specialize=["P", "PER_PROG"])
    def stats_nhwc_kernel(x_ptr, pre_ptr, mean_ptr, m2_ptr, P, PER_PROG, C: tl.constexpr, G: tl.constexpr,
                          HAS_PRE: tl.constexpr, BLOCK_P: tl.constexpr):
        """For image n and program j: over positions [j PER_PROG, (j + 1) PER_PROG) of x [N, P, C] (contiguous; plus
        pre [C] where `HAS_PRE`), each group's mean and centred sum of squares in float32, written to mean, m2
        [N, programs, G]; chunks of BLOCK_P positions combined as Chan et al. combine partial moments. PER_PROG a
        multiple of BLOCK_P."""
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
            if HAS_PRE:  # positions past the end stay 0, as the sums below take them
                x = tl.where(ok[:, None], x + tl.load(pre_ptr + rc)[None, :], 0.0)
            # each group's elements in this chunk; a chunk past the end (the last program's) has none and changes
            # nothing, and a program's first chunk always has some (no branch: the loop's loads stay pipelined)
            valid = tl.sum(ok.to(tl.float32), axis=0) * (C // G)
            x3 = tl.reshape(x, (BLOCK_P, G, C // G))
            okf = tl.reshape(tl.broadcast_to(ok[:, None], (BLOCK_P, C)).to(tl.float32), (BLOCK_P, G, C // G))
            c_mean = tl.sum(tl.sum(x3, axis=2), axis=0) / tl.maximum(valid, 1.0)
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

    @triton.jit(do_not_specialize=["P", "PER_PROG", "PROGS"])
    def affine_nhwc_kernel(mean_ptr, m2_ptr, w_ptr, b_ptr, a_ptr, c_ptr, P, PER_PROG, PROGS, eps,
                           C: tl.constexpr, G: tl.constexpr, BLOCK_J: tl.constexpr, HAS_W: tl.constexpr,
                           HAS_B: tl.constexpr):
        """For image n: the PROGS programs' partial moments of `stats_nhwc_kernel` combined in float64 (each
        program's element count, mean and centred sum of squares; BLOCK_J programs at a time, in two passes: the
        mean, then the sum of squares about it), then per channel y = x a + c with a = rstd w and c = b - mean a,
        written to a, c [N, C]. One program per image."""
        n = tl.program_id(0)
        rg = tl.arange(0, G)
        total = tl.zeros((G,), dtype=tl.float64)
        weighted = tl.zeros((G,), dtype=tl.float64)
        for j0 in range(0, PROGS, BLOCK_J):
            rj = j0 + tl.arange(0, BLOCK_J)
            okj = rj < PROGS
            count = tl.where(okj, tl.minimum(P - rj * PER_PROG, PER_PROG), 0).to(tl.float64) * (C // G)
            mean = tl.load(mean_ptr + (n * PROGS + rj)[:, None] * G + rg[None, :], mask=okj[:, None], other=0.0)
            total += tl.sum(count, axis=0)
            weighted += tl.sum(count[:, None] * mean.to(tl.float64), axis=0)
        gmean = weighted / total
        m2sum = tl.zeros((G,), dtype=tl.float64)
        for j0 in range(0, PROGS, BLOCK_J):
            rj = j0 + tl.arange(0, BLOCK_J)
            okj = rj < PROGS
            count = tl.where(okj, tl.minimum(P - rj * PER_PROG, PER_PROG), 0).to(tl.float64) * (C // G)
            off = (n * PROGS + rj)[:, None] * G + rg[None, :]
            d = tl.load(mean_ptr + off, mask=okj[:, None], other=0.0).to(tl.float64) - gmean[None, :]
            m2 = tl.load(m2_ptr + off, mask=okj[:, None], other=0.0).to(tl.float64)
            m2sum += tl.sum(m2 + count[:, None] * d * d, axis=0)
        rstd = 1.0 / tl.sqrt((m2sum / total).to(tl.float32) + eps)
        # per channel: a group's value repeated over its C // G channels, in channel order
        rstd_c = tl.reshape(tl.broadcast_to(rstd[:, None], (G, C // G)), (C,))
        mean_c = tl.reshape(tl.broadcast_to(gmean.to(tl.float32)[:, None], (G, C // G)), (C,))
        rc = tl.arange(0, C)
        a = rstd_c
        if HAS_W:
            a = a * tl.load(w_ptr + rc)
        c = -mean_c * a
        if HAS_B:
            c += tl.load(b_ptr + rc)
        tl.store(a_ptr + n * C + rc, a)
        tl.store(c_ptr + n * C + rc, c)

    @triton.jit(do_not_specialize=["N", "HW", "C"])
    def residual_kernel(x_ptr, xb_ptr, h_ptr, hb_ptr, y_ptr, N, HW, C, NHWC: tl.constexpr, HAS_XB: tl.constexpr,
                        HAS_HB: tl.constexpr, BLOCK: tl.constexpr):
        """A decoder resnet block's end, y = (x + xb[c]) + (h + hb[c]), over N elements of x, h, y (one layout, NHWC
        or NCHW, contiguous in it): h the second convolution's output before its bias hb (`HAS_HB`), x the block's
        input or its shortcut convolution's output before its bias xb (`HAS_XB`). The order of torch's additions, so
        the same bits as the block's own forward (its division by an output scale of 1 changes nothing). The sizes
        are not specialised on: one kernel serves every channel count."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        c = offs % C if NHWC else (offs // HW) % C
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if HAS_XB:
            x = x + tl.load(xb_ptr + c, mask=ok, other=0.0)
        h = tl.load(h_ptr + offs, mask=ok, other=0.0)
        if HAS_HB:
            h = h + tl.load(hb_ptr + c, mask=ok, other=0.0)
        tl.store(y_ptr + offs, x + h, mask=ok)


else:  # the names exist without Triton (kernels_take is then False everywhere)
    norm_nchw_kernel = norm_nhwc_kernel = stats_nhwc_kernel = affine_nhwc_kernel = residual_kernel = None


class WideGroupNorm(nn.GroupNorm):
    """nn.GroupNorm with the same parameters and state dict, and the SiLU after it where `silu` is set. Once `fuse` has
    checked the kernels on its device (`kernels`), a float32 4D input there (NCHW or channels_last) takes them; another
    contiguous float32 input of 3 or more dimensions the wide path; anything else torch's own."""

    silu = False
    kernels = False

    def forward(self, x: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
        """The norm (and SiLU) of x, or of x + pre [C] per channel (`pre`: the bias of the convolution before, which
        the fused resnet block leaves to the norm: `fused_resnet_forward`)."""
        if self.kernels and kernels_take(x, self.num_channels, self.num_groups):
            return group_norm_kernels(x, self.num_groups, self.weight, self.bias, self.eps, self.silu, pre)
        if pre is not None:
            x = x + pre.view(1, -1, *(1,) * (x.dim() - 2))
        if x.dim() < 3 or not x.is_contiguous() or x.dtype != torch.float32:
            y = super().forward(x)
        else:
            y = group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y


class SiluInNorm(nn.Identity):
    """Where a block's SiLU was, once `fuse` moved it into the GroupNorm before it (`narrow` puts an nn.SiLU back)."""


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """F.group_norm(x, groups, weight, bias, eps) for a contiguous float32 [N, C, ...] x."""
    n, c = x.shape[:2]
    var, mean = torch.var_mean(x.view(n * groups, -1), dim=1, correction=0)
    a, b = _affine(mean.view(n, groups), var.view(n, groups), c, weight, bias, eps)
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(b.view(shape), x, a.view(shape))


def _affine(mean: torch.Tensor, var: torch.Tensor, c: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, y = x * a + b: a = rstd * weight, b = bias - mean * rstd * weight; [N, C] each, from the groups'
    [N, G] mean and variance."""
    n, groups = mean.shape
    a = torch.rsqrt(var + eps).view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
    if weight is not None:
        a = a * weight
    b = -mean.view(n, groups, 1).expand(n, groups, c // groups).reshape(n, c) * a
    if bias is not None:
        b = b + bias
    return a, b


def kernels_take(x: torch.Tensor, channels: int, groups: int) -> bool:
    """Whether `x` takes the Triton kernels: float32, 4 dimensions, NCHW-contiguous or channels_last, a power-of-two
    channel count, on a CUDA device (or the CPU under Triton's interpreter, TRITON_INTERPRET=1: the kernels' own
    tests)."""
    if triton is None or x.dim() != 4 or x.dtype != torch.float32 or channels & (channels - 1) or channels % groups:
        return False
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)


def group_norm_kernels(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float, silu: bool, pre: torch.Tensor | None = None) -> torch.Tensor:
    """F.group_norm (then F.silu where `silu`) of a `kernels_take` x (or of x + pre [C] per channel), in x's memory
    format. NCHW: the statistics are torch's `var_mean` (as the wide path's); channels_last: `stats_nhwc_kernel`,
    combined by `affine_nhwc_kernel`, each adding `pre` as it reads x. Then one normalising pass. Nothing waits for
    the device."""
    n, c, h, w = x.shape
    p = h * w
    if pre is not None and x.is_contiguous():  # NCHW (not the decoder's layout): the sum first
        x, pre = x + pre.view(1, c, 1, 1), None
    y = torch.empty_like(x)
    if x.is_contiguous():
        var, mean = torch.var_mean(x.view(n, groups, -1), dim=2, correction=0)
        a, b = (t.contiguous() for t in _affine(mean, var, c, weight, bias, eps))
        norm_nchw_kernel[(n * c, triton.cdiv(p, BLOCK))](x, a, b, y, p, SILU=silu, BLOCK=BLOCK, num_warps=8)
        return y
    block_p = max(1, BLOCK // c)  # a chunk, and a normalising program: block_p positions, all their channels
    per = triton.cdiv(triton.cdiv(p, min(STATS_PROGRAMS, triton.cdiv(p, block_p))), block_p) * block_p
    progs = triton.cdiv(p, per)
    mean = torch.empty(n, progs, groups, device=x.device, dtype=torch.float32)
    m2 = torch.empty_like(mean)
    stats_nhwc_kernel[(n, progs)](x, x if pre is None else pre, mean, m2, p, per, C=c, G=groups,
                                  HAS_PRE=pre is not None, BLOCK_P=block_p, num_warps=8)
    a = torch.empty(n, c, device=x.device, dtype=torch.float32)
    b = torch.empty_like(a)
    affine_nhwc_kernel[(n,)](mean, m2, weight if weight is not None else a, bias if bias is not None else a, a, b, p,
                             per, progs, eps, C=c, G=groups, BLOCK_J=32,
                             HAS_W=weight is not None, HAS_B=bias is not None, num_warps=4)
    norm_nhwc_kernel[(triton.cdiv(p, block_p), n)](x, x if pre is None else pre, a, b, y, p, C=c, SILU=silu,
                                                   HAS_PRE=pre is not None, BLOCK_P=block_p, num_warps=8)
    return y


def residual(x: torch.Tensor, xb: torch.Tensor | None, h: torch.Tensor, hb: torch.Tensor | None) -> torch.Tensor:
    """(x + xb) + (h + hb), the biases [C] per channel (either may be None): a decoder resnet block's end with its
    convolutions' biases (`fused_resnet_forward`). One pass of `residual_kernel` where x and h are float32 4D tensors
    of one shape and layout on a device the kernels run on; else torch's operations, in the same order."""
    view = (1, -1) + (1,) * (x.dim() - 2)
    if (residual_kernel is not None and x.shape == h.shape and x.stride() == h.stride() and x.dim() == 4
            and x.dtype == h.dtype == torch.float32 and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))):
        n, c, hh, ww = x.shape
        y = torch.empty_like(x)
        total = x.numel()
        residual_kernel[(triton.cdiv(total, BLOCK),)](
            x, x if xb is None else xb, h, h if hb is None else hb, y, total, hh * ww, c,
            NHWC=not x.is_contiguous(), HAS_XB=xb is not None, HAS_HB=hb is not None, BLOCK=BLOCK, num_warps=8)
        return y
    x = x if xb is None else x + xb.view(view)
    h = h if hb is None else h + hb.view(view)
    return x + h


def fused_resnet_forward(block: nn.Module, input_tensor: torch.Tensor, temb: torch.Tensor | None = None, *args,
                         **kwargs) -> torch.Tensor:
    """diffusers' ResnetBlock2D.forward for a block of the decoder that `fuse` changed (no time embedding, no up- or
    downsampling, its SiLUs inside its norms), with no pass of its own for its convolutions' biases: the first
    convolution's goes into the second norm's reading of its input (`WideGroupNorm.forward`'s `pre`), the second's
    and the shortcut's into the block's end (`residual`), which also adds the input (the block's output scale is 1).
    Where the norms take the kernels that is three passes over the activations fewer per block, the same values
    (torch's convolution adds its bias as a pass of its own after cuDNN's output, in this order)."""
    if temb is not None or args or kwargs:
        return type(block).forward(block, input_tensor, temb, *args, **kwargs)
    conv1, conv2, shortcut = block.conv1, block.conv2, block.conv_shortcut
    h = block.norm1(input_tensor)
    h = block.norm2(conv1._conv_forward(h, conv1.weight, None), pre=conv1.bias)
    h = conv2._conv_forward(block.dropout(h), conv2.weight, None)
    x, xb = input_tensor, None
    if shortcut is not None:
        x, xb = shortcut._conv_forward(input_tensor, shortcut.weight, None), shortcut.bias
    return residual(x, xb, h, conv2.bias)


def widen(module: nn.Module) -> int:
    """Every nn.GroupNorm under `module` computes through WideGroupNorm from now on (same parameters, same
    state dict). Returns how many."""
    return _swap(module, nn.GroupNorm, WideGroupNorm)


def fuse(decoder: nn.Module) -> int:
    """A widened VAE decoder's SiLUs move into the GroupNorms before them, and the decoder goes channels_last, where
    the kernels give torch's answer on its device (`works_on`). The SiLUs that move: a resnet block's (no time
    embedding projection, so its SiLU follows each of its norms straight away; the decoder's never shift and scale
    by a time embedding) and the decoder's output's. Those resnet blocks, where they neither up- nor downsample and
    their output scale is 1, also leave their convolutions' biases to the norm and the block's end
    (`fused_resnet_forward`). Returns how many norms took a SiLU (0: nothing changed)."""
    from diffusers.models.resnet import ResnetBlock2D

    norms = [m for m in decoder.modules() if type(m) is WideGroupNorm]
    shapes = sorted({(m.num_channels, m.num_groups) for m in norms})
    if not norms or not works_on(norms[0].weight.device, shapes):
        return 0
    for m in norms:
        m.kernels = True
    took = 0
    for m in decoder.modules():
        if (isinstance(m, ResnetBlock2D) and type(m.nonlinearity) is nn.SiLU and m.time_emb_proj is None
                and m.time_embedding_norm != "scale_shift" and type(m.norm1) is type(m.norm2) is WideGroupNorm):
            m.norm1.silu = m.norm2.silu = True
            m.nonlinearity = SiluInNorm()
            took += 2
            convs = type(m.conv1) is type(m.conv2) is nn.Conv2d and type(m.conv_shortcut) in (type(None), nn.Conv2d)
            if convs and m.upsample is None and m.downsample is None and m.output_scale_factor == 1:
                m.forward = types.MethodType(fused_resnet_forward, m)
    if type(getattr(decoder, "conv_act", None)) is nn.SiLU and type(decoder.conv_norm_out) is WideGroupNorm:
        decoder.conv_norm_out.silu = True
        decoder.conv_act = SiluInNorm()
        took += 1
    decoder.to(memory_format=torch.channels_last)
    return took


def narrow(module: nn.Module) -> int:
    """The inverse of `widen` and `fuse`: torch's GroupNorm, the SiLUs back in their blocks, the weights NCHW again
    (for a copy of the VAE that is to run as users run it). Returns how many norms."""
    for parent in module.modules():
        if getattr(parent.__dict__.get("forward"), "__func__", None) is fused_resnet_forward:
            del parent.forward
        for name, child in list(parent.named_children()):
            if type(child) is SiluInNorm:
                setattr(parent, name, nn.SiLU())
    found = [m for m in module.modules() if type(m) is WideGroupNorm]
    for m in found:
        m.__dict__.pop("silu", None)
        m.__dict__.pop("kernels", None)
    module.to(memory_format=torch.contiguous_format)
    return _swap(module, WideGroupNorm, nn.GroupNorm)


def channels_last(module: nn.Module) -> bool:
    """Whether `module`'s (a decoder's) convolution weights are channels_last: its input should be too."""
    conv = next((m for m in module.modules() if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)), None)
    return conv is not None and not conv.weight.is_contiguous() and conv.weight.is_contiguous(
        memory_format=torch.channels_last)


def works_on(device: torch.device, shapes: list[tuple[int, int]] = ((64, 32),)) -> bool:
    """Whether the kernels run on `device` and give torch's GroupNorm (and SiLU) there at each (channels, groups) of
    `shapes`, NCHW and channels_last, with and without the SiLU, on small inputs (at load: every kernel a decoder of
    these norms runs is compiled here, once per machine in Triton's cache, and checked). False where a channel count
    is not a power of two, Triton is missing, or the device is not a GPU (nor the CPU under Triton's interpreter)."""
    try:
        g = torch.Generator(device).manual_seed(0)
        for c, groups in shapes:
            x = torch.randn(1, c, 9, 7, device=device, generator=g) * 3 + 2  # 63 positions: a partial chunk
            if not kernels_take(x, c, groups):
                return False
            w, b = torch.randn(c, device=device, generator=g), torch.randn(c, device=device, generator=g)
            pre = torch.randn(c, device=device, generator=g)
            norm = F.group_norm(x, groups, w, b, 1e-6)
            for silu in (False, True):
                want = F.silu(norm) if silu else norm
                for layout in (torch.contiguous_format, torch.channels_last):
                    got = group_norm_kernels(x.contiguous(memory_format=layout), groups, w, b, 1e-6, silu)
                    if not ((got - want).abs().max() < 1e-4):
                        return False
            # what a fused resnet block adds (`fused_resnet_forward`, channels_last as the decoder runs): its second
            # norm with the first convolution's bias, and its end with a shortcut's bias and without
            xx = x.contiguous(memory_format=torch.channels_last)
            got = group_norm_kernels(xx, groups, w, b, 1e-6, True, pre)
            if not ((got - F.silu(F.group_norm(x + pre.view(1, c, 1, 1), groups, w, b, 1e-6))).abs().max() < 1e-4):
                return False
            hh = torch.randn(x.shape, device=device, generator=g).contiguous(memory_format=torch.channels_last)
            for xb in (pre, None):
                end = residual(xx, xb, hh, b)
                want = (x if xb is None else x + xb.view(1, c, 1, 1)) + (hh + b.view(1, c, 1, 1))
                if not ((end - want).abs().max() < 1e-5 and end.stride() == xx.stride()):
                    return False
        return True
    except Exception:  # noqa: BLE001 - any compiler or driver failure: the torch paths
        return False


def _swap(module: nn.Module, old: type, new: type) -> int:
    found = [m for m in module.modules() if type(m) is old]
    for m in found:
        m.__class__ = new
    return len(found)
