"""The FP8 step's quantisation kernels alone, at 8 x 1024² (issue 41's item 5): do inductor's tuning options make them
reach the H200's bandwidth, and are they bound by their arithmetic?

The tenth session's profile put the kernels that quantise a Linear's input into FP8 at 35 ms of the 199 ms FP8 step,
about half the bandwidth; the largest, GEGLU with its quantisation, 185 µs a call (60 calls) where its bytes need about
90. Building the whole FP8 UNet with `max_autotune_pointwise` and `coordinate_descent_tuning` took longer than a
call (docs/PERFORMANCE.md, twelfth session). This scout compiles each fused op alone, as the FP8 artifact's generated
code has it (benchmarks/results/step/*.wrapper.cpp.gz), at the step's shapes:

  geglu     [16384, 10240] fp16 -> hidden * gelu(gate) / scale, clamped, float8_e4m3fn [16384, 5120] (60 calls a step)
  geglu640  the same at the 64x64 level: [65536, 5120] -> [65536, 2560] (10 calls)
  quant     [16384, 1280] fp16 -> float8 (the attention's output before to_out: 120 calls)
  ln        LayerNorm over 1280 channels with the residual's add, then the quantisation (132 calls at that level)

each with production's options, with coordinate_descent_tuning, with max_autotune_pointwise, ln with persistent
reductions up to 2048 elements (inductor's limit is 1024: the 1280 channels loop twice; the UNet's builds since the
eighteenth session, artifacts.persistent_choices), geglu with GELU's tanh form (whether erf's arithmetic bounds it),
and geglu, quant and ln multiplying by the scale's inverse instead of dividing by the scale; µs per call by CUDA
events over a CUDA graph of --reps calls, the build's seconds, and the bound its bytes give at --tbps.

    python benchmarks/probes/pointwise_scout.py OUT.json [--reps 200] [--tbps 4.8]
    python benchmarks/probes/pointwise_scout.py /tmp/p.json --smoke      # CPU: small shapes, the code path only
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).parent))
from fp8_scout import Record  # noqa: E402

from storyboard_cli.engine.kernels.artifacts import unet_choices  # noqa: E402

FP8_MAX = 448.0
VARIANTS = {
    "production": {},
    "coordinate_descent": {"coordinate_descent_tuning": True},
    "autotune_pointwise": {"max_autotune_pointwise": True},
    "nd_tiling": {"triton.prefer_nd_tiling": True},
    "persistent_2048": {},  # ln only: built under the UNet build's choices (artifacts.unet_choices)
}
ONLY = {"geglu_tanh": ("production",), "geglu_inv": ("production",), "quant_inv": ("production",),
        "ln_inv": ("production", "persistent_2048")}  # the variants a case runs (the others: every one)


def geglu(h: torch.Tensor, scale: torch.Tensor, approximate: str = "none", inverse: bool = False) -> torch.Tensor:
    hidden, gate = h.chunk(2, dim=-1)
    x = hidden * torch.nn.functional.gelu(gate, approximate=approximate)
    return to_fp8(x, scale, inverse)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """fp8.Fp8Linear's quantisation (`x / scale`); `inverse`: `scale` holds 1 / scale and multiplies, one
    multiplication an element where the division is a dozen instructions (GEGLU's kernel is bound by its arithmetic)."""
    return (x * scale if inverse else x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quant(x: torch.Tensor, scale: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return to_fp8(x, scale, inverse)


def ln(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
       inverse: bool = False):
    h = x + residual
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), w, b)
    return h, to_fp8(y, scale, inverse)


def cases(smoke: bool, device: str, dtype: torch.dtype) -> dict:
    """name -> (function, its inputs, bytes read and written per call)."""
    k = 64 if smoke else 1

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    s = torch.tensor(0.05, device=device)
    m, m640 = 16384 // k, 65536 // k
    return {
        "geglu": (geglu, (r(m, 10240), s), m * 10240 * 2 + m * 5120),
        "geglu_tanh": (lambda h, sc: geglu(h, sc, "tanh"), (r(m, 10240), s), m * 10240 * 2 + m * 5120),
        "geglu640": (geglu, (r(m640, 5120), s), m640 * 5120 * 2 + m640 * 2560),
        "quant": (quant, (r(m, 1280), s), m * 1280 * 3),
        "ln": (ln, (r(m, 1280), r(m, 1280), r(1280), r(1280), s), m * 1280 * (2 + 2 + 2 + 1)),
        # the same with the scale's inverse multiplied (production's options, and ln's persistent choices)
        "geglu_inv": (partial(geglu, inverse=True), (r(m, 10240), 1 / s), m * 10240 * 2 + m * 5120),
        "quant_inv": (partial(quant, inverse=True), (r(m, 1280), 1 / s), m * 1280 * 3),
        "ln_inv": (partial(ln, inverse=True), (r(m, 1280), r(m, 1280), r(1280), r(1280), 1 / s),
                   m * 1280 * (2 + 2 + 2 + 1)),
    }


def per_call_us(fn, args, reps: int) -> float:
    """µs per call of `fn` in a CUDA graph of `reps` calls, as the step's kernels run: a Python loop of compiled calls
    would time their launches (tens of µs), not a kernel of 13."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        return (time.perf_counter() - t0) * 1e6 / reps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / reps


def triton_source(code: list[str]) -> str:
    """The generated Triton kernels' source (what the record keeps of production's code)."""
    text = "\n".join(code)
    at = text.find("@triton.jit")
    return text[at:at + 4000] if at >= 0 else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tbps", type=float, default=4.8, help="the bandwidth the bound is quoted at, TB/s")
    ap.add_argument("--smoke", action="store_true", help="small shapes (the CPU's code path)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    rec = Record(a.out, torch=torch.__version__, gpu=torch.cuda.get_device_name() if cuda else None, reps=a.reps,
                 tbps=a.tbps)
    results: dict = {}
    with torch.no_grad():
        for name, (fn, args, nbytes) in cases(a.smoke or not cuda, device, dtype).items():
            row = {"bound_us": round(nbytes / (a.tbps * 1e12) * 1e6, 1), "mb": round(nbytes / 1e6, 1)}
            for variant, options in VARIANTS.items():
                only = ONLY.get(name)
                if (only is not None and variant not in only) or (variant == "persistent_2048"
                                                                  and not name.startswith("ln")):
                    continue
                torch._dynamo.reset()
                compiled = torch.compile(fn, options=dict(options), dynamic=False)
                t0 = time.perf_counter()
                try:
                    with unet_choices() if variant == "persistent_2048" else nullcontext():
                        _, code = run_and_get_code(compiled, *args)
                    if cuda:
                        torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a scout records the failure and goes on
                    row[variant] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                build = time.perf_counter() - t0
                per_call_us(compiled, args, 3)
                kernels = sorted(set(re.findall(r"\b((?:triton|cpp)_\w+) = async_compile", "\n".join(code))))
                row[variant] = {"us": round(per_call_us(compiled, args, a.reps), 1), "build_s": round(build, 1),
                                "kernels": kernels}
                if variant == "production":
                    row[variant]["source"] = triton_source(code)
                results[name] = row
                rec.put("kernels", results)
    rec.put("done", True)


if __name__ == "__main__":
    main()
