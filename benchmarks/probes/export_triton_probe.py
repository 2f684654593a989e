"""Can a GEMM kernel of ours ride inside a bcg artifact, and keep its speed there? (issue 41 item 5)

The GEGLU scout (benchmarks/results/step/2026-12-05-92ef8a0-geglu.json) timed the feed-forward's first Linear with
GEGLU and FP8's quantisation in the GEMM's epilogue: with its tiles moved by the TMA (host tensor descriptors) it takes
34.3 ms of the FP8 8 x 1024² UNet step where the compiled step spends 40.1 (3.1% of the 183 ms replay); the pointer
form 35.5 (2.5%, under the issue's 3%). Only inside the per-size artifacts (AOTInductor packages, engine/kernels/
artifacts.py) does it reach a render: a `torch.library.triton_op` in the exported graph, its kernel compiled into the
package beside inductor's. Host descriptors built inside a triton_op are the newest part of that path. Before a recipe
is built on it, this probe exports, for each form, a module whose forward is the fused op and the pointwise kernel the
compiler puts after it, compiles it as bcg's artifacts are (their inductor options, the rows dimension dynamic), loads
the package as bcg does, and records:
  export, compile, load   ok or the one-line error, and the seconds each took; whether the package also loads in
                          a fresh process, without the op registered (bcg's load check, artifacts.loads_here)
  err                     relative L2 error of the loaded package's output against the same op called eagerly
  ms                      the loaded package per call (a CUDA graph of 10 calls, median of replays); the row
                          `production` is the same module with the production arithmetic (torch._scaled_mm, GEGLU,
                          quantisation) compiled into a package the same way
  eager_op_ms             the module called eagerly, the same way
at the UNet's main feed-forward shape (60 of a step's 70 calls), 16 rows (8 images, guided).

    python benchmarks/probes/export_triton_probe.py OUT.json          # CUDA (H200): about a minute
    python benchmarks/probes/export_triton_probe.py /tmp/e.json --trace   # CPU: the ops registered and exported,
        no compile (not --smoke: under Triton's interpreter a kernel runs where the export must trace it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_scout import TRITON_MISSING, last_line, time_graph_ms, triton  # noqa: E402
from geglu_scout import FP8, FP8_MAX, FfShape, Operands, pick_k, picks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from storyboard_cli.engine.kernels.artifacts import INDUCTOR_OPTIONS, loads_here, open_package  # noqa: E402

CONFIG = (128, 128, 128, 8, 3, 8)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M: the scout's best at both shapes
PICK_ENV = "GEGLU_PICK"  # a GEGLU scout record: geglu_pointer launches each shape's fastest pointer-argument form
SHAPES = [("1280->2x5120 over 1024 tokens", 1280, 5120, 1024)]  # 60 of the UNet step's 70 calls
SMOKE_SHAPES = [("64->2x128 over 64 tokens", 64, 128, 64)]
ROWS = 16


PICKED: dict[tuple[int, int], tuple[str, tuple]] = {}  # what register() read from $GEGLU_PICK


def picked() -> dict:
    """PICKED for a JSON record: {"K->inner": [form, config]}, with the record it came from."""
    return {"record": os.environ.get(PICK_ENV), **{f"{k}->{n}": [form, list(config)]
                                                   for (k, n), (form, config) in PICKED.items()}}


def register():
    """The fused op in three forms, as `torch.ops.bcg_probe.geglu_pointer`, `...geglu_tma` and `...geglu_tma_hop` (the
    TMA kernel, its descriptors handed to the trace as tensors and block shapes; once a process). With $GEGLU_PICK (a
    GEGLU scout record), geglu_pointer launches at each shape the record's fastest form with pointer arguments and its
    config (geglu_scout.picks); at other shapes, and without it, the pointer tiles at CONFIG."""
    from torch.library import triton_op, wrap_triton

    if TRITON_MISSING:
        raise RuntimeError(TRITON_MISSING)
    if hasattr(torch.ops.bcg_probe, "geglu_tma_hop"):
        return

    from geglu_scout import (geglu_gemm_block_kernel, geglu_gemm_kernel, geglu_gemm_persistent_kernel,
                             geglu_gemm_tma_kernel, programs_at_once)

    kernels = {"pointer": geglu_gemm_kernel, "block": geglu_gemm_block_kernel,
               "persistent": geglu_gemm_persistent_kernel}
    PICKED.update(picks(Path(os.environ[PICK_ENV]) if os.environ.get(PICK_ENV) else None))

    def launch(x, w, b, xs, ws, os, tma: bool, hop: bool = False):
        m, k = x.shape
        n = w.shape[0] // 2
        form, config = ("tma", CONFIG) if tma else PICKED.get((k, n), ("pointer", CONFIG))
        bm, bn, bk, warps, stages, group = config
        bk = pick_k(k, bk)
        out = torch.empty(m, n, device=x.device, dtype=FP8)
        grid = (triton.cdiv(m, bm) * (n // bn),)
        if form == "persistent":
            grid = (programs_at_once(x.device),)
        meta = dict(QUANT=True, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                    num_warps=warps, num_stages=stages)
        from torch._library.triton import is_wrap_triton_enabled

        if hop and is_wrap_triton_enabled():
            # traced: the tensors and each descriptor's block shape into the graph, as Dynamo hands a descriptor
            # made by TensorDescriptor.from_tensor to inductor (torch's own tracing of a triton_op keeps the
            # descriptor as a constant, which inductor cannot lower: "TMA descriptor capturing not yet supported
            # in non-dynamo tracing")
            from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_mutation

            kwargs = dict(x_desc=x, w_desc=w, b_ptr=b, out_desc=out, xs_ptr=xs, ws_ptr=ws, os_ptr=os, M=m, N=n, K=k,
                          **meta)
            tma_meta = {"x_desc": ("stable", ([bm, bk],)), "w_desc": ("stable", ([bn, bk],)),
                        "out_desc": ("stable", ([bm, bn],))}
            triton_kernel_wrapper_mutation(kernel_idx=kernel_side_table.add_kernel(geglu_gemm_tma_kernel),
                                           constant_args_idx=kernel_side_table.add_constant_args({}), grid=[grid],
                                           tma_descriptor_metadata=tma_meta, kwargs=kwargs)
            return out
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            args = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), b,
                    TensorDescriptor.from_tensor(out, [bm, bn]))
        else:
            args = (x, w, b, out)
        kernel = geglu_gemm_tma_kernel if tma else kernels[form]
        wrap_triton(kernel)[grid](*args, xs, ws, os, m, n, k, **meta)
        return out

    @triton_op("bcg_probe::geglu_pointer", mutates_args={})
    def geglu_pointer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                      os: torch.Tensor) -> torch.Tensor:
        return launch(x, w, b, xs, ws, os, tma=False)

    @triton_op("bcg_probe::geglu_tma", mutates_args={})
    def geglu_tma(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                  os: torch.Tensor) -> torch.Tensor:
        return launch(x, w, b, xs, ws, os, tma=True)

    @triton_op("bcg_probe::geglu_tma_hop", mutates_args={})
    def geglu_tma_hop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                      os: torch.Tensor) -> torch.Tensor:
        return launch(x, w, b, xs, ws, os, tma=True, hop=True)


class Ff(torch.nn.Module):
    """x [rows, tokens, K] in FP8 -> the feed-forward's GEGLU output [rows, tokens, inner] in fp16: the fused op (form
    `pointer`, `tma` or `tma_hop`) or the production arithmetic (`production`), then a pointwise kernel of the
    compiler's (the dequantisation), as the next Linear's prologue would be."""

    def __init__(self, form: str, w, b, xs, ws, os):
        super().__init__()
        self.form = form
        for name, t in (("w", w), ("b", b), ("xs", xs), ("ws", ws), ("os", os)):
            self.register_buffer(name, t)

    def forward(self, x):
        rows, tokens, k = x.shape
        x2 = x.reshape(-1, k)
        if self.form == "production":
            y = torch._scaled_mm(x2, self.w.t(), scale_a=self.xs, scale_b=self.ws, bias=self.b,
                                 out_dtype=torch.float16)
            h, g = y.chunk(2, dim=-1)
            q = (h * torch.nn.functional.gelu(g) / self.os).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            q = getattr(torch.ops.bcg_probe, f"geglu_{self.form}")(x2, self.w, self.b, self.xs, self.ws, self.os)
        return (q.float() * self.os).to(torch.float16).reshape(rows, tokens, -1)


def operands(k: int, inner: int, tokens: int, rows: int, device: str):
    """The GEGLU scout's FP8 operands of the shape (its Operands): x as [rows, tokens, K], and the module's
    constants (W, bias, x's, W's and the output's scales)."""
    ops = Operands(FfShape(k, inner, tokens, True), rows, "fp8", device)
    return ops.x.reshape(rows, tokens, k), (ops.w, ops.bias, ops.xs, ops.ws, ops.os)


def probe(form: str, x, consts, trace: bool, folder: Path) -> dict:
    res: dict = {}
    module = Ff(form, *consts)
    stage = "export"
    try:
        t0 = time.perf_counter()
        rows_dim = torch.export.Dim("rows", min=1, max=64)
        exported = torch.export.export(module, (x,), dynamic_shapes=({0: rows_dim},))
        res["export_s"] = round(time.perf_counter() - t0, 2)
        res["graph_ops"] = sorted({str(n.target) for n in exported.graph.nodes if n.op == "call_function"})
        if trace:
            return res
        stage = "compile"
        from torch._inductor import aoti_compile_and_package

        t0 = time.perf_counter()
        path = folder / f"{form}.pt2"
        aoti_compile_and_package(exported, package_path=str(path), inductor_configs=dict(INDUCTOR_OPTIONS))
        res["compile_s"] = round(time.perf_counter() - t0, 2)
        stage = "load"
        t0 = time.perf_counter()
        call = open_package(path)
        res["load_s"] = round(time.perf_counter() - t0, 2)
        # bcg checks a package in a child process before its first load (artifacts.loads_here): one without
        # this probe's ops registered, as a render that never imports it
        res["loads_in_a_fresh_process"] = loads_here(path)
        stage = "run"
        if hasattr(call, "load_constants"):  # weights outside the package: bind the module's own
            call.load_constants({k: v for k, v in module.state_dict().items()}, check_full_update=True,
                                user_managed=True)
        got = call(x)
        want = module(x)
        res["err"] = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
        res["ms"] = round(time_graph_ms(lambda: call(x), 50, 7), 4)
        res["eager_op_ms"] = round(time_graph_ms(lambda: module(x), 50, 7), 4)
    except Exception as exc:  # noqa: BLE001 - each stage's failure is the probe's finding
        res[f"{stage}_error"] = last_line(exc)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--trace", action="store_true")
    a = p.parse_args()
    record: dict = {"torch": torch.__version__, "triton": getattr(triton, "__version__", None), "config": CONFIG,
                    "rows": ROWS}
    out = Path(a.out)
    if TRITON_MISSING:
        record["error"] = TRITON_MISSING
        out.write_text(json.dumps(record, indent=1))
        print(record["error"])
        return
    device = "cpu" if a.trace else "cuda"
    if device == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
    register()
    record["picked"] = picked()
    record["shapes"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, k, inner, tokens in SMOKE_SHAPES if a.trace else SHAPES:
            rows = 2 if a.trace else ROWS
            x, consts = operands(k, inner, tokens, rows, device)
            row = {"shape": name, "rows": rows}
            for form in ("production", "pointer", "tma", "tma_hop"):
                row[form] = probe(form, x, consts, a.trace, Path(tmp))
                print(json.dumps({"shape": name, form: row[form]}), flush=True)
                out.write_text(json.dumps(record | {"shapes": record["shapes"] + [row]}, indent=1))
            record["shapes"].append(row)
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
