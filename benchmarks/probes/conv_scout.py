"""Conv scout: would FP8 convolutions (an implicit-GEMM Triton kernel) beat cuDNN's fp16 ones in the SDXL UNet? (issue 41)

The FP8 step at 8 x 1024² spends 34.6 ms of its 199.4 in cuDNN's fp16 convolutions (benchmarks/results/step/
2026-12-03-7140af6-profile.json): with the Linears in FP8, the convolutions are the largest piece still in fp16 after
attention. Torch has no FP8 convolution, so an FP8 one would be a kernel of ours: an implicit GEMM (im2col fused into
the matmul) over NHWC activations, M = images x output positions, N = output channels, K = kernel taps x input
channels, the input quantised with a static per-tensor scale (in the product: fused into the GroupNorm + SiLU before
it, as the Linears' quantisation is fused into the LayerNorm and GEGLU), the weights per output channel, the scales
and the bias applied to the fp32 accumulator, fp16 out.

The convolutions are the UNet's own: forward hooks on every Conv2d record each call's shape during one step at 1 row
(--side); each shape is then timed at --rows (16 and 4: 8 and 2 images, guided), as:
  cudnn_fp16   F.conv2d on channels_last fp16 tensors (what the compiled step runs)
  triton_fp16  the kernel below on fp16 operands (how good the kernel is at cuDNN's precision)
  triton_fp8   the kernel on float8_e4m3fn operands, the input quantised beforehand (as the fused norm would write it)
  tma_fp16, tma_fp8   the same arithmetic for stride 1 with the tiles moved by the TMA (`conv_tma_kernel`: 4D
               boxes of the NHWC input, the padding read as zeros): no pointer tensors in registers (compiled for
               sm_90a with a launch's hints, one pointer config of twelve spills 156 B, no TMA one does:
               benchmarks/results/step/2026-12-05-131c71a-sm90-compile.json)
  quantise     the input's quantisation alone, in torch (the cost if it were not fused: an upper bound)
  im2col_fp8   no kernel of ours: the FP8 columns written out (a strided view of the padded input, copied), then
               cuBLAS's FP8 GEMM (torch._scaled_mm, per-tensor scales), the quantisation inside the call
each in ms (CUDA events, median of --repeats loops of --iters calls), TFLOPS, and its relative L2 error against the
fp32 convolution of the same fp16 operands (on --error-rows rows). ms per step = the sum over the UNet's calls. The
kernel is tuned per shape over a few tile configs. And what FP8 convolutions would do to the UNet's noise prediction:
the eager UNet with every tiled convolution's input and weight rounded through FP8, against it in fp16, at t = 999,
500 and 50 (`unet_error_fp8_convs`; the product's FP8 Linears measured 3.4e-2 to 3.5e-2 so). The shapes a tile cannot take (input channels not a multiple of
16, the 4-channel conv_in and conv_out) stay cuDNN's and are counted in its column only.

    python benchmarks/probes/conv_scout.py --out conv.json                    # CUDA (H200): about 2 minutes
    python benchmarks/probes/conv_scout.py --out /tmp/c.json --smoke          # CPU: tiny, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
# triton as attention_scout imports it (under --smoke without CUDA: its interpreter)
from attention_scout import TRITON_MISSING, last_line, tl, triton  # noqa: E402
from attention_scout import time_ms as cuda_ms  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CONFIGS = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4),
]
SMOKE_CONFIGS = [(32, 32, 4, 1)]

if triton is not None:
    # the pointer kernel is the product's (engine/kernels/conv8_triton.py): x_scale read from a pointer, fp16 or FP8
    from storyboard_cli.engine.kernels.conv8_triton import conv_fp8_kernel as conv_kernel  # noqa: E402


if triton is not None:
    @triton.jit
    def conv_tma_kernel(x_desc, w_desc, out_desc, scale_ptr, bias_ptr, x_scale, H, W, C, N,
                        R: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, TILE_H: tl.constexpr,
                        TILE_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """conv_kernel for stride 1 with its tiles moved by the TMA: a program's TILE_H x TILE_W output positions of
        one image (its M tile) read, for each tap (r, s), the input box shifted by (r - PAD, s - PAD) from a 4D
        descriptor over x NHWC [imgs, H, W, C] (the positions outside the image read as zeros: the padding), the
        weights from a 2D one over w [N, R S C], and the tile written through a 4D one over out [imgs, H, W, N] (the
        positions past the image's edge not written). No pointer tensors in registers."""
        pid_m = tl.program_id(0)
        tiles_w = (W + TILE_W - 1) // TILE_W
        tiles = ((H + TILE_H - 1) // TILE_H) * tiles_w
        img = pid_m // tiles
        p0 = (pid_m % tiles) // tiles_w * TILE_H
        q0 = (pid_m % tiles) % tiles_w * TILE_W
        n0 = tl.program_id(1) * BLOCK_N
        acc = tl.zeros((TILE_H * TILE_W, BLOCK_N), dtype=tl.float32)
        for rs in range(R * S):
            r = rs // S
            s = rs % S
            for c0 in range(0, C, BLOCK_K):
                a = tl.reshape(x_desc.load([img, p0 + r - PAD, q0 + s - PAD, c0]), (TILE_H * TILE_W, BLOCK_K))
                acc = tl.dot(a, w_desc.load([n0, rs * C + c0]).T, acc)
        rn = n0 + tl.arange(0, BLOCK_N)
        acc = acc * (tl.load(scale_ptr + rn) * x_scale)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn)[None, :]
        out_desc.store([img, p0, q0, n0], tl.reshape(acc.to(tl.float16), (1, TILE_H, TILE_W, BLOCK_N)))


class ConvShape:
    """One of the UNet's Conv2d calls: its input and weight shapes, stride and padding (at 1 row)."""

    def __init__(self, c: int, h: int, w: int, n: int, r: int, s: int, stride: int, pad: int, bias: bool):
        self.c, self.h, self.w, self.n, self.r, self.s, self.stride, self.pad, self.bias = \
            c, h, w, n, r, s, stride, pad, bias
        self.p = (h + 2 * pad - r) // stride + 1
        self.q = (w + 2 * pad - s) // stride + 1

    @property
    def key(self) -> tuple:
        return (self.c, self.h, self.w, self.n, self.r, self.s, self.stride, self.pad, self.bias)

    @property
    def label(self) -> str:
        return f"{self.c}->{self.n} {self.r}x{self.s}/{self.stride} at {self.h}x{self.w}"

    def flops(self, rows: int) -> float:
        return 2.0 * rows * self.p * self.q * self.n * self.r * self.s * self.c

    def tiles(self) -> bool:
        return self.c % 16 == 0 and self.n % 16 == 0


def unet_call(unet, rows: int, side: int, timestep: float, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One eager UNet call on unit-scale inputs at `timestep` (the step's float32 timestep)."""
    from storyboard_cli.engine.kernels.export import example_inputs

    torch.manual_seed(seed)
    args = example_inputs("unet", unet, rows, side // 8, side // 8)
    t = torch.full((rows,), timestep, device=unet.device)
    return lambda: unet(args[0], t, encoder_hidden_states=args[2],
                        added_cond_kwargs={"text_embeds": args[3], "time_ids": args[4]}, return_dict=False)[0]


def unet_convs(unet, side: int) -> Counter:
    """ConvShape key -> calls in one UNet step at 1 row (hooks on every Conv2d during a forward)."""
    seen: Counter = Counter()

    def hook(module, args, _out):
        x = args[0]
        seen[ConvShape(x.shape[1], x.shape[2], x.shape[3], module.out_channels, *module.kernel_size,
                       module.stride[0], module.padding[0], module.bias is not None).key] += 1

    handles = [m.register_forward_hook(hook) for m in unet.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        unet_call(unet, 1, side, 500.0)()
    for h in handles:
        h.remove()
    return seen


def fake_fp8(x: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """x rounded through float8_e4m3fn at its own scale (per tensor, or per slice over `dims`'s complement)."""
    amax = x.abs().amax() if dims is None else x.abs().amax(dim=dims, keepdim=True)
    scale = amax.float().clamp_min(1e-12) / FP8_MAX
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def unet_error(unet, side: int, rows: int, timesteps: tuple[float, ...]) -> dict:
    """The eager UNet's noise prediction with every tiled convolution's input (per tensor) and weight (per output
    channel) rounded through FP8, against the same UNet in its dtype: relative L2 error at each timestep. The product's
    FP8 Linears measured 3.4e-2 to 3.5e-2 this way (docs/PERFORMANCE.md, engine/variants.py)."""
    convs = [m for m in unet.modules() if isinstance(m, torch.nn.Conv2d)
             and m.in_channels % 16 == 0 and m.out_channels % 16 == 0]
    out = {}
    with torch.no_grad():
        for t in timesteps:
            call = unet_call(unet, rows, side, t, seed=int(t))
            want = call().float()
            weights = [m.weight.data for m in convs]
            hooks = [m.register_forward_pre_hook(lambda _m, args: (fake_fp8(args[0], None),)) for m in convs]
            try:
                for m in convs:
                    m.weight.data = fake_fp8(m.weight.data, (1, 2, 3))
                got = call().float()
            finally:
                for m, w in zip(convs, weights):
                    m.weight.data = w
                for h in hooks:
                    h.remove()
            out[f"t{t:g}"] = rel(got, want)
    return out


def block_k(c: int) -> int:
    return next(k for k in (128, 64, 32, 16) if c % k == 0)


def triton_conv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, x_scale: float,
                shape: ConvShape, config: tuple) -> Callable[[], torch.Tensor]:
    """A call of the kernel: x NHWC [rows, H, W, C], w [N, R, S, C] (fp16 or fp8), out NHWC fp16."""
    rows = x.shape[0]
    m = rows * shape.p * shape.q
    out = torch.empty(rows, shape.p, shape.q, shape.n, device=x.device, dtype=torch.float16)
    bm, bn, warps, stages = config
    grid = (triton.cdiv(m, bm), triton.cdiv(shape.n, bn))
    bk = min(block_k(shape.c), 64 if x.dtype == torch.float16 else 128)

    xs = torch.tensor(x_scale, dtype=torch.float32, device=x.device)

    def call():
        conv_kernel[grid](x, w, out, scale, xs, bias if bias is not None else scale,
                          m, shape.h, shape.w, shape.c, shape.p, shape.q, shape.n,
                          R=shape.r, S=shape.s, STRIDE=shape.stride, PAD=shape.pad, BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=bk, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
        return out
    return call


TMA_CONFIGS = [  # TILE_H, TILE_W, BLOCK_N, num_warps, num_stages
    (8, 16, 128, 8, 3), (8, 16, 256, 8, 3), (16, 16, 128, 8, 3), (8, 8, 128, 4, 4), (16, 8, 128, 8, 4),
]
SMOKE_TMA_CONFIGS = [(4, 4, 16, 4, 1)]


def tma_takes(shape: ConvShape) -> bool:
    """The TMA kernel's shapes: stride 1, channels a multiple of 16 (the descriptors' 16-byte rows)."""
    return shape.stride == 1 and shape.tiles() and shape.p == shape.h and shape.q == shape.w


def triton_conv_tma(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, x_scale: float,
                    shape: ConvShape, config: tuple) -> Callable[[], torch.Tensor]:
    """A call of conv_tma_kernel: x NHWC [rows, H, W, C], w [N, R, S, C] (fp16 or fp8), out NHWC fp16."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = x.shape[0]
    th, tw, bn, warps, stages = config
    bn = min(bn, shape.n)
    bk = min(block_k(shape.c), 64 if x.dtype == torch.float16 else 128)
    out = torch.empty(rows, shape.p, shape.q, shape.n, device=x.device, dtype=torch.float16)
    x_d = TensorDescriptor.from_tensor(x, [1, th, tw, bk])
    w_d = TensorDescriptor.from_tensor(w.reshape(shape.n, -1), [bn, bk])
    o_d = TensorDescriptor.from_tensor(out, [1, th, tw, bn])
    grid = (rows * triton.cdiv(shape.p, th) * triton.cdiv(shape.q, tw), triton.cdiv(shape.n, bn))

    def call():
        conv_tma_kernel[grid](x_d, w_d, o_d, scale, bias if bias is not None else scale, x_scale, shape.h, shape.w,
                              shape.c, shape.n, R=shape.r, S=shape.s, PAD=shape.pad, TILE_H=th, TILE_W=tw,
                              BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
        return out
    return call


def time_ms(fn: Callable, iters: int, repeats: int) -> float:
    """attention_scout's CUDA-event timing (3 warm-up calls); on the CPU (the smoke run) one call's wall."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    return cuda_ms(fn, iters, repeats, warmup=3)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()


def patch_interpreter_index() -> None:
    """Smoke only: Triton's interpreter turns a loop bound into an int with `int(array)`, which NumPy 2 refuses for a
    1-element array that is not 0-dimensional (the runtime argument C); the bound is read with `.item()` instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor):
        original(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])
    interpreter._patch_lang_tensor = patched


def measure(shape: ConvShape, rows: int, device: str, configs: list, iters: int, repeats: int,
            error_rows: int) -> dict:
    """Each variant's ms, TFLOPS and error for one shape at `rows`."""
    g = torch.Generator(device="cpu").manual_seed(0)
    # an activation after GroupNorm + SiLU, and a weight at the init's scale
    x = F.silu(torch.randn(rows, shape.c, shape.h, shape.w, generator=g)).to(device, torch.float16)
    w = (torch.randn(shape.n, shape.c, shape.r, shape.s, generator=g) / (shape.c * shape.r * shape.s) ** 0.5)
    w = w.to(device, torch.float16)
    bias = torch.randn(shape.n, generator=g).to(device, torch.float32) * 0.1 if shape.bias else None
    x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    bias16 = None if bias is None else bias.half()
    res: dict = {"shape": shape.label, "rows": rows, "gflop": round(shape.flops(rows) / 1e9, 2)}
    e = min(rows, error_rows)
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False  # a float32 reference, not TF32
    try:
        want = F.conv2d(x[:e].float(), w.float(), None if bias is None else bias, shape.stride, shape.pad)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    want = want.permute(0, 2, 3, 1)  # NHWC, as the kernel writes
    cudnn = lambda: F.conv2d(x_cl, w_cl, bias16, shape.stride, shape.pad)  # noqa: E731
    res["cudnn_fp16_ms"] = time_ms(cudnn, iters, repeats)
    res["cudnn_fp16_err"] = rel(F.conv2d(x_cl[:e], w_cl, bias16, shape.stride, shape.pad).permute(0, 2, 3, 1), want)
    if not shape.tiles():
        res["triton"] = "not tiled: channels not a multiple of 16"
        return _rounded(res, shape, rows)
    x_nhwc = x.permute(0, 2, 3, 1).contiguous()
    w_nrsc = w.permute(0, 2, 3, 1).contiguous()
    ones = torch.ones(shape.n, device=device, dtype=torch.float32)
    x_amax = x.abs().amax().float().item()
    x_s = max(x_amax, 1e-12) / FP8_MAX
    w_s = w.abs().amax(dim=(1, 2, 3)).float().clamp_min(1e-12) / FP8_MAX  # per output channel
    quant = lambda: (x_nhwc.float() / x_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # noqa: E731
    x8 = quant()
    w8 = (w_nrsc.float() / w_s[:, None, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    res["quantise_ms"] = time_ms(quant, iters, repeats)
    try:  # the FP8 convolution with no kernel of ours: the columns written out, then cuBLAS's FP8 GEMM
        call = im2col_fp8(x_nhwc, w_nrsc, x_s, shape)
        res["im2col_fp8_ms"] = time_ms(call, iters, repeats)
        out = im2col_fp8(x_nhwc[:e].contiguous(), w_nrsc, x_s, shape)()
        res["im2col_fp8_err"] = rel(out.view(e, shape.p, shape.q, shape.n) + (0 if bias is None else bias.half()),
                                    want)
    except Exception as exc:  # noqa: BLE001 - no FP8 GEMM on this device
        res["im2col_fp8_failed"] = last_line(exc)
    if triton is None:
        res["triton"] = TRITON_MISSING
        return _rounded(res, shape, rows)
    families = [(triton_conv, configs, "triton")]
    if tma_takes(shape):
        families.append((triton_conv_tma, SMOKE_TMA_CONFIGS if configs is SMOKE_CONFIGS else TMA_CONFIGS, "tma"))
    for kernel, kernel_configs, family in families:
        for precision, xs, ws, sc, xsc in (("fp16", x_nhwc, w_nrsc, ones, 1.0), ("fp8", x8, w8, w_s, x_s)):
            name, best = f"{family}_{precision}", None
            for config in kernel_configs:
                try:
                    call = kernel(xs, ws, sc, bias, xsc, shape, config)
                    ms = time_ms(call, iters, repeats)
                except Exception as exc:  # noqa: BLE001 - a config the shape cannot take (shared memory): the next
                    res.setdefault(f"{name}_failed", {})[str(config)] = last_line(exc)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, config)
            if best is None:
                continue
            res[f"{name}_ms"], res[f"{name}_config"] = best
            out = kernel(xs[:e].contiguous(), ws, sc, bias, xsc, shape, best[1])()
            res[f"{name}_err"] = rel(out, want)
    return _rounded(res, shape, rows)


def _rounded(res: dict, shape: ConvShape, rows: int) -> dict:
    for k in [k for k in res if k.endswith("_ms")]:
        if k != "quantise_ms":  # a convolution's time: its FLOPs' rate
            res[k.replace("_ms", "_tflops")] = round(shape.flops(rows) / res[k] / 1e9, 1) if res[k] else None
        res[k] = round(res[k], 4)
    return res


def im2col_fp8(x_nhwc: torch.Tensor, w_nrsc: torch.Tensor, x_s: float, shape: ConvShape) -> Callable[[], torch.Tensor]:
    """The convolution as columns [M, R*S*C] in FP8 (the padded input read through a strided view, then copied) times
    the weights [R*S*C, N] in cuBLAS's FP8 GEMM (`torch._scaled_mm`, per-tensor scales both: its per-column weight
    scales need per-row input scales), fp16 out [M, N], no bias. The input is quantised inside the call."""
    rows = x_nhwc.shape[0]
    w_s = w_nrsc.abs().amax().float().clamp_min(1e-12) / FP8_MAX
    w8 = (w_nrsc.float() / w_s).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(shape.n, -1)
    scale_a = torch.tensor(x_s, device=x_nhwc.device)
    hp, wp = shape.h + 2 * shape.pad, shape.w + 2 * shape.pad
    padded = torch.zeros(rows, hp, wp, shape.c, device=x_nhwc.device, dtype=torch.uint8)
    st = shape.stride

    def call():
        x8 = (x_nhwc.float() / x_s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        padded[:, shape.pad:shape.pad + shape.h, shape.pad:shape.pad + shape.w].copy_(x8.view(torch.uint8))
        cols = padded.as_strided((rows, shape.p, shape.q, shape.r, shape.s, shape.c),
                                 (hp * wp * shape.c, st * wp * shape.c, st * shape.c, wp * shape.c, shape.c, 1))
        cols = cols.reshape(rows * shape.p * shape.q, -1).view(FP8)
        return torch._scaled_mm(cols, w8.t(), scale_a=scale_a, scale_b=w_s, out_dtype=torch.float16)
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="sdxl-random")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--rows", default="16,4")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--error-rows", type=int, default=2)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds: shapes not measured by then are left out")
    ap.add_argument("--smoke", action="store_true", help="tiny, 64 px, 2 rows; without CUDA, Triton's interpreter")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if a.smoke:
        a.model, a.side, a.rows, a.iters, a.repeats = "tiny", 64, "2", 1, 1
    configs = SMOKE_CONFIGS if a.smoke and not cuda else CONFIGS
    if os.environ.get("TRITON_INTERPRET") == "1" and triton is not None:
        patch_interpreter_index()
    record = {"model": a.model, "side": a.side, "torch": torch.__version__,
              "triton": getattr(triton, "__version__", TRITON_MISSING), "gpu": torch.cuda.get_device_name() if cuda
              else None, "interpret": os.environ.get("TRITON_INTERPRET"), "configs": configs, "shapes": []}

    def save():
        record["elapsed_s"] = round(time.perf_counter() - t0, 1)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, a.out)

    from storyboard_cli.models.loader import load_sdxl

    unet = load_sdxl(a.model, None, device, torch.float16 if cuda else torch.float32).unet
    calls = unet_convs(unet, a.side)
    record["calls_per_step"] = sum(calls.values())
    record["unet_error_fp8_convs"] = unet_error(unet, a.side, 2, (999.0, 500.0, 50.0))
    print("unet error, FP8 convolutions:", record["unet_error_fp8_convs"], flush=True)
    del unet
    save()
    with torch.no_grad():
        for key, count in sorted(calls.items(), key=lambda kv: -ConvShape(*kv[0]).flops(1) * kv[1]):
            shape = ConvShape(*key)
            for rows in map(int, a.rows.split(",")):
                if time.perf_counter() - t0 > a.budget:
                    record.setdefault("left_out", []).append(f"{shape.label} at {rows} rows")
                    continue
                try:
                    res = measure(shape, rows, device, configs, a.iters, a.repeats, a.error_rows)
                except Exception as exc:  # noqa: BLE001 - one shape's failure never stops the rest
                    res = {"shape": shape.label, "rows": rows, "error": last_line(exc)}
                res["calls"] = count
                record["shapes"].append(res)
                print(json.dumps(res)[:300], flush=True)
                save()
    summary = {}
    for rows in map(int, a.rows.split(",")):
        got = [s for s in record["shapes"] if s["rows"] == rows and "cudnn_fp16_ms" in s]
        col = lambda k, fallback="cudnn_fp16_ms": round(sum(s["calls"] * s.get(k, s[fallback]) for s in got), 3)  # noqa: E731
        summary[f"{rows}_rows"] = {
            "cudnn_fp16_ms_per_step": col("cudnn_fp16_ms"),
            "triton_fp16_ms_per_step": col("triton_fp16_ms"),
            "triton_fp8_ms_per_step": col("triton_fp8_ms"),  # cuDNN's time where the kernel cannot tile
            "tma_fp16_ms_per_step": col("tma_fp16_ms"),  # and where the TMA kernel cannot (stride 2)
            "tma_fp8_ms_per_step": col("tma_fp8_ms"),
            "im2col_fp8_ms_per_step": col("im2col_fp8_ms"),
            "triton_fp8_plus_quantise_ms_per_step": round(col("triton_fp8_ms") + sum(
                s["calls"] * s.get("quantise_ms", 0.0) for s in got), 3),
            "shapes": len(got)}
    record["summary"] = summary
    save()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
