"""GEGLU scout: would the feed-forward's first Linear with GEGLU in its epilogue (a Triton GEMM of ours) beat what the
compiled step runs today, cuBLAS's GEMM and then the compiler's GEGLU kernel? (issue 41 item 5)

Every transformer block's feed-forward starts with `proj`, a Linear K -> 2 x inner, whose output is split in halves h
and g and written on as h * gelu(g) (diffusers' GEGLU, erf form), the next Linear's input. In the compiled step that is
two kernels: the GEMM (cuBLAS; in FP8 cuBLASLt's, bias in its epilogue) writes [M, 2 x inner] in fp16, and the
compiler's pointwise kernel reads it all back and writes [M, inner] (in FP8: quantised at the next Linear's static input
scale). In the profile of 2026-12-03 (benchmarks/results/step/2026-12-03-7140af6-profile.json) the GEGLU kernels alone
are 12.1 ms of the fp16 8 x 1024² step and 14.7 ms of the FP8 one, at 1.8x the time their bytes need; and the 70 `proj`
GEMMs are 30.1 of the step's 69.7 TFLOP of Linears. A GEMM whose epilogue computes GEGLU never writes the [M, 2 x inner]
tensor nor reads it back: each program accumulates an h tile and the g tile of the same columns (two accumulators, one
A tile), adds the bias, applies GELU and the product, quantises (FP8) and writes [M, inner] once. It pays off only if
the Triton GEMM is near cuBLAS's rate; this scout measures both sides.

Shapes: the UNet's and the ControlNet's `proj` calls at --side (1024: 4096 and 1024 tokens at the two attention levels,
K 640 and 1280, inner 2560 and 5120; 10 + 60 calls a UNet step, counted on the model built on the meta device), at
--rows (16 and 4: 8 and 2 images, guided). For fp16 and FP8 (static per-tensor scales, as engine/kernels/fp8.py), each in
ms (a CUDA graph of 10 calls, median of --repeats replays) and TFLOPS:
  production    what the compiled step runs: torch.compile of the GEMM (F.linear / torch._scaled_mm) and GEGLU (and the
                quantisation), one function, inductor's kernels and cuBLAS
  cublas        the GEMM alone;   geglu_compiled   the compiler's GEGLU (+ quantisation) kernel alone, on its output
  geglu_tiled   a 2D-tiled GEGLU kernel of ours (contiguous columns, no index division) alone;  cublas+geglu_tiled
  triton_gemm   a plain Triton GEMM of the whole [M, 2 x inner] (fp16 out): how near cuBLAS a Triton GEMM gets here
  fused         the GEMM with GEGLU in its epilogue, tuned per shape over a few tile configs
  fused_block   the fused kernel with block pointers (no pointer tensors, only plain pointers across the call)
  fused_persistent   the pointer form on a persistent grid (one program an SM, looping over the tiles)
  triton_gemm_tma, fused_tma   the same two with their tiles moved by the TMA (tensor descriptors): no pointer
                tensors in registers (compiled for sm_90a with a launch's hints, none of the three forms spills:
                benchmarks/results/step/2026-12-05-131c71a-sm90-compile.json)
and each one's relative L2 error against the fp32 arithmetic of the same (quantised) operands. Summed per step:
ms per UNet step and per ControlNet step for production, cublas+geglu_tiled and each fused form.

    python benchmarks/probes/geglu_scout.py --out geglu.json                 # CUDA (H200): about 2 minutes
    python benchmarks/probes/geglu_scout.py --out /tmp/g.json --smoke        # CPU: tiny, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
# triton as attention_scout imports it (under --smoke without CUDA: its interpreter), before torch._dynamo does
from attention_scout import TRITON_MISSING, last_line, patch_interpreter_fp8_cast, tl, triton  # noqa: E402
import torch._dynamo  # noqa: E402
from attention_scout import time_graph_ms  # noqa: E402
from conv_scout import patch_interpreter_index  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SQRT_HALF = 0.7071067811865476
# BLOCK_M, BLOCK_N (of inner: the program's h and g tiles are each this wide), BLOCK_K, num_warps, num_stages, GROUP_M
FUSED_CONFIGS = {
    "fp16": [(128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 64, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8),
             (256, 64, 64, 8, 3, 8), (128, 128, 32, 8, 5, 8), (128, 64, 64, 8, 4, 8), (128, 64, 64, 8, 5, 8)],
    "fp8": [(128, 128, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8), (128, 64, 128, 4, 4, 8), (64, 128, 128, 4, 4, 8),
            (256, 64, 128, 8, 3, 8), (128, 128, 64, 8, 5, 8), (128, 64, 128, 8, 4, 8), (128, 64, 128, 8, 5, 8)],
}
GEMM_CONFIGS = {  # the plain GEMM: one accumulator BLOCK_M x BLOCK_N over the whole output
    "fp16": [(128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (256, 128, 64, 8, 3, 8)],
    "fp8": [(128, 256, 128, 8, 3, 8), (128, 128, 128, 4, 4, 8), (256, 128, 128, 8, 3, 8)],
}
GEGLU_CONFIGS = [(8, 512, 4), (4, 1024, 4), (16, 256, 4), (2, 1024, 8)]  # BLOCK_M, BLOCK_N, num_warps
SMOKE_FUSED = {"fp16": [(32, 32, 32, 4, 1, 2)], "fp8": [(32, 32, 32, 4, 1, 2)]}
SMOKE_GEMM = {"fp16": [(32, 64, 32, 4, 1, 2)], "fp8": [(32, 64, 32, 4, 1, 2)]}
SMOKE_GEGLU = [(8, 32, 4)]

if triton is not None:
    # the kernels' constants: Triton lets a kernel read a global only where it is a constexpr
    K_SQRT_HALF = tl.constexpr(SQRT_HALF)
    K_FP8_MAX = tl.constexpr(FP8_MAX)

    # the product's kernels (engine/kernels/geglu.py: the persistent form is the FP8 artifacts'), and their parts
    from storyboard_cli.engine.kernels.geglu_triton import (geglu_epilogue, geglu_gemm_persistent_kernel,  # noqa: F401
                                                            geglu_tile, tile_of)

    @triton.jit
    def geglu_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K,
                          QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """out[m, n] = h * gelu(g), h = s (x W[n]^T) + b[n], g = s (x W[N + n]^T) + b[N + n], s = x_scale w_scale;
        x [M, K], W [2N, K] row-major (the Linear's weight), out [M, N] (QUANT: / out_scale, saturated, FP8).
        K a multiple of BLOCK_K, N of BLOCK_N. One program a tile."""
        pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        geglu_tile(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K, pid_m, pid_n, QUANT, HAS_BIAS,
                   BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """out = s (x W^T) + b in fp16: x [M, K], W [N, K] row-major, out [M, N]."""
        pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        a_ptrs = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
        b_ptrs = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(a_ptrs, mask=m_ok[:, None], other=0.0), tl.load(b_ptrs), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        acc = acc * (tl.load(xs_ptr) * tl.load(ws_ptr))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(tl.float16), mask=m_ok[:, None])

    @triton.jit
    def geglu_gemm_tma_kernel(x_desc, w_desc, b_ptr, out_desc, xs_ptr, ws_ptr, os_ptr, M, N, K,
                              QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """geglu_gemm_kernel with its tiles moved by the Hopper's TMA (host tensor descriptors: x [M, K] in
        [BLOCK_M, BLOCK_K] blocks, W [2N, K] in [BLOCK_N, BLOCK_K], out [M, N] in [BLOCK_M, BLOCK_N]): no pointer
        tensors in registers, the rows past M read as zeros and not written."""
        pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k])
            acc_h = tl.dot(a, w_desc.load([off_n, k]).T, acc_h)
            acc_g = tl.dot(a, w_desc.load([N + off_n, k]).T, acc_g)
        y = geglu_epilogue(acc_h, acc_g, b_ptr, xs_ptr, ws_ptr, os_ptr, off_n, N, QUANT, HAS_BIAS, BLOCK_N)
        out_desc.store([off_m, off_n], y.to(out_desc.dtype))

    @triton.jit
    def geglu_gemm_block_kernel(x_ptr, w_ptr, b_ptr, out_ptr, xs_ptr, ws_ptr, os_ptr, M, N, K,
                                QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """geglu_gemm_kernel with block pointers: a tile's address is a base and two offsets, not a tensor of
        pointers (fewer registers for addresses), and only plain pointers cross the call, which an
        exported graph carries where a host tensor descriptor made inside a custom op is still a constant to
        AOTInductor (export_triton_probe.py). W [2N, K] row-major read as [K, 2N], column-major."""
        pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        a_blk = tl.make_block_ptr(x_ptr, shape=(M, K), strides=(K, 1), offsets=(off_m, 0),
                                  block_shape=(BLOCK_M, BLOCK_K), order=(1, 0))
        h_blk = tl.make_block_ptr(w_ptr, shape=(K, 2 * N), strides=(1, K), offsets=(0, off_n),
                                  block_shape=(BLOCK_K, BLOCK_N), order=(0, 1))
        g_blk = tl.make_block_ptr(w_ptr, shape=(K, 2 * N), strides=(1, K), offsets=(0, N + off_n),
                                  block_shape=(BLOCK_K, BLOCK_N), order=(0, 1))
        acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            a = tl.load(a_blk, boundary_check=(0,), padding_option="zero")
            acc_h = tl.dot(a, tl.load(h_blk), acc_h)
            acc_g = tl.dot(a, tl.load(g_blk), acc_g)
            a_blk = tl.advance(a_blk, (0, BLOCK_K))
            h_blk = tl.advance(h_blk, (BLOCK_K, 0))
            g_blk = tl.advance(g_blk, (BLOCK_K, 0))
        y = geglu_epilogue(acc_h, acc_g, b_ptr, xs_ptr, ws_ptr, os_ptr, off_n, N, QUANT, HAS_BIAS, BLOCK_N)
        o_blk = tl.make_block_ptr(out_ptr, shape=(M, N), strides=(N, 1), offsets=(off_m, off_n),
                                  block_shape=(BLOCK_M, BLOCK_N), order=(1, 0))
        tl.store(o_blk, y.to(out_ptr.dtype.element_ty), boundary_check=(0,))

    @triton.jit
    def gemm_tma_kernel(x_desc, w_desc, b_ptr, out_desc, xs_ptr, ws_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """gemm_kernel with TMA tiles (geglu_gemm_tma_kernel's descriptors; out [M, N] fp16)."""
        pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        acc = acc * (tl.load(xs_ptr) * tl.load(ws_ptr))
        if HAS_BIAS:
            acc += tl.load(b_ptr + off_n + tl.arange(0, BLOCK_N)).to(tl.float32)[None, :]
        out_desc.store([off_m, off_n], acc.to(tl.float16))

    @triton.jit
    def geglu_kernel(y_ptr, out_ptr, os_ptr, M, N, QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        """out[m, n] = y[m, n] * gelu(y[m, N + n]) (QUANT: / out_scale, saturated, FP8); y [M, 2N] fp16, N a multiple of
        BLOCK_N: a 2D tile of contiguous columns, no index division."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm[:, None] < M
        row = y_ptr + rm.to(tl.int64)[:, None] * (2 * N) + rn[None, :]
        h = tl.load(row, mask=m_ok, other=0.0).to(tl.float32)
        g = tl.load(row + N, mask=m_ok, other=0.0).to(tl.float32)
        y = h * (0.5 * g * (1.0 + tl.math.erf(g * K_SQRT_HALF)))
        if QUANT:
            y = tl.minimum(tl.maximum(y / tl.load(os_ptr), -K_FP8_MAX), K_FP8_MAX)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=m_ok)


class FfShape:
    """One feed-forward's `proj` at one attention level: K -> 2 x inner over `tokens` tokens a row."""

    def __init__(self, k: int, inner: int, tokens: int, bias: bool):
        self.k, self.inner, self.tokens, self.bias = k, inner, tokens, bias

    @property
    def key(self) -> tuple:
        return (self.k, self.inner, self.tokens, self.bias)

    @property
    def label(self) -> str:
        return f"{self.k}->2x{self.inner} over {self.tokens} tokens"

    def flops(self, rows: int) -> float:
        return 2.0 * rows * self.tokens * self.k * 2 * self.inner


def ff_calls(model: str, side: int) -> dict[str, Counter]:
    """"unet" / "controlnet" -> FfShape key -> calls a step, from the model's config built on the meta device (no
    weights): each GEGLU's level read off its block's name."""
    from diffusers import ControlNetModel, UNet2DConditionModel
    from diffusers.models.activations import GEGLU

    from storyboard_cli.models.loader import sdxl_config_folder
    from storyboard_cli.models.tiny import tiny_folder

    folder = tiny_folder() if model == "tiny" else sdxl_config_folder()
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        nets = {"unet": unet, "controlnet": ControlNetModel.from_unet(unet, load_weights_from_unet=False)}
    levels = len(unet.config.block_out_channels)
    out = {}
    for kind, net in nets.items():
        seen: Counter = Counter()
        for name, m in net.named_modules():
            if not isinstance(m, GEGLU):
                continue
            found = re.match(r"(down|up)_blocks\.(\d+)\.", name)
            down = levels - 1 if found is None else int(found[2]) if found[1] == "down" else levels - 1 - int(found[2])
            latent = side // 8 // 2 ** down
            seen[FfShape(m.proj.in_features, m.proj.out_features // 2, latent * latent, m.proj.bias is not None).key] += 1
        out[kind] = seen
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()


def timed(fn: Callable, iters: int, repeats: int) -> float:
    """ms per call: replays of a CUDA graph of 10 calls (attention_scout's); on the CPU (the smoke run) one call's
    wall."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    return time_graph_ms(fn, iters, repeats)


def pick_k(k: int, want: int) -> int:
    return next(b for b in (want, 128, 64, 32, 16) if b <= want and k % b == 0)


class Operands:
    """One shape's tensors at `rows` in one precision: x [M, K] (a LayerNorm's output, unit scale), W [2 inner, K] (the
    init's scale), the bias, and in FP8 the static scales: x's and W's amax / 448, and the output's (the next Linear's
    input scale) from GEGLU's own output amax, as calibration finds it."""

    def __init__(self, shape: FfShape, rows: int, precision: str, device: str):
        g = torch.Generator(device="cpu").manual_seed(rows * 7 + shape.k)
        m, k, n2 = rows * shape.tokens, shape.k, 2 * shape.inner
        self.m, self.n = m, shape.inner
        dt = torch.float16 if device == "cuda" else torch.float32
        x = torch.randn(m, k, generator=g).to(device, dt)
        w = (torch.randn(n2, k, generator=g) / k ** 0.5).to(device, dt)
        self.bias = (torch.randn(n2, generator=g) * 0.02).to(device, dt) if shape.bias else None
        self.quant = precision == "fp8"
        one = torch.ones((), device=device, dtype=torch.float32)
        if self.quant:
            self.xs = (x.abs().amax().float() / FP8_MAX).reshape(())
            self.ws = (w.abs().amax().float() / FP8_MAX).reshape(())
            self.x = (x.float() / self.xs).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            self.w = (w.float() / self.ws).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            self.xs, self.ws, self.x, self.w = one, one, x, w
        # the fp32 arithmetic of these operands: the reference every variant is measured against
        y = (self.x.float() * self.xs) @ (self.w.float() * self.ws).t()
        if self.bias is not None:
            y += self.bias.float()
        h, gate = y.chunk(2, dim=-1)
        self.want = h * F.gelu(gate)
        self.os = (self.want.abs().amax() / FP8_MAX).reshape(()) if self.quant else one
        self.out_dtype = FP8 if self.quant else dt

    def out(self) -> torch.Tensor:
        return torch.empty(self.m, self.n, device=self.x.device, dtype=self.out_dtype)

    def value(self, out: torch.Tensor) -> torch.Tensor:
        """An output as the values it stands for (FP8: times its scale)."""
        return out.float() * self.os if self.quant else out.float()

    def gemm(self) -> Callable[[], torch.Tensor]:
        """cuBLAS's GEMM, as the compiled step calls it: fp16 out, the bias in its epilogue."""
        if not self.quant:
            return lambda: F.linear(self.x, self.w, self.bias)
        if self.x.device.type == "cpu":  # no FP8 GEMM on the CPU: the same arithmetic in float32
            return lambda: ((self.x.float() * self.xs) @ (self.w.float() * self.ws).t()
                            + (0 if self.bias is None else self.bias.float())).half()
        return lambda: torch._scaled_mm(self.x, self.w.t(), scale_a=self.xs, scale_b=self.ws, bias=self.bias,
                                        out_dtype=torch.float16)

    def geglu(self, y: torch.Tensor) -> torch.Tensor:
        """GEGLU (and the quantisation) in torch, as the compiled step's source has it."""
        h, gate = y.chunk(2, dim=-1)
        out = h * F.gelu(gate)
        return (out / self.os).clamp(-FP8_MAX, FP8_MAX).to(FP8) if self.quant else out


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def programs_at_once(device: torch.device) -> int:
    """How many programs a persistent grid has: the GPU's SMs (4 in Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fused_call(ops: Operands, config: tuple, form: str = "pointer") -> Callable[[], torch.Tensor]:
    """A call of the fused kernel of `form`: pointer (geglu_gemm_kernel), tma (geglu_gemm_tma_kernel, the operands
    as tensor descriptors), block (geglu_gemm_block_kernel) or persistent (geglu_gemm_persistent_kernel, one
    program an SM)."""
    bm, bn, bk, warps, stages, group = config
    bk = pick_k(ops.x.shape[1], bk)
    out = ops.out()
    tma = form == "tma"
    x, w, o = (_descriptor(ops.x, [bm, bk]), _descriptor(ops.w, [bn, bk]), _descriptor(out, [bm, bn])) if tma \
        else (ops.x, ops.w, out)
    kernel = {"pointer": geglu_gemm_kernel, "tma": geglu_gemm_tma_kernel, "block": geglu_gemm_block_kernel,
              "persistent": geglu_gemm_persistent_kernel}[form]
    grid = (triton.cdiv(ops.m, bm) * (ops.n // bn),)
    if form == "persistent":
        grid = (programs_at_once(ops.x.device),)

    def call():
        kernel[grid](x, w, ops.bias if ops.bias is not None else ops.xs, o, ops.xs, ops.ws, ops.os, ops.m, ops.n,
                     ops.x.shape[1], QUANT=ops.quant, HAS_BIAS=ops.bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
        return out
    return call


def gemm_call(ops: Operands, config: tuple, tma: bool = False) -> Callable[[], torch.Tensor]:
    """A call of gemm_kernel over the whole [M, 2 x inner] (tma: gemm_tma_kernel)."""
    bm, bn, bk, warps, stages, group = config
    bk = pick_k(ops.x.shape[1], bk)
    n2 = 2 * ops.n
    out = torch.empty(ops.m, n2, device=ops.x.device, dtype=torch.float16)
    x, w, o = (_descriptor(ops.x, [bm, bk]), _descriptor(ops.w, [bn, bk]), _descriptor(out, [bm, bn])) if tma \
        else (ops.x, ops.w, out)
    kernel = gemm_tma_kernel if tma else gemm_kernel
    grid = (triton.cdiv(ops.m, bm) * (n2 // bn),)

    def call():
        kernel[grid](x, w, ops.bias if ops.bias is not None else ops.xs, o, ops.xs, ops.ws, ops.m, n2, ops.x.shape[1],
                     HAS_BIAS=ops.bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                     num_warps=warps, num_stages=stages)
        return out
    return call


def geglu_call(ops: Operands, y: torch.Tensor, config: tuple) -> Callable[[], torch.Tensor]:
    bm, bn, warps = config
    out = ops.out()
    grid = (triton.cdiv(ops.m, bm), ops.n // bn)

    def call():
        geglu_kernel[grid](y, out, ops.os, ops.m, ops.n, QUANT=ops.quant, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        return out
    return call


def best(res: dict, name: str, make: Callable[[tuple], Callable], configs: list, iters: int, repeats: int,
         fits: Callable[[tuple], bool]):
    """The fastest config's call (its ms and config in `res`), or None."""
    found = None
    for config in configs:
        if not fits(config):
            continue
        try:
            call = make(config)
            ms = timed(call, iters, repeats)
        except Exception as exc:  # noqa: BLE001 - a config the shape cannot take (shared memory, registers): the next
            res.setdefault(f"{name}_failed", {})[str(config)] = last_line(exc)
            continue
        if found is None or ms < found[0]:
            found = (ms, config, call)
    if found is None:
        return None
    res[f"{name}_ms"], res[f"{name}_config"] = found[0], list(found[1])
    return found[2]


def measure(shape: FfShape, rows: int, precision: str, device: str, smoke: bool, iters: int, repeats: int,
            compiled: dict) -> dict:
    """Each variant's ms and error for one shape at `rows` in `precision`."""
    ops = Operands(shape, rows, precision, device)
    res: dict = {"shape": shape.label, "rows": rows, "precision": precision,
                 "gflop": round(shape.flops(rows) / 1e9, 2)}
    gemm = ops.gemm()
    y = gemm()
    res["cublas_ms"] = timed(gemm, iters, repeats)
    key = (shape.key, rows, precision)
    if device == "cuda":  # the compiled step's pair, and its GEGLU kernel alone (inductor, one graph each)
        compiled[key] = torch.compile(lambda: ops.geglu(gemm()), dynamic=False)
        compiled[(key, "geglu")] = torch.compile(lambda: ops.geglu(y), dynamic=False)
        production, alone = compiled[key], compiled[(key, "geglu")]
    else:
        production, alone = (lambda: ops.geglu(gemm())), (lambda: ops.geglu(y))
    res["production_ms"] = timed(production, iters, repeats)
    res["geglu_compiled_ms"] = timed(alone, iters, repeats)
    res["production_err"] = rel(ops.value(production()), ops.want)
    if triton is None:
        res["triton"] = TRITON_MISSING
        return rounded(res)
    cfg = (SMOKE_FUSED, SMOKE_GEMM, SMOKE_GEGLU) if smoke else (FUSED_CONFIGS, GEMM_CONFIGS, GEGLU_CONFIGS)
    tiled = best(res, "geglu_tiled", lambda c: geglu_call(ops, y, c), cfg[2], iters, repeats,
                 lambda c: ops.n % c[1] == 0)
    if tiled is not None:
        res["geglu_tiled_err"] = rel(ops.value(tiled()), ops.want)
        config = tuple(res["geglu_tiled_config"])
        res["cublas+geglu_tiled_ms"] = timed(lambda: geglu_call(ops, gemm(), config)(), iters, repeats)
    exact = (ops.x.float() * ops.xs) @ (ops.w.float() * ops.ws).t() + (0 if ops.bias is None else ops.bias.float())
    for name, tma in (("triton_gemm", False), ("triton_gemm_tma", True)):
        plain = best(res, name, lambda c, tma=tma: gemm_call(ops, c, tma), cfg[1][precision], iters, repeats,
                     lambda c: (2 * ops.n) % c[1] == 0)
        if plain is not None:
            res[f"{name}_err"] = rel(plain().float(), exact)
    for name, form in (("fused", "pointer"), ("fused_tma", "tma"), ("fused_block", "block"),
                       ("fused_persistent", "persistent")):
        fused = best(res, name, lambda c, form=form: fused_call(ops, c, form), cfg[0][precision], iters, repeats,
                     lambda c: ops.n % c[1] == 0)
        if fused is not None:
            got = ops.value(fused())
            res[f"{name}_err"] = rel(got, ops.want)
            res[f"{name}_vs_production"] = rel(got, ops.value(production()))
    return rounded(res, shape.flops(rows))


def rounded(res: dict, flops: float | None = None) -> dict:
    for k in [k for k in res if k.endswith("_ms")]:
        if flops and k in ("cublas_ms", "production_ms", "triton_gemm_ms", "triton_gemm_tma_ms", "fused_ms",
                           "fused_tma_ms", "fused_block_ms", "fused_persistent_ms", "cublas+geglu_tiled_ms"):
            res[k.replace("_ms", "_tflops")] = round(flops / res[k] / 1e9, 1) if res[k] else None
        res[k] = round(res[k], 4)
    for k in [k for k in res if k.endswith(("_err", "_vs_production"))]:
        res[k] = float(f"{res[k]:.3g}")
    return res


def per_step(record: dict, calls: dict[str, Counter]) -> dict:
    """ms a step, for each net, precision and rows: production, cublas+geglu_tiled and the fused forms (each shape's
    production time where a variant has none)."""
    out = {}
    for kind, seen in calls.items():
        for s in record["shapes"]:
            if "production_ms" not in s:
                continue
            part = out.setdefault(f"{kind} {s['precision']} {s['rows']} rows", Counter())
            count = seen.get(tuple(s["key"]), 0)
            for v in ("production", "cublas+geglu_tiled", "fused", "fused_tma", "fused_block", "fused_persistent"):
                part[f"{v}_ms"] += count * s.get(f"{v}_ms", s["production_ms"])
            part["calls"] += count
    return {k: {n: round(v, 3) for n, v in part.items()} for k, part in out.items()}


POINTER_FORMS = {"fused": "pointer", "fused_block": "block", "fused_persistent": "persistent"}  # plain pointer args


def fastest(record: dict) -> tuple[int, list[tuple[dict, float | None, str | None, tuple | None]]]:
    """A record's FP8 shapes at its most rows, each with its fastest call among the forms whose arguments are plain
    pointers (the forms an artifact can hold on torch 2.11: export_triton_probe.py): (rows, [(shape, ms, form,
    config)], None where no such form ran)."""
    shapes = [s for s in record["shapes"] if s.get("precision") == "fp8" and "key" in s]
    most = max((s["rows"] for s in shapes), default=0)
    out = []
    for s in (s for s in shapes if s["rows"] == most):
        timed = [(s[f"{name}_ms"], form, tuple(s[f"{name}_config"])) for name, form in POINTER_FORMS.items()
                 if s.get(f"{name}_ms") is not None and s.get(f"{name}_config") is not None]
        out.append((s, *min(timed)) if timed else (s, None, None, None))
    return most, out


def picks(record: Path | None) -> dict[tuple[int, int], tuple[str, tuple]]:
    """Per (K, inner): the form and tile config of `fastest` in a record of this scout; {} without a record."""
    if record is None or not record.is_file():
        return {}
    _, shapes = fastest(json.loads(record.read_text()))
    return {(s["key"][0], s["key"][1]): (form, config) for s, _, form, config in shapes if form is not None}


def gate(record: Path, step_ms: float, share: float) -> tuple[bool, str]:
    """Whether the picks (each shape's `fastest`) take at least `share` of an FP8 UNet step of `step_ms` at the
    record's most rows, summed over the step's calls: (worth building, the line that says why)."""
    try:
        rec = json.loads(record.read_text())
        calls = {tuple(k): n for k, n in rec["calls_per_step"]["unet"]}
    except (OSError, ValueError, KeyError) as e:  # a scout that died before its record had its calls
        return False, f"no GEGLU record to judge by ({type(e).__name__}: {e})"
    most, shapes = fastest(rec)
    production = fused = 0.0
    for s, ms, _, _ in shapes:
        if "production_ms" in s:
            n = calls.get(tuple(s["key"]), 0)
            production += n * s["production_ms"]
            fused += n * (s["production_ms"] if ms is None else ms)
    saved = production - fused
    line = (f"the fused GEGLU with pointer arguments saves {saved:.2f} ms of the {production:.2f} ms production spends "
            f"per FP8 UNet step at {most} rows: {saved / step_ms:.1%} of a {step_ms} ms step (needs {share:.0%})")
    return saved >= share * step_ms, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the JSON record (needed but with --gate)")
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--rows", default="16,4")
    ap.add_argument("--precisions", default="fp8,fp16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds: what is not measured by then is left out")
    ap.add_argument("--smoke", action="store_true", help="tiny, 64 px, 2 rows; without CUDA, Triton's interpreter")
    ap.add_argument("--gate", type=Path, default=None, help="no run: whether this record's fused forms with pointer "
                    "arguments reach --share of a --step-ms FP8 UNet step (exit 0) or not (exit 1)")
    ap.add_argument("--step-ms", type=float, default=None)
    ap.add_argument("--share", type=float, default=0.03)
    a = ap.parse_args()
    if a.gate is not None:
        worth, line = gate(a.gate, a.step_ms, a.share)
        print(line)
        sys.exit(0 if worth else 1)
    if a.out is None:
        ap.error("--out is needed")
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if a.smoke:
        a.model, a.side, a.rows, a.iters, a.repeats = "tiny", 64, "2", 1, 1
    record = {"model": a.model, "side": a.side, "torch": torch.__version__,
              "triton": getattr(triton, "__version__", TRITON_MISSING),
              "gpu": torch.cuda.get_device_name() if cuda else None, "interpret": os.environ.get("TRITON_INTERPRET"),
              "shapes": []}
    if os.environ.get("TRITON_INTERPRET") == "1" and triton is not None:
        record["interpreter_fp8_cast"] = patch_interpreter_fp8_cast()
        patch_interpreter_index()

    def save():
        record["elapsed_s"] = round(time.perf_counter() - t0, 1)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, a.out)

    calls = ff_calls(a.model, a.side)
    record["calls_per_step"] = {kind: [[list(k), n] for k, n in seen.items()] for kind, seen in calls.items()}
    shapes = sorted({k for seen in calls.values() for k in seen}, key=lambda k: -FfShape(*k).flops(1))
    compiled: dict = {}
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references in fp32
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):  # one compiled lambda per shape, rows and precision: never eager
            setattr(torch._dynamo.config, limit, 256)
    with torch.no_grad():
        for precision in a.precisions.split(","):
            for key in shapes:
                shape = FfShape(*key)
                for rows in map(int, a.rows.split(",")):
                    if time.perf_counter() - t0 > a.budget:
                        record.setdefault("left_out", []).append(f"{precision} {shape.label} at {rows} rows")
                        continue
                    try:
                        res = measure(shape, rows, precision, device, a.smoke, a.iters, a.repeats, compiled)
                    except Exception as exc:  # noqa: BLE001 - one shape's failure never stops the rest
                        res = {"shape": shape.label, "rows": rows, "precision": precision, "error": last_line(exc)}
                    res["key"] = list(key)
                    record["shapes"].append(res)
                    print(json.dumps(res)[:400], flush=True)
                    save()
    record["per_step"] = per_step(record, calls)
    save()
    print(json.dumps(record["per_step"], indent=1))


if __name__ == "__main__":
    main()
