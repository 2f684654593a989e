"""FP8 convolutions at the UNet's inner levels (the `fp8` row's recipe step `fp8-convs-inner`, engine/variants.py): the
resnets' 3x3 convolutions and the upsamplers' at every level but the outermost (the latent's own resolution) run as an
implicit-GEMM Triton kernel of ours on FP8 operands, the input at a static per-tensor scale (calibrated with the FP8
Linears' inputs, engine/kernels/fp8.py), the weight per output channel. Torch has no FP8 convolution.

- Why these: the FP8 8 x 1024² step spent 48.5 of its 188.7 ms in cuDNN's fp16 convolutions (H100,
  benchmarks/results/step/2026-12-06-43d2eb5-profile-h100.json), the largest part still in fp16. The kernel in FP8
  takes 0.65x cuDNN's time over the UNet's convolutions (conv_scout.py, benchmarks/results/step/
  2026-12-06-d60d1e3-conv-h100.json), 9.7 ms a step at the two inner levels. But FP8 convolutions cost pictures:
  with every convolution in FP8 beside the FP8 Linears the bench job's images are 41.2 dB from fp16 (the Linears
  alone 49.5), under the 45 dB FP8 must keep; with those whose input is at most half the latent's side, 47.5 dB
  (benchmarks/probes/conv_psnr.py, benchmarks/results/step/2026-12-06-e4df125-conv-psnr-levels-h100.json; this set is
  those without the 1x1 shortcuts and the downsampler). Measured built in (step_scout.py fp8_noconv, H100,
  benchmarks/results/step/2026-12-06-3b316e5-fp8-noconv-h100.json): the FP8 UNet at 8 x 1024² 186.09 ms a step with
  these on cuDNN in fp16, 178.46 with them in FP8 (1.043x); the bench job's pictures 48.03 dB from fp16.
- Each of these reads a GroupNorm + SiLU's output (a resnet's) or an upsampling's, which nothing else reads: the input's
  quantisation is a pointwise op the compiler fuses into that kernel, which then writes FP8, half the bytes. The 1x1
  shortcuts and the downsamplers read a block's input or output, which other ops read too; they stay cuDNN's.
- The ControlNet's convolutions stay fp16: their cost in pictures is not measured.
- In the export, a `torch.library.triton_op` (`bcg::conv2d_fp8`): inductor compiles the kernel into the package. Tiles
  128 (output positions) x 256 (output channels) x 128 (input channels), 8 warps, 3 stages: the scout's fastest at most
  of these shapes at 8 and 2 images; the depth narrowed where the channels need it. On the CPU (the tests' artifacts)
  the same module runs `reference`, the same arithmetic in torch ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILES = (128, 256, 128, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
MIN_C = 32  # an FP8 tensor-core product's least depth
RESNET_CONVS = ("conv1", "conv2")


def level(name: str, levels: int) -> int | None:
    """The UNet level (0: the latent's own resolution, 1: half of it, ...) of the convolution `name` reads its input
    at, for a resnet's two convolutions and an upsampler's; None for any other."""
    parts = name.split(".")
    if parts[0] == "down_blocks" and parts[2:3] == ["resnets"] and parts[-1] in RESNET_CONVS:
        return int(parts[1])
    if parts[0] == "mid_block" and parts[1:2] == ["resnets"] and parts[-1] in RESNET_CONVS:
        return levels - 1
    if parts[0] == "up_blocks" and parts[2:3] == ["resnets"] and parts[-1] in RESNET_CONVS:
        return levels - 1 - int(parts[1])
    if parts[0] == "up_blocks" and parts[2:3] == ["upsamplers"] and parts[-1] == "conv":
        return levels - 2 - int(parts[1])  # after the interpolation to the next level out
    return None


def convs(model: torch.nn.Module) -> list[str]:
    """The names of the convolutions the FP8 kernels run in FP8: a UNet's resnet and upsampler 3x3 convolutions (stride
    1, with a bias) reading their input at an inner level, whose channels a tile fits; none in a ControlNet."""
    if not hasattr(model, "up_blocks"):
        return []
    levels = len(model.config.block_out_channels)
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Conv2d) and (lv := level(n, levels)) is not None and lv >= 1
            and m.kernel_size == (3, 3) and m.stride == (1, 1) and m.dilation == (1, 1) and m.groups == 1
            and m.bias is not None and m.in_channels % MIN_C == 0]


def tiles(c: int, n: int) -> tuple[int, int, int, int, int]:
    """The kernel's tiles for C input and N output channels: TILES, the depth narrowed to divide C, the output tile
    to N where N is smaller (C a multiple of MIN_C)."""
    bm, bn, bk, warps, stages = TILES
    bk = next(b for b in (bk, 64, MIN_C) if c % b == 0)
    bn = min(bn, max(16, 1 << (n - 1).bit_length()))
    return bm, bn, bk, warps, stages


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution's weight [N, C, R, S] -> (its float8_e4m3fn values laid out [N, R, S, C], as the kernel reads them;
    its per-output-channel scales amax / 448, float32 [N])."""
    w = w.detach().float()
    scale = w.abs().amax(dim=(1, 2, 3)).clamp_min(1e-12) / FP8_MAX
    q = (w / scale[:, None, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.permute(0, 2, 3, 1).contiguous(), scale


def reference(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, xs: torch.Tensor, bias: torch.Tensor, stride: int,
              pad: int) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: x [B, C, H, W] and W [N, R, S, C] in FP8 at scales xs (per tensor) and ws
    (per output channel), float32 products and sums, the bias -> [B, N, P, Q] float32."""
    weight = (w.float() * ws[:, None, None, None]).permute(0, 3, 1, 2)
    return F.conv2d(x.float() * xs, weight, bias.float(), stride, pad)


@functools.cache
def op():
    """`torch.ops.bcg.conv2d_fp8` (registered at first use, once a process): the kernel as a triton_op, which an export
    keeps as one node and inductor compiles into the package. Its output is channels_last in the bias's dtype."""
    import triton
    from torch.library import triton_op, wrap_triton

    from storyboard_cli.engine.kernels.conv8_triton import conv_fp8_kernel

    @triton_op("bcg::conv2d_fp8", mutates_args={})
    def conv2d_fp8(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, xs: torch.Tensor, bias: torch.Tensor,
                   stride: int, pad: int) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        b, c, h, wd = x.shape
        n, r, s, _ = w.shape
        p, q = (h + 2 * pad - r) // stride + 1, (wd + 2 * pad - s) // stride + 1
        out = torch.empty((b, n, p, q), device=x.device, dtype=bias.dtype, memory_format=torch.channels_last)
        m = b * p * q
        bm, bn, bk, warps, stages = tiles(c, n)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        wrap_triton(conv_fp8_kernel)[grid](x, w, out, ws, xs, bias, m, h, wd, c, p, q, n, R=r, S=s, STRIDE=stride,
                                           PAD=pad, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=True,
                                           num_warps=warps, num_stages=stages)
        return out

    return conv2d_fp8


class Fp8Conv2d(torch.nn.Module):
    """A 3x3 convolution (stride 1, a bias) with its input and weight in float8_e4m3fn: the input at a static per-tensor
    scale, the weight per output channel. Made without values: the artifact is compiled from shapes, and the rendering
    process binds its own tensors (fp8.py `weights`, `input_scales`)."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        w = conv.weight
        n, c, r, s = w.shape
        kw = {"device": w.device}
        self.register_buffer("weight", torch.empty((n, r, s, c), dtype=FP8, **kw))
        self.register_buffer("w_scale", torch.ones(n, dtype=torch.float32, **kw))
        self.register_buffer("x_scale", torch.ones((), dtype=torch.float32, **kw))
        self.register_buffer("bias", torch.empty_like(conv.bias))
        self.stride, self.pad = conv.stride[0], conv.padding[0]
        self.out_dtype = w.dtype

    def quantise(self, x: torch.Tensor) -> torch.Tensor:
        """Pointwise: the compiler fuses it into the kernel that makes the input (a GroupNorm + SiLU, an upsampling)."""
        return (x / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.quantise(x)
        if xq.is_cuda:
            return op()(xq, self.weight, self.w_scale, self.x_scale, self.bias, self.stride, self.pad)
        return reference(xq, self.weight, self.w_scale, self.x_scale, self.bias, self.stride, self.pad).to(self.out_dtype)


def replace(model: torch.nn.Module, names: list[str], make) -> int:
    """Each named submodule of `model` replaced by `make(it)` (an FP8 twin: fp8.py's Linears, the convolutions here);
    returns how many."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, make(getattr(owner, child)))
    return len(names)


def swap_in(model: torch.nn.Module) -> int:
    """Replaces the FP8 convolutions of a UNet (what the export sees) by Fp8Conv2d; returns how many."""
    return replace(model, convs(model), Fp8Conv2d)
