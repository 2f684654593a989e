"""FP8 scout: the UNet step's compiled kernels with the transformer Linears in FP8 (static per-tensor scales,
torch._scaled_mm), and the fp16 recipe compiled with Inductor's coordinate_descent_tuning, each timed side by
side with the plain graph and the production fp16 artifact in one process.

Variants (--variants, comma-separated):
  plain      the eager UNet call captured in a CUDA graph
  prod       the production fp16 artifact for the size, from $BCG_CACHE/compiled (built here only with
             --build-missing: the CPU smoke test)
  cdt        the production recipe (artifacts.build, same INDUCTOR_OPTIONS) compiled with
             coordinate_descent_tuning=True
  fp8        the production recipe on a copy of the UNet whose transformer Linears run in FP8: calibrated
             once (eager steps at several timesteps, each Linear's input amax), activation scale amax / 448,
             weight scale per-tensor amax / 448; weights bound at load as production binds its own; the FP8
             GEMMs on cuBLASLt (max_autotune_gemm_backends=ATEN)
  fp8_eager  that FP8 copy, eager, in a CUDA graph (what the FP8 GEMMs give without the compiler)
  fp8_eager_fast  the same with _scaled_mm's use_fast_accum=True (Hopper's faster FP8 accumulation; the
             compiled fp8 variant keeps the default, False)

Timing: static inputs at 8 images (16 rows, CFG) and 1 image (2 rows); one call captured per variant and
row count; warm-up replays; then loops of replays with CUDA events, the variants interleaved loop by loop;
the median loop, as ms per call and ms per image-step (per call / images). The baselines are timed once
before the builds (in case a build fails) and again beside the new variants after them. Relative L2 errors of
the noise prediction against the fp16 eager UNet, same inputs, at t = 999, 500, 50. The JSON is rewritten
after every stage; a build that would end past --budget is not started, one that runs past it is stopped.

    python benchmarks/probes/fp8_scout.py --variants plain,prod,fp8 --out fp8.json --budget 520          # H200, sdxl-random
    python benchmarks/probes/fp8_scout.py --variants plain,prod,cdt --out cdt.json --budget 520
    python benchmarks/probes/fp8_scout.py --model tiny --side 256 --min-tokens 64 --build-missing \\
        --variants plain,prod,cdt,fp8,fp8_eager --out /tmp/scout.json --budget 900     # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import faulthandler
import json
import os
import signal
import statistics
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from storyboard_cli.engine.device import DTYPES
from storyboard_cli.engine.eager import StepCalls, unet_call
from storyboard_cli.engine.kernels.artifacts import INDUCTOR_OPTIONS, Target, build
from storyboard_cli.engine.kernels.calls import CompiledKernels, load
from storyboard_cli.engine.kernels.export import fuse_projections, text_dims
from storyboard_cli.models.loader import SdxlModels, load_sdxl

VARIANTS = ("plain", "prod", "cdt", "fp8", "fp8_eager", "fp8_eager_fast")
# inductor config on top of the recipe's INDUCTOR_OPTIONS. fp8: the FP8 GEMMs on cuBLASLt, as the fp16 ones run on
# cuBLAS (without it inductor's _scaled_mm lowering benchmarks Triton templates even with max_autotune off)
BUILT = {"cdt": {"coordinate_descent_tuning": True}, "fp8": {"max_autotune_gemm_backends": "ATEN"}, "prod": {}}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CALIBRATION_T = (999.0, 750.0, 500.0, 250.0, 50.0)
ERROR_T = (999.0, 500.0, 50.0)
ROWS = (16, 2)  # 8 images and 1 image, CFG doubled
AFTER_BUILD_S = 100.0  # what a process needs after its last build: load, capture, timing, errors
MIN_BUILD_S = {"sdxl-random": 280.0}  # a UNet export + compile on the H200's 16 cores (docs/PERFORMANCE.md)


class OutOfBudget(BaseException):
    """A step ran past its share of --budget (BaseException: no `except Exception` inside torch swallows it)."""


@contextmanager
def within(seconds: float):
    """Raises OutOfBudget in the main thread after `seconds` (inductor is Python: it stops at the next line)."""
    def stop(signum, frame):
        raise OutOfBudget(f"ran past its {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Record:
    """The run's JSON, rewritten whole after every stage (a killed run keeps what it had)."""

    def __init__(self, path: Path, **facts):
        self.path, self.data = path, dict(facts)
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
        print(f"[{self.elapsed():6.1f} s] {key}: {json.dumps(value, default=str)[:400]}", flush=True)


# ------------------------------------------------------------------ FP8 Linear


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b with x and W in float8_e4m3fn at STATIC per-tensor scales: the input's scale comes from
    calibration, so its quantization is a pointwise op inductor fuses into the producer (LayerNorm, GEGLU)."""

    def __init__(self, linear: torch.nn.Linear, x_amax: float):
        super().__init__()
        w = linear.weight.detach()  # [N, K]
        w_scale = w.abs().amax().float().clamp(min=1e-12) / FP8_MAX
        self.register_buffer("weight", (w.float() / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))  # [N, K] row-major
        self.register_buffer("w_scale", w_scale)  # [] float32
        x_scale = torch.tensor(max(x_amax, 1e-12) / FP8_MAX, dtype=torch.float32, device=w.device)
        self.register_buffer("x_scale", x_scale)  # [] float32, from calibration
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.out_dtype = w.dtype
        self.fast_accum = False  # read when traced or captured

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        lead, k = x.shape[:-1], x.shape[-1]
        xq = (x / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        # mat2 column-major, as _scaled_mm wants it: the transpose of the row-major [N, K] weight
        y = torch._scaled_mm(xq.reshape(-1, k), self.weight.t(), scale_a=self.x_scale, scale_b=self.w_scale,
                             bias=self.bias, out_dtype=self.out_dtype, use_fast_accum=self.fast_accum)
        return y.reshape(*lead, y.shape[-1])


def transformer_linears(unet: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """name -> each Linear inside the UNet's transformer blocks (Transformer2DModel: proj_in/out, attention,
    feed-forward); the time and text embeddings' Linears lie outside them."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    out = {}
    for prefix, block in unet.named_modules():
        if isinstance(block, Transformer2DModel):
            out.update({f"{prefix}.{n}": m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)})
    return out


@torch.no_grad()
def calibrate(unet: torch.nn.Module, inputs: list[tuple]) -> dict[str, dict]:
    """name -> {amax, tokens} of each transformer Linear's input over eager calls on `inputs`; a Linear the
    forward never calls (to_q/k/v beside a fused to_qkv) is absent."""
    seen: dict[str, list] = {}

    def record(name, module, args):
        x = args[0]
        amax = x.detach().abs().amax().float()
        old = seen.get(name)
        seen[name] = [amax if old is None else torch.maximum(old[0], amax), x.shape[-2] if x.dim() == 3 else 1]

    hooks = [m.register_forward_pre_hook(partial(record, n)) for n, m in transformer_linears(unet).items()]
    try:
        for args in inputs:
            unet_call(unet, *args, None, None)
    finally:
        for h in hooks:
            h.remove()
    return {n: {"amax": a.item(), "tokens": t} for n, (a, t) in seen.items()}


def quantize(unet: torch.nn.Module, stats: dict[str, dict], min_tokens: int) -> dict:
    """Replaces each calibrated Linear whose input has >= min_tokens tokens per row by an Fp8Linear (the cross-
    attention K/V on 77 text tokens stay fp16, like the embeddings' Linears). Returns what it did."""
    done, kept = [], []
    for name, s in stats.items():
        if s["tokens"] < min_tokens:
            kept.append(name)
            continue
        parent, _, child = name.rpartition(".")
        owner = unet.get_submodule(parent)
        setattr(owner, child, Fp8Linear(getattr(owner, child), s["amax"]))
        done.append(name)
    amax = [stats[n]["amax"] for n in done]
    return {"fp8_linears": len(done), "fp16_kept": sorted({n.rsplit(".", 1)[-1] if "." in n else n for n in kept}),
            "fp16_kept_count": len(kept), "x_amax_min": min(amax, default=None), "x_amax_max": max(amax, default=None)}


# ------------------------------------------------------------------ inputs, calls, timing


def step_inputs(models: SdxlModels, rows: int, side: int, t: float, seed: int) -> tuple:
    """(latents [rows, 4, h, w], t [rows] float32, embeds [rows, 77, C], pooled [rows, P], time_ids [rows, 6]),
    as probes/precision.py makes them."""
    h = side // 8
    g = torch.Generator().manual_seed(seed)
    text_dim, pooled_dim = text_dims(models.unet)
    dev, dt = models.device, models.dtype
    return (torch.randn(rows, 4, h, h, generator=g).to(dev, dt), torch.full((rows,), t, device=dev),
            torch.randn(rows, 77, text_dim, generator=g).to(dev, dt),
            torch.randn(rows, pooled_dim, generator=g).to(dev, dt),
            torch.tensor([side, side, 0, 0, side, side], dtype=dt, device=dev).expand(rows, 6).clone())


class Timed:
    """One variant's call at one row count on static inputs: captured into a CUDA graph (on a CPU, called)."""

    def __init__(self, call: Callable, args: tuple, pool=None):
        self.call, self.args, self.graph = call, args, None
        if args[0].is_cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: lazy inits, cuDNN/cuBLAS plans
                    call(*args)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):  # one pool: the graphs replay one at a time
                self.out = call(*args)

    def ms(self, n: int) -> float:
        """Mean ms per call over n back-to-back calls."""
        if self.graph is None:
            t0 = time.perf_counter()
            for _ in range(n):
                self.call(*self.args)
            return (time.perf_counter() - t0) * 1000 / n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n


def side_by_side(timed: dict[str, Timed], images: int, loops: int, replays: int) -> dict:
    """Each variant's median loop, the variants interleaved loop by loop (drift hits all alike)."""
    for t in timed.values():
        t.ms(3)  # warm-up replays
    runs: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(loops):
        for name, t in timed.items():
            runs[name].append(t.ms(replays))
    out = {}
    for name, ms in runs.items():
        med = statistics.median(ms)
        out[name] = {"ms_per_call": round(med, 3), "ms_per_image_step": round(med / images, 3),
                     "loops_ms": [round(x, 3) for x in ms]}
    for base in ("plain", "prod"):
        if base in out:
            for name in out:
                out[name][f"x_vs_{base}"] = round(out[base]["ms_per_call"] / out[name]["ms_per_call"], 4)
    return out


def attempt(rec: Record, key: str, fn: Callable):
    """fn() or, if it raises, None with the error recorded under `key` (a scout goes on with the rest)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        rec.put(key, {"error": f"{type(e).__name__}: {str(e)[:2000]}"})
        return None


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


# ------------------------------------------------------------------ builds


def fresh_unet(models: SdxlModels) -> torch.nn.Module:
    """A UNet of the same config without values (they are bound at load), as engine/builds.py's child makes it."""
    import diffusers

    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel.from_config(dict(models.unet.config))
    return model.to_empty(device=models.device).to(dtype=models.dtype).eval().requires_grad_(False)


def build_variant(name: str, target: Target, module: torch.nn.Module, folder: Path, seconds: float) -> tuple:
    """artifacts.build (the production recipe) under this variant's inductor options, stopped after `seconds`.
    Returns (path or None, stats)."""
    import torch._inductor.config

    path = folder / f"{name}-unet-{target.width}x{target.height}.pt2"
    options = BUILT[name]
    t0 = time.perf_counter()
    try:
        with within(seconds), torch._inductor.config.patch(options):
            stats = build(target, module, path)
    except OutOfBudget as e:
        return None, {"error": f"build stopped: {e} (the budget)", "wall_s": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - a scout records any failure and goes on with the rest
        return None, {"error": f"{type(e).__name__}: {str(e)[:2000]}", "wall_s": round(time.perf_counter() - t0, 1)}
    return path, {**stats, "options": options, "wall_s": round(time.perf_counter() - t0, 1), **wrapper_facts(path)}


def wrapper_facts(path: Path) -> dict:
    """How often the artifact's generated C++ names _scaled_mm and float8 (that the FP8 GEMMs made it in)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        text = "".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith("wrapper.cpp"))
    return {"wrapper_scaled_mm": text.count("_scaled_mm"), "wrapper_float8": text.count("float8")}


def production_artifact(models: SdxlModels, target: Target, build_missing: bool, folder: Path, rec: Record,
                        seconds: float) -> CompiledKernels | None:
    """CompiledKernels with the production artifact for `target`: the cache's file under its key, else any
    file of that module and size in the cache (a key that moved with the package under edit), else (smoke
    test) a fresh build."""
    k = kernels(models, target)
    want, note = k.path(target), "key matches"
    if not want.is_file():
        found = sorted(want.parent.glob(f"{target.module}-{target.width}x{target.height}-*.pt2"))
        if found:
            want, note = found[-1], f"key differs: expected {k.path(target).name}"
        elif build_missing:
            want, stats = build_variant("prod", target, fresh_unet(models), folder, seconds)
            rec.put("build_prod", stats)
            note = "built here"
    if want is None or not want.is_file() or not k.add(target, want):
        rec.put("prod_artifact", {"error": f"no usable artifact ({want}); notes: {k.notes}"})
        return None
    rec.put("prod_artifact", {"file": want.name, "mb": round(want.stat().st_size / 2**20, 1), "note": note,
                              "load_s": round(k.load_s[target], 3)})
    return k


def kernels(models: SdxlModels, target: Target) -> CompiledKernels:
    """An empty CompiledKernels with its zero residuals for 8 images of the target's size (before a capture)."""
    k = CompiledKernels(models)
    k.reserve(ROWS[0] // 2, target.height * target.width)
    return k


def budget_for_build(args, rec: Record, builds_left: int) -> float:
    """Seconds this build may take: what is left after the later builds' minimum and the final stages."""
    floor = MIN_BUILD_S.get(args.model, 0.0)
    return args.budget - rec.elapsed() - AFTER_BUILD_S - floor * (builds_left - 1)


# ------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="plain,prod,fp8", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out", type=Path, required=True, help="the JSON record (rewritten after each stage)")
    p.add_argument("--budget", type=float, default=520.0, help="seconds for the whole run")
    p.add_argument("--model", default="sdxl-random")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp16 on CUDA, fp32 on a CPU")
    p.add_argument("--side", type=int, default=1024, help="image side in pixels")
    p.add_argument("--min-tokens", type=int, default=256, help="FP8 only for Linears with this many tokens per row")
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--replays", type=int, default=6)
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/fp8-scout"))
    p.add_argument("--build-missing", action="store_true", help="build the production artifact if the cache lacks it")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}")
    faulthandler.dump_traceback_later(args.budget + 15, exit=True)  # last resort: stacks, then out
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]
    args.build_dir.mkdir(parents=True, exist_ok=True)
    rec = Record(args.out, variants=variants, model=args.model, dtype=str(dtype), side=args.side,
                 torch=torch.__version__, gpu=torch.cuda.get_device_name() if cuda else None,
                 cores=len(os.sched_getaffinity(0)), budget_s=args.budget, min_tokens=args.min_tokens,
                 inductor_options=INDUCTOR_OPTIONS, notes=[])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    models = load_sdxl(args.model, None, device, dtype)
    rec.put("load_s", round(time.perf_counter() - t0, 1))
    target = Target("unet", args.side, args.side)
    builds = [v for v in ("cdt", "fp8") if v in variants]

    # the FP8 copy first: a deep copy of the UNet before CompiledKernels fuses the rendering module in place
    def fp8_copy() -> torch.nn.Module:
        t0 = time.perf_counter()
        q = copy.deepcopy(models.unet)
        fuse_projections(q, processor=True)  # calibrate what is compiled: the fused to_qkv / to_kv
        calib = [step_inputs(models, 4, args.side, t, 100 + i) for i, t in enumerate(CALIBRATION_T)]
        done = quantize(q, calibrate(q, calib), args.min_tokens)
        rec.put("fp8_quantize", {**done, "seconds": round(time.perf_counter() - t0, 1), "calibration_t": CALIBRATION_T,
                                 "calibration_rows": 4})
        return q

    fp8_unet = attempt(rec, "fp8_quantize", fp8_copy) if any(v.startswith("fp8") for v in variants) else None
    if fp8_unet is None and "fp8" in builds:
        builds.remove("fp8")
    # before any capture: fusing later would move the weights the plain graph reads (CompiledKernels fuses)
    fuse_projections(models.unet)

    with torch.no_grad():
        plain = StepCalls.eager(models).unet
        prod = None
        if "prod" in variants:
            prod = production_artifact(models, target, args.build_missing, args.build_dir, rec,
                                       budget_for_build(args, rec, len(builds) + 1))
        calls = {"plain": plain, "prod": prod.unet if prod else None}

        # errors against the fp16 eager UNet, same inputs (before the builds: the quantization's own share)
        err_inputs = {t: step_inputs(models, ROWS[0], args.side, t, 7) for t in ERROR_T}
        want = {t: plain(*x, None, None).float() for t, x in err_inputs.items()}

        def errors(name: str) -> None:
            def measured() -> dict:
                return {f"t{int(t)}": round(rel_err(calls[name](*x, None, None), want[t]), 6)
                        for t, x in err_inputs.items()}
            key = f"rel_err_{name}_vs_eager"
            got = attempt(rec, key, measured)
            if got is not None:
                rec.put(key, got)

        if prod:
            errors("prod")
        if fp8_unet is not None:
            calls["fp8_eager"] = partial(unet_call, fp8_unet)
            errors("fp8_eager")

        # static inputs at the largest row count; the smaller ones are its leading rows
        static = step_inputs(models, ROWS[0], args.side, 500.0, 11)
        timed = {rows: {} for rows in ROWS}
        pool = torch.cuda.graph_pool_handle() if cuda else None

        def capture(names: list[str]) -> None:
            for rows in ROWS:
                for name in names:
                    if calls.get(name) is not None and name in variants:
                        args_ = tuple(a[:rows] for a in static) + (None, None)
                        t = attempt(rec, f"capture_{name}_{rows}_rows", lambda: Timed(calls[name], args_, pool))
                        if t is not None:
                            timed[rows][name] = t

        def measure(key: str, loops: int, replays: int) -> None:
            rec.put(key, {f"{rows // 2}_images": side_by_side(timed[rows], rows // 2, loops, replays) for rows in ROWS})

        capture(["plain", "prod"])
        measure("timing_before_builds", 3, max(args.replays // 2, 1))

    # builds: the production recipe under each variant's options
    for i, name in enumerate(builds):
        seconds = budget_for_build(args, rec, len(builds) - i)
        if seconds < MIN_BUILD_S.get(args.model, 0.0):
            rec.put(f"build_{name}", {"error": f"not started: {seconds:.0f} s left for it"})
            continue
        module = fresh_unet(models) if name == "cdt" else fp8_unet
        path, stats = build_variant(name, target, module, args.build_dir, seconds)
        rec.put(f"build_{name}", stats)
        if path is None:
            continue
        try:
            k = kernels(models, target)
            if name == "fp8":  # bound to the FP8 copy's tensors, as production binds the rendering module's
                k.calls[target] = load(target, dataclasses.replace(models, unet=fp8_unet, copies={}), path)
            elif not k.add(target, path):
                raise RuntimeError("; ".join(k.notes))
            calls[name] = k.unet
        except Exception as e:  # noqa: BLE001
            rec.put(f"load_{name}", {"error": f"{type(e).__name__}: {str(e)[:1000]}"})
        del module

    with torch.no_grad():
        for name in builds:
            if calls.get(name) is not None:
                errors(name)
        capture(builds + ["fp8_eager"])
        if "fp8_eager_fast" in variants and fp8_unet is not None:
            for m in fp8_unet.modules():
                if isinstance(m, Fp8Linear):
                    m.fast_accum = True
            calls["fp8_eager_fast"] = calls["fp8_eager"]
            errors("fp8_eager_fast")
            capture(["fp8_eager_fast"])
        measure("timing", args.loops, args.replays)
    if cuda:
        rec.put("peak_gb", round(torch.cuda.max_memory_allocated() / 2**30, 1))
    rec.put("done", True)


if __name__ == "__main__":
    main()
