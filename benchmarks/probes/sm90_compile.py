"""Compile this project's Triton kernels for the H200 (sm_90a) on a machine without a GPU: whether each compiles, and
ptxas's registers, spill stores and the shared memory of each configuration the product or a scout launches.

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel's arithmetic on the CPU, but it checks nothing of what the
GPU compiler refuses or makes slow: a global read inside a kernel that is not a constexpr is a NameError only when the
kernel is compiled, and a tile whose pointers or accumulators do not fit the 255 registers spills to local memory.
Device time is short; this catches both here. Needs Triton (and its bundled ptxas), which torch's CPU builds lack:

    PYTHONPATH=/path/to/triton python benchmarks/probes/sm90_compile.py [--only groupnorm,geglu,conv] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent))
TARGET = GPUTarget("cuda", 90, 32)
SIZES = ("M", "H", "W", "C", "P", "Q", "N")  # the convolutions' integer arguments
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_one(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...] = (), **options) -> dict:
    """One kernel configuration compiled for sm_90a: its ptxas registers, spill stores and shared memory, or why not.
    With the hints Triton's JIT gives a launch: every pointer 16-byte aligned (torch's allocations are), and the
    integer arguments in `divisible` multiples of 16 (the sizes a launch at SDXL's shapes passes, where the kernel
    does not declare them do_not_specialize). Without them no operand load is vectorised, a GEMM's loads are not
    pipelined and its tiles spill (a plain Triton GEMM at 128 x 128 x 128 FP8: 255 registers and 1.6 KB of spills,
    32 KB of shared memory at any number of stages; with them 104 registers, no spills, 96 KB at 3 stages)."""
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    row = {"kernel": fn.__name__, "constexprs": constexprs, "options": options, "divisible": list(divisible)}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n in divisible}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                           options=options)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        row["error"] = str(exc).strip().splitlines()[-1][:400]
        return row
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"], capture_output=True,
                         text=True).stderr
    Path(f.name).unlink()
    regs, spills = re.findall(r"Used (\d+) registers", log), re.findall(r"(\d+) bytes spill stores", log)
    row.update(registers=int(regs[0]) if regs else None, spill_stores=int(spills[0]) if spills else None,
               shared=k.metadata.shared)
    return row


def groupnorm() -> list[dict]:
    """The VAE decoder's GroupNorm kernels at SDXL's decoder widths, as models/groupnorm.py launches them."""
    from storyboard_cli.models import groupnorm as g

    rows, f32 = [], "*fp32"
    for c in (128, 256, 512):
        bp = max(1, g.BLOCK // c)
        for silu in (False, True):
            rows.append(compile_one(g.norm_nhwc_kernel, {"x_ptr": f32, "a_ptr": f32, "b_ptr": f32, "y_ptr": f32,
                                                         "P": "i32"}, {"C": c, "SILU": silu, "BLOCK_P": bp}, num_warps=8))
        rows.append(compile_one(g.stats_nhwc_kernel, {"x_ptr": f32, "mean_ptr": f32, "m2_ptr": f32, "P": "i32",
                                                      "PER_PROG": "i32"}, {"C": c, "G": 32, "BLOCK_P": bp}, num_warps=8))
        rows.append(compile_one(g.affine_nhwc_kernel, {"mean_ptr": f32, "m2_ptr": f32, "w_ptr": f32, "b_ptr": f32,
                                                       "a_ptr": f32, "c_ptr": f32, "P": "i32", "PER_PROG": "i32",
                                                       "PROGS": "i32", "eps": "fp32"},
                                {"C": c, "G": 32, "BLOCK_J": 32, "HAS_W": True, "HAS_B": True}, num_warps=4))
    for silu in (False, True):
        rows.append(compile_one(g.norm_nchw_kernel, {"x_ptr": f32, "a_ptr": f32, "b_ptr": f32, "y_ptr": f32,
                                                     "HW": "i32"}, {"SILU": silu, "BLOCK": g.BLOCK}, num_warps=8))
    return rows


def geglu() -> list[dict]:
    """geglu_scout.py's kernels at each of its configurations, fp8 and fp16."""
    import geglu_scout as s

    rows, mnk = [], ("M", "N", "K")
    for prec, dt in (("fp8", "fp8e4nv"), ("fp16", "fp16")):
        quant = prec == "fp8"
        for bm, bn, bk, warps, stages, grp in s.FUSED_CONFIGS[prec]:
            tiles = {"QUANT": quant, "HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": grp}
            common = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "os_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
            rows.append(compile_one(s.geglu_gemm_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": "*fp16",
                                                          "out_ptr": f"*{dt}", **common}, tiles, mnk, num_warps=warps,
                                    num_stages=stages))
            rows.append(compile_one(s.geglu_gemm_block_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}",
                                                                "b_ptr": "*fp16", "out_ptr": f"*{dt}", **common},
                                    tiles, mnk, num_warps=warps, num_stages=stages))
            rows.append(compile_one(s.geglu_gemm_persistent_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}",
                                                                     "b_ptr": "*fp16", "out_ptr": f"*{dt}", **common},
                                    tiles, mnk, num_warps=warps, num_stages=stages))
            rows.append(compile_one(s.geglu_gemm_tma_kernel, {"x_desc": f"tensordesc<{dt}[{bm}, {bk}]>",
                                                              "w_desc": f"tensordesc<{dt}[{bn}, {bk}]>",
                                                              "b_ptr": "*fp16",
                                                              "out_desc": f"tensordesc<{dt}[{bm}, {bn}]>", **common},
                                    tiles, mnk, num_warps=warps, num_stages=stages))
        for bm, bn, bk, warps, stages, grp in s.GEMM_CONFIGS[prec]:
            tiles = {"HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": grp}
            common = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
            rows.append(compile_one(s.gemm_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": "*fp16",
                                                    "out_ptr": "*fp16", **common}, tiles, mnk, num_warps=warps,
                                    num_stages=stages))
            rows.append(compile_one(s.gemm_tma_kernel, {"x_desc": f"tensordesc<{dt}[{bm}, {bk}]>",
                                                        "w_desc": f"tensordesc<{dt}[{bn}, {bk}]>", "b_ptr": "*fp16",
                                                        "out_desc": f"tensordesc<fp16[{bm}, {bn}]>", **common},
                                    tiles, mnk, num_warps=warps, num_stages=stages))
        for bm, bn, warps in s.GEGLU_CONFIGS:
            rows.append(compile_one(s.geglu_kernel, {"y_ptr": "*fp16", "out_ptr": f"*{dt}", "os_ptr": "*fp32",
                                                     "M": "i32", "N": "i32"},
                                    {"QUANT": quant, "BLOCK_M": bm, "BLOCK_N": bn}, ("M", "N"), num_warps=warps))
    return rows


def conv() -> list[dict]:
    """conv_scout.py's implicit-GEMM kernels (pointers; TMA) at their configurations, a 3x3 stride-1 convolution,
    fp8 and fp16; every size a multiple of 16, as at SDXL's 1024² levels."""
    import conv_scout as s

    rows = []
    for dt, bk in (("fp8e4nv", 128), ("fp16", 64)):
        for bm, bn, warps, stages in s.CONFIGS:
            rows.append(compile_one(s.conv_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": "*fp16",
                                                    "ws_ptr": "*fp32", "xs_ptr": "*fp32", "bias_ptr": "*fp32",
                                                    **{k: "i32" for k in ("M", "H", "W", "C", "P", "Q", "N")}},
                                    {"R": 3, "S": 3, "STRIDE": 1, "PAD": 1, "BLOCK_M": bm, "BLOCK_N": bn,
                                     "BLOCK_K": bk, "HAS_BIAS": True}, SIZES, num_warps=warps, num_stages=stages))
        for th, tw, bn, warps, stages in s.TMA_CONFIGS:  # a 320-channel 3x3 convolution (SDXL's first level)
            rows.append(compile_one(s.conv_tma_kernel, {"x_desc": f"tensordesc<{dt}[1, {th}, {tw}, {bk}]>",
                                                        "w_desc": f"tensordesc<{dt}[{bn}, {bk}]>",
                                                        "out_desc": f"tensordesc<fp16[1, {th}, {tw}, {bn}]>",
                                                        "scale_ptr": "*fp32", "bias_ptr": "*fp32", "x_scale": "fp32",
                                                        **{k: "i32" for k in ("H", "W", "C", "N")}},
                                    {"R": 3, "S": 3, "PAD": 1, "TILE_H": th, "TILE_W": tw, "BLOCK_N": bn,
                                     "BLOCK_K": bk, "HAS_BIAS": True}, SIZES, num_warps=warps, num_stages=stages))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="groupnorm,geglu,conv")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = [r for name in a.only.split(",") for r in {"groupnorm": groupnorm, "geglu": geglu, "conv": conv}[name]()]
    for r in rows:
        what = r.get("error") or f"registers {r['registers']}, spill stores {r['spill_stores']} B, shared {r['shared']} B"
        print(f"{r['kernel']:24s} {json.dumps(r['constexprs'])[:90]:90s} {json.dumps(r['options']):36s} {what}")
    if a.out:
        a.out.write_text(json.dumps({"triton": triton.__version__, "target": "sm_90a", "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
