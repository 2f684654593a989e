"""The FP8 kernels' feed-forwards as one Triton kernel of ours (the `fp8` row's recipe step `fused-geglu`,
engine/variants.py): each transformer block's feed-forward starts with `proj`, a Linear K -> 2 x inner, whose output is
split into halves h and g and written on as h * gelu(g) (diffusers' GEGLU, erf form), the input of the feed-forward's
last Linear. The compiled FP8 step ran that as two kernels: cuBLASLt's FP8 GEMM wrote [M, 2 x inner] in fp16 and the
compiler's pointwise kernel read it all back, applied GEGLU and quantised [M, inner] at the last Linear's static
scale. Here one GEMM keeps an h and a g accumulator of the same columns (one A tile), and its epilogue adds the bias,
applies GEGLU and the quantisation and writes the FP8 [M, inner] once: the [M, 2 x inner] tensor is never written nor
read back.

- Measured (benchmarks/probes/step_scout.py fp8_geglu: the production FP8 UNet built with this change against the
  cache's artifact, one process, H100): 8 x 1024² 189.34 -> 183.01 ms a step (1.035x), 2 x 1024² 50.60 -> 49.33
  (1.026x); the noise prediction 2.6e-2 from the unfused artifact's (a few values a step land on the next FP8 step:
  the GEGLU input is no longer rounded to fp16 first), where FP8 itself is 3.4e-2 from fp16. The kernel alone, summed
  over a step's 70 calls: 40.54 ms (cuBLASLt + the compiler's GEGLU) -> 34.46 (benchmarks/results/step/
  2026-12-06-43d2eb5-geglu-h100.json); the ControlNet's 34 calls 19.46 -> 16.56.
- The form: a persistent grid (one program an SM, each taking every n-th output tile, GROUP_M row tiles down a column
  tile at a time so the weight's tiles stay in L2), pointer tiles: the fastest form with pointer arguments at both
  of SDXL's shapes (TMA tiles were faster still, but a tensor descriptor made inside a custom op does not compile into
  an AOTInductor package on torch 2.11: benchmarks/results/step/2026-12-05-10e3eb1-export-triton.json). The grid does
  not depend on the rows, so the exported graph, rows dynamic, launches it as it is. Tiles 128 x 128 (of inner, for
  each of h and g) x 128, 8 warps, 3 stages, at both shapes; smaller where a model's widths need it (the tiny test
  model). No autotuning: a build never times kernels on a GPU a render may be using.
- Its FP8 tensor-core products accumulate at the Hopper's reduced precision (Triton's default for FP8 dots; cuBLASLt's
  in production accumulates fully, `use_fast_accum=False`): at SDXL's depths 1.8% to 3.2% of its outputs land one FP8
  step from the exact value, at the test model's under 1% (tests/test_gpu_fp8_kernels.py, H200). The bench job's FP8
  pictures with this kernel and conv8.py's stay 48.03 dB from fp16 (49.56 before them; H100, 2026-12-06), over the
  45 dB FP8 must keep; a `max_num_imprecise_acc` on the dots would promote the sums, at some speed.
- In the export, a `torch.library.triton_op` (`bcg::geglu_fp8`): inductor compiles the kernel into the package beside
  its own, and a process that never imported this module loads and runs it (the load check's child). On the CPU (the
  tests' artifacts) the same module runs `reference`, the same arithmetic in torch ops.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILES = (128, 128, 128, 8, 3, 8)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M (SDXL's shapes)
MIN_K = 32  # an FP8 tensor-core product's least depth


def tiles(k: int, inner: int) -> tuple[int, int, int, int, int, int] | None:
    """The kernel's tiles for a `proj` of K -> 2 x inner: TILES, each block narrowed to divide its width; None where
    no tile fits (the feed-forward stays unfused)."""
    bm, bn, bk, warps, stages, group = TILES
    bn = next((b for b in (bn, 64, 32, 16) if b <= bn and inner % b == 0), None)
    bk = next((b for b in (bk, 64, MIN_K) if b <= bk and k % b == 0), None)
    return None if bn is None or bk is None else (bm, bn, bk, warps, stages, group)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
              os: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: x [M, K] and W [2N, K] in FP8 at scales xs and ws, the bias b [2N], GEGLU
    of the float32 product, quantised at `os` -> [M, N] FP8 (the CPU's path, and the GPU tests' reference)."""
    y = (x.float() * xs) @ (w.float() * ws).t() + b.float()
    h, g = y.chunk(2, dim=-1)
    return (h * F.gelu(g) / os).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@functools.cache
def op():
    """`torch.ops.bcg.geglu_fp8` (registered at first use, once a process): the kernel as a triton_op, which an export
    keeps as one node and inductor compiles into the package."""
    from torch.library import triton_op, wrap_triton

    from storyboard_cli.engine.kernels.geglu_triton import geglu_gemm_persistent_kernel

    @triton_op("bcg::geglu_fp8", mutates_args={})
    def geglu_fp8(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                  os: torch.Tensor) -> torch.Tensor:
        m, depth = x.shape
        n = w.shape[0] // 2
        bm, bn, bk, warps, stages, group = tiles(depth, n)
        out = torch.empty(m, n, device=x.device, dtype=FP8)
        grid = (torch.cuda.get_device_properties(x.device).multi_processor_count,)
        wrap_triton(geglu_gemm_persistent_kernel)[grid](
            x, w, b, out, xs, ws, os, m, n, depth, QUANT=True, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=group, num_warps=warps, num_stages=stages)
        return out

    return geglu_fp8


def fusable(ff: torch.nn.Module) -> bool:
    """Whether a diffusers FeedForward is GEGLU between two FP8 Linears (engine/kernels/fp8.py Fp8Linear: FP8 weights)
    whose widths a tile fits."""
    from diffusers.models.activations import GEGLU

    first, last = ff.net[0], ff.net[-1]
    if not (isinstance(first, GEGLU) and first.proj.weight.dtype == FP8 and first.proj.bias is not None
            and getattr(last, "weight", None) is not None and last.weight.dtype == FP8):
        return False
    k, n2 = first.proj.weight.shape[1], first.proj.weight.shape[0]
    return tiles(k, n2 // 2) is not None


def fused_forward(ff: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A fused FeedForward's forward: the first Linear, GEGLU and the last Linear's quantisation in one call (the
    kernel on a GPU, `reference` on the CPU), its FP8 output the last Linear's input as it is."""
    p, last = ff.net[0].proj, ff.net[-1]
    lead, k = hidden_states.shape[:-1], hidden_states.shape[-1]
    x = p.quantise(hidden_states).reshape(-1, k)
    fused = op() if x.is_cuda else reference
    q = fused(x, p.weight, p.bias, p.x_scale, p.w_scale, last.x_scale)
    q = q.reshape(*lead, q.shape[-1])
    for module in ff.net[1:]:  # the dropout (none in eval), the last Linear
        q = module(q)
    return q


def fuse(model: torch.nn.Module) -> int:
    """Every fusable FeedForward of `model` (the module the export sees, its Linears already FP8) made to run
    `fused_forward`; returns how many."""
    from diffusers.models.attention import FeedForward

    count = 0
    for m in model.modules():
        if isinstance(m, FeedForward) and fusable(m):
            m.forward = types.MethodType(fused_forward, m)
            count += 1
    return count
