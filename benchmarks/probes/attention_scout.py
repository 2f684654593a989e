"""Attention scout: would an FP8 attention kernel beat what PyTorch runs today at SDXL's attention shapes?

Shapes (rows = images x 2 for CFG; 16 and 4 by default), with the UNet's calls per step at 1024x1024:
  self_l2  q,k,v [rows, 10, 4096, 64]  x10    cross_l2  q [rows, 10, 4096, 64], k,v [rows, 10, 77, 64]  x10
  self_l3  q,k,v [rows, 20, 1024, 64]  x60    cross_l3  q [rows, 20, 1024, 64], k,v [rows, 20, 77, 64]  x60
Variants: sdpa_cudnn / sdpa_flash / sdpa_efficient (fp16 SDPA, one backend forced each); triton_fp16, the Triton
flash-attention forward below; triton_fp8, the same kernel on float8_e4m3fn Q, K, V (static per-tensor scales
amax / 448; P * 2**8 cast to fp8 for P @ V; V stored [.., 64, tokens], K-major for Hopper's FP8 wgmma), inputs
quantised beforehand, as a fused q/k/v projection would write them; triton_fp8+quant, with the quantisation
inside the timed call; triton_fp8qk, fp8 for Q K^T only. Each: ms per call (CUDA events, 10 warm-up calls, median
of --repeats loops of --iters calls) eager and as replays of a CUDA graph of 10 calls, TFLOPS (4 rows heads Lq Lk
64 / time), ms per step (sum of calls x ms), and the relative L2 error against fp32 math SDPA on 2 rows, with
q,k,v ~ N(0,1) ("normal") and q,k x 2.5 ("peaked"). The kernel is tuned per (kind, Lq, Lk) over 5 tile configs
(--tune full: 24). A failing variant records its reason; every step checks --budget.

    python benchmarks/probes/attention_scout.py --out attention.json          # CUDA (H200): about 60-100 s
    python benchmarks/probes/attention_scout.py --out /tmp/smoke.json --smoke  # CPU: Triton's interpreter

--smoke: tiny shapes; without CUDA the kernels run in Triton's interpreter (its fp32 -> fp8 cast patched to round
as the GPU does), beside emulated_* variants (the kernel's arithmetic in torch; they need no Triton).
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported and the kernels are decorated
try:
    import triton
    import triton.language as tl
    TRITON_MISSING = None
except ImportError as exc:
    triton = tl = None
    TRITON_MISSING = f"triton not importable: {exc}"

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_P_SHIFT = 8  # P in [0, 1] goes to fp8 as P * 2**8
LOG2E = 1.4426950408889634
SHAPES = [("self_l2", 10, 4096, 4096, 10), ("self_l3", 20, 1024, 1024, 60),  # name, heads, Lq, Lk, calls per step
          ("cross_l2", 10, 4096, 77, 10), ("cross_l3", 20, 1024, 77, 60)]
SMOKE_SHAPES = [("self_l2", 2, 128, 128, 10), ("self_l3", 2, 96, 96, 60),  # 96, 77: partial query and key tiles
                ("cross_l2", 2, 128, 77, 10), ("cross_l3", 2, 96, 77, 60)]
GRAPH_CALLS = 10


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self):
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


FULL_CONFIGS = [Config(*c) for c in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))]
SMALL_CONFIGS = [Config(128, 64, 4, 3), Config(128, 64, 8, 3), Config(128, 128, 8, 3), Config(128, 128, 8, 4),
                 Config(64, 64, 4, 3)]


class Operands(NamedTuple):
    q: torch.Tensor  # [B, H, Lq, D] contiguous, fp16 or fp8
    k: torch.Tensor  # [B, H, Lk, D] contiguous
    v: torch.Tensor  # [B, H, Lk, D]: contiguous, or a view of [B, H, D, Lk padded] storage
    qk_scale: float  # q @ k^T to log2-scaled logits: softmax scale, log2(e), q's and k's scales
    out_scale: float  # V's scale
    p_shift: int  # P is cast as P * 2**p_shift


if triton is not None:
    @triton.jit
    def _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_n, Lk, qk_scale,
                      P_SHIFT: tl.constexpr, MASKED: tl.constexpr):
        """One BLOCK_N slice of keys: scores, the online-softmax update, P @ V into acc (fp32)."""
        if MASKED:
            valid = offs_n < Lk
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - (m_new - P_SHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return acc, l_i, m_new

    @triton.jit
    def attention_fwd(Q, K, V, O, Lq, Lk, qk_scale, out_scale, stride_v_bh, stride_v_row,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      P_SHIFT: tl.constexpr, V_TRANSPOSED: tl.constexpr):
        """O = softmax(Q K^T * scale) V for one BLOCK_M tile of queries of one (batch, head)."""
        bh = tl.program_id(1)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = offs_m[:, None] < Lq
        q = tl.load(Q + bh * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=q_rows, other=0.0)
        k_ptrs = K + bh * Lk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        if V_TRANSPOSED:  # storage [.., HEAD_DIM, tokens]: tokens contiguous
            v_ptrs = V + bh * stride_v_bh + offs_n[:, None] + offs_d[None, :] * stride_v_row
            v_step = 1
        else:
            v_ptrs = V + bh * stride_v_bh + offs_n[:, None] * stride_v_row + offs_d[None, :]
            v_step = stride_v_row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        full_end = (Lk // BLOCK_N) * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs + start * HEAD_DIM, v_ptrs + start * v_step,
                                          start + offs_n, Lk, qk_scale, P_SHIFT, False)
        if full_end < Lk:  # the last, partial block of keys (cross-attention's 77 tokens)
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs + full_end * HEAD_DIM, v_ptrs + full_end * v_step,
                                          full_end + offs_n, Lk, qk_scale, P_SHIFT, True)
        out = acc * (out_scale / l_i)[:, None]
        tl.store(O + bh * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=q_rows)


def launch(ops: Operands, cfg: Config) -> torch.Tensor:
    batch, heads, lq, dim = ops.q.shape
    out = torch.empty(batch, heads, lq, dim, dtype=torch.float16, device=ops.q.device)
    transposed = ops.v.stride(2) == 1 and ops.v.stride(3) != 1
    attention_fwd[(triton.cdiv(lq, cfg.block_m), batch * heads)](
        ops.q, ops.k, ops.v, out, lq, ops.k.shape[2], ops.qk_scale, ops.out_scale, ops.v.stride(1),
        ops.v.stride(3) if transposed else ops.v.stride(2), HEAD_DIM=dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        P_SHIFT=ops.p_shift, V_TRANSPOSED=transposed, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def emulate(ops: Operands, block_n: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: fp32, blockwise online softmax, P rounded to V's dtype."""
    q, k, v = ops.q.float(), ops.k.float(), ops.v.float()
    s = (q @ k.transpose(-1, -2)) * ops.qk_scale
    m = torch.full(s.shape[:-1], float("-inf"), device=s.device)
    l, acc = torch.zeros_like(m), torch.zeros_like(q)
    for n0 in range(0, k.shape[2], block_n):
        m_new = torch.maximum(m, s[..., n0:n0 + block_n].amax(-1))
        p = torch.exp2(s[..., n0:n0 + block_n] - (m_new - ops.p_shift)[..., None])
        alpha = torch.exp2(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p.to(ops.v.dtype).float() @ v[..., n0:n0 + block_n, :]
        m = m_new
    return (acc * (ops.out_scale / l)[..., None]).half()


def quantise(x: torch.Tensor, scale: float, out=None) -> torch.Tensor:
    """x / scale as float8_e4m3fn in one elementwise pass (fp16 in, fp8 stored)."""
    return torch.mul(x, 1.0 / scale, out=torch.empty(x.shape, dtype=FP8, device=x.device) if out is None else out)


def make_operands(kind: str, q, k, v, scales) -> Operands:
    softmax_log2 = LOG2E / math.sqrt(q.shape[-1])
    if kind == "fp16":
        return Operands(q, k, v, softmax_log2, 1.0, 0)
    sq, sk, sv = scales
    q8, k8 = quantise(q, sq), quantise(k, sk)
    if kind == "fp8qk":
        return Operands(q8, k8, v, sq * sk * softmax_log2, 1.0, 0)
    batch, heads, lk, dim = v.shape
    vt = torch.empty(batch, heads, dim, -(-lk // 16) * 16, dtype=FP8, device=v.device)  # rows 16-byte aligned
    quantise(v.transpose(-1, -2), sv, out=vt[..., :lk])
    return Operands(q8, k8, vt[..., :lk].transpose(-1, -2), sq * sk * softmax_log2, sv, FP8_P_SHIFT)


def time_ms(fn: Callable, iters: int, repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def time_graph_ms(fn: Callable, iters: int, repeats: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return time_ms(graph.replay, max(1, iters // GRAPH_CALLS), repeats, warmup=2) / GRAPH_CALLS


def last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:400]


def patch_interpreter_fp8_cast() -> str:
    """Triton's interpreter rounds fp32 -> fp8 without carrying into the exponent (1.99 -> 1.0, 0.49 -> 0.25);
    the GPU rounds to nearest even. Smoke only: the interpreter's casts to float8e4nv go through torch."""
    from triton.runtime import interpreter
    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        data = torch.from_numpy(src.data).float().to(FP8).view(torch.uint8).numpy()
        return interpreter.TensorHandle(data, dst_type.scalar)
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    return "applied (torch's round-to-nearest-even)"


def attempt(fn: Callable, *args):
    """fn(*args), or its exception's last line: one failure never stops the rest."""
    try:
        return fn(*args)
    except Exception as exc:
        return last_line(exc)


def forced(backend):
    return sdpa_kernel(backend) if backend is not None else nullcontext()


def relative_error(prepare, backend, q, k, v, ref) -> float:
    with forced(backend):
        out = prepare(q, k, v)()
    return ((out.float() - ref).norm() / ref.norm()).item()


class Probe:
    def __init__(self, args):
        self.args, self.cuda = args, torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.deadline = time.monotonic() + args.budget
        configs = FULL_CONFIGS if args.tune == "full" else SMALL_CONFIGS if self.cuda else [Config(64, 64, 4, 2)]
        self.configs = [Config(*map(int, args.config.split(",")))] if args.config else configs
        self.tuning, self.last_config = {}, None

    def check_budget(self):
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"skipped: past --budget {self.args.budget:.0f} s")

    def pick_config(self, kind: str, ops: Operands) -> Config:
        key = f"{kind} Lq={ops.q.shape[2]} Lk={ops.k.shape[2]}"
        if key not in self.tuning:
            timings = {}
            for cfg in self.configs if self.cuda and len(self.configs) > 1 else []:
                near_budget = timings and time.monotonic() > self.deadline - 30
                timings[cfg] = "not tried: near --budget" if near_budget else \
                    attempt(time_ms, partial(launch, ops, cfg), 10, 1, 2)
            ran = {c: t for c, t in timings.items() if isinstance(t, float)}
            if timings and not ran:
                raise RuntimeError(f"no tile config ran: {next(iter(timings.values()))}")
            best = min(ran, key=ran.get) if ran else self.configs[0]
            self.tuning[key] = {"config": best, "ms": {str(c): t for c, t in timings.items()}}
        return self.tuning[key]["config"]

    def sdpa(self, q, k, v):
        run = partial(F.scaled_dot_product_attention, q, k, v)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run()
            except Exception as exc:  # a backend's reasons come as warnings before "No available kernel"
                why = "; ".join(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
                raise RuntimeError(f"{exc} {why}".strip()) from exc
        return run

    def kernel(self, kind: str, with_quant: bool = False, emulated: bool = False):
        def prepare(q, k, v):
            if TRITON_MISSING and not emulated:
                raise RuntimeError(TRITON_MISSING)
            scales = [max(t.abs().amax().float().item(), 1e-12) / FP8_MAX for t in (q, k, v)]  # static, per tensor
            ops = make_operands(kind, q, k, v, scales)
            if emulated:
                return partial(emulate, ops, self.configs[0].block_n)
            cfg = self.last_config = self.pick_config(kind, ops)
            if with_quant:
                return lambda: launch(make_operands(kind, q, k, v, scales), cfg)
            return partial(launch, ops, cfg)
        return prepare

    def variants(self):
        found = [(f"sdpa_{name.split('_')[0].lower()}", self.sdpa, getattr(SDPBackend, name))
                 for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")]
        found += [("triton_fp16", self.kernel("fp16"), None), ("triton_fp8", self.kernel("fp8"), None),
                  ("triton_fp8+quant", self.kernel("fp8", True), None), ("triton_fp8qk", self.kernel("fp8qk"), None)]
        if self.args.smoke:
            found += [(f"emulated_{kind}", self.kernel(kind, emulated=True), None) for kind in ("fp16", "fp8", "fp8qk")]
        return found

    def inputs(self, rows: int, heads: int, lq: int, lk: int, gain: float = 1.0):
        gen = torch.Generator(device=self.device).manual_seed(rows * 1000 + lq + lk)
        q, k, v = (torch.randn(rows, heads, n, 64, generator=gen, device=self.device) for n in (lq, lk, lk))
        return (q * gain).half(), (k * gain).half(), v.half()

    def time_variant(self, rows: int, shape, variant) -> dict:
        (name, heads, lq, lk, _), (vname, prepare, backend) = shape, variant
        record = dict(rows=rows, shape=name, variant=vname, ms=None, ms_graph=None, tflops=None, tflops_graph=None,
                      triton_config=None, graph_failure=None, failure=None)
        try:
            self.check_budget()
            with forced(backend):
                fn = prepare(*self.inputs(rows, heads, lq, lk))
                record["triton_config"] = str(self.last_config) if vname.startswith("triton") else None
                if not self.cuda:
                    raise RuntimeError("smoke: no CUDA, not timed")
                record["ms"] = time_ms(fn, self.args.iters, self.args.repeats)
                graph = attempt(time_graph_ms, fn, self.args.iters, self.args.repeats)
                record["ms_graph" if isinstance(graph, float) else "graph_failure"] = graph
        except Exception as exc:
            record["failure"] = last_line(exc)
        for field in ("ms", "ms_graph"):
            if record[field]:
                record["tflops" + field[2:]] = 4 * rows * heads * lq * lk * 64 / record[field] / 1e9
        return record

    def reference_case(self, heads: int, lq: int, lk: int, gain: float):
        self.check_budget()
        q, k, v = self.inputs(1 if self.args.smoke else 2, heads, lq, lk, gain)
        with sdpa_kernel(SDPBackend.MATH):  # fp32, one row at a time
            ref = torch.cat([F.scaled_dot_product_attention(*(t[i:i + 1].float() for t in (q, k, v)))
                             for i in range(q.shape[0])])
        return q, k, v, ref

    def errors(self, shape, variants) -> dict:
        found = {vname: {} for vname, _, _ in variants}
        for case, gain in (("normal", 1.0), ("peaked", 2.5)):
            case_inputs = attempt(self.reference_case, *shape[1:4], gain)
            for vname, prepare, backend in variants:
                found[vname][case] = case_inputs if isinstance(case_inputs, str) else \
                    attempt(relative_error, prepare, backend, *case_inputs)
        return found


def per_step(records, shapes, rows: int, vname: str) -> dict:
    got = {r["shape"]: r for r in records if r["rows"] == rows and r["variant"] == vname}
    parts = {field: [got.get(s[0], {}).get(field) for s in shapes] for field in ("ms", "ms_graph")}
    return {field: sum(s[4] * p for s, p in zip(shapes, ms)) if None not in ms else None for field, ms in parts.items()}


def print_table(report, shapes, variants, rows_list):
    cell = lambda x, width=9: f"{x:{width}.3f}" if isinstance(x, float) else f"{'-':>{width}}"  # noqa: E731
    pair = lambda e: "/".join(f"{e[c]:.1e}" if isinstance(e.get(c), float) else "fail"  # noqa: E731
                              for c in ("normal", "peaked"))
    for rows in rows_list:
        print(f"\nrows {rows}: ms per call (CUDA graph, else eager); step = sum of calls x ms; TFLOPS at self_l2")
        print(f"{'variant':18}" + "".join(f"{s[0]:>9}" for s in shapes) + f"{'step ms':>10}{'TFLOPS':>8}")
        for vname, _, _ in variants:
            recs = [next(r for r in report["results"] if (r["rows"], r["shape"], r["variant"]) == (rows, s[0], vname))
                    for s in shapes]
            total = report["per_step"][f"rows{rows}"][vname]
            print(f"{vname:18}" + "".join(cell(r["ms_graph"] or r["ms"]) for r in recs)
                  + cell(total["ms_graph"] or total["ms"], 10) + cell(recs[0]["tflops_graph"] or recs[0]["tflops"], 8))
    print("\nrelative L2 error against fp32 math SDPA, normal / peaked inputs")
    print(f"{'variant':18}" + "".join(f"{s[0]:>18}" for s in shapes))
    for vname, _, _ in variants:
        print(f"{vname:18}" + "".join(f"{pair(report['errors'].get(s[0], {}).get(vname, {})):>18}" for s in shapes))
    for r in report["results"]:
        if r["failure"] and "smoke: no CUDA" not in r["failure"]:
            print(f"failed: rows {r['rows']} {r['shape']} {r['variant']}: {r['failure']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="16,4", help="comma-separated batch rows (images x 2 for CFG)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tune", choices=("small", "full"), default="small", help="5 tile configs, or all 24")
    parser.add_argument("--config", help="one tile config BLOCK_M,BLOCK_N,WARPS,STAGES instead of tuning")
    parser.add_argument("--budget", type=float, default=110.0, help="seconds; later steps are skipped past it")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; without CUDA, Triton's interpreter")
    args = parser.parse_args()
    probe, notes = Probe(args), []
    if os.environ.get("TRITON_INTERPRET") == "1" and triton is not None:
        notes.append(f"fp8 cast fix for the interpreter: {attempt(patch_interpreter_fp8_cast)}")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows_list = [1] if args.smoke else [int(r) for r in args.rows.split(",")]
    variants = probe.variants()
    report = {"env": {"torch": torch.__version__, "triton": getattr(triton, "__version__", TRITON_MISSING),
                      "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if probe.cuda else None,
                      "device": torch.cuda.get_device_name() if probe.cuda else "cpu",
                      "triton_interpret": os.environ.get("TRITON_INTERPRET"), "argv": sys.argv[1:]},
              "shapes": {s[0]: {"heads": s[1], "lq": s[2], "lk": s[3], "calls_per_step": s[4]} for s in shapes},
              "results": [], "errors": {}, "per_step": {}, "tuning": {}, "notes": notes}
    started = time.monotonic()
    for i, rows in enumerate(rows_list):
        report["results"] += [probe.time_variant(rows, shape, variant) for shape in shapes for variant in variants]
        if i == 0:  # once, after the first rows' tuning
            report["errors"] = {shape[0]: probe.errors(shape, variants) for shape in shapes}
    report["per_step"] = {f"rows{rows}": {v[0]: per_step(report["results"], shapes, rows, v[0]) for v in variants}
                          for rows in rows_list}
    report["tuning"] = {key: {"config": str(t["config"]), "ms": t["ms"]} for key, t in probe.tuning.items()}
    report["seconds"] = time.monotonic() - started
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report, shapes, variants, rows_list)
    print(f"\n{report['seconds']:.1f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
