"""Step scout for issue 41's items 2 and 3, each before it is built into the product:

  controlnet  the ControlNet's transformer Linears in FP8: the production recipe (engine/kernels/fp8.py: the `fp8`
              row's rewrite, export and options) applied to the ControlNet, its input scales calibrated on the
              live net (a few eager calls: prompts against the empty negative, unit-normal latents, a sparse control
              image, the sampler's range of t), its weights quantised from the live net and bound as production
              binds the UNet's. Timed side by side with the production fp16 ControlNet artifact and the eager net
              in a CUDA graph, at 2 and 8 images (4 and 16 rows, CFG); the residuals' relative L2 error against the
              eager net at t = 999, 500, 50.
  bucket16    the production fp16 UNet recipe exported for up to 32 rows (16 images guided; production's
              artifacts stop at 16 rows), timed against the production artifact at 8 images and at 16: ms per
              image-step, the graphs' memory, the build's seconds.
  layout_force  issue 41 item 5: each up-block resnet's GroupNorm + SiLU kernel reads its input (the concatenation of
              hidden states and skip) NCHW and writes the NHWC copy the convolutions read, in a 1D kernel (3.6 ms for
              one at 8 x 1024², about 11 ms of a step). Inductor skips its channels_last propagation in a graph whose
              convolutions have dynamic shapes (the rows): the production fp16 UNet recipe built with
              force_layout_optimization, against the production artifact at 2 and 8 images, and its error
  layout_nd   the same kernels made 2D by inductor's option triton.prefer_nd_tiling
  tune_fp8    the production FP8 UNet built with max_autotune_pointwise and coordinate_descent_tuning: its
              quantisation kernels (GEGLU's: 185 µs a call where the bandwidth allows about 90) tuned at build time
  fp8_inverse the production FP8 UNet with its inputs quantised by multiplying with a bound inverse scale, not by
              dividing by the scale (Fp8Linear.quantise; built with RECIPES' change), against the cache's artifact at
              2 and 8 images
  fp8_noconv  the production FP8 UNet with its inner convolutions on cuDNN in fp16 (engine/kernels/conv8.py names
              none; RECIPES' change), against the cache's artifact at 2 and 8 images: what the FP8 convolutions give
  fp8_unfused the production FP8 UNet with its feed-forwards unfused (cuBLASLt's FP8 GEMM, then the compiler's GEGLU and
              quantisation: the recipe before engine/kernels/geglu.py; RECIPES' change), against the cache's
              artifact at 2 and 8 images: what the fused kernel gives on the GPU it runs on
  fp8_fastaccum  the production FP8 UNet with its FP8 Linears' GEMMs on cuBLASLt's fast accumulation
              (`use_fast_accum=True`: the Hopper's FP8 sums are no longer promoted to float32 every few steps, as
              torchao's FP8 inference runs them; RECIPES' change), against the cache's artifact at 2 and 8 images and
              its error against it: the FP8 GEMMs are half the FP8 step, at about 730 TFLOPS on an H100 (69.7 TFLOP
              in 95.1 ms, 2026-12-06), 37% of its FP8 peak, where the fp16 GEMMs run at 64% of theirs
  autotune    the production fp16 UNet built with inductor's GEMM autotuning (max_autotune_gemm over cuBLAS and its
              Triton templates, benchmarked on the GPU at build time, which production's background builds must not
              do while a render runs), against the cache's artifact at 2 and 8 images: the fp16 GEMMs are half the
              compiled step (109.9 of 226.2 ms at 8 x 1024² on an H100), at 64% of the chip's fp16 peak. Inductor
              tunes each GEMM at the export's example rows (2), not at a bucket's; on an H100 the build ran past
              466 s (2026-12-06, docs/PERFORMANCE.md thirty-second session)
  fp8_autotune  the same for the FP8 UNet, its `_scaled_mm`s offered inductor's Triton templates beside cuBLASLt
              (production's FP8 builds name cuBLASLt alone: fp8.OPTIONS; RECIPES' change)
  skip_cat    the up blocks' concatenations exported NHWC (export.SkipCatNhwc, in production since it): the cache's
              fp16 and FP8 UNets at 1024² against the artifacts of the recipe before it (the other unet-*.pt2 of
              the size in the cache), waiting for builds that run beside it (gpu.sh build build:fp8@0b)
  persistent  the same A/B for the UNet's inner reductions persistent up to 2048 elements (artifacts.persistent_choices,
              UNET_RECIPE): the cache's UNets against those of the recipe before, carried in ARTZ
  (these scouts run as lanes side by side, builds at once; their timings take turns on a file lock, and an
  autotuning build, which times kernels on the GPU, takes that turn for the whole build)

Each build is artifacts.build (the production code) into --build-dir, stopped at --budget; the JSON is rewritten
after every stage (fp8_scout.py's Record).

    python benchmarks/probes/step_scout.py controlnet --out cn.json --budget 420      # H200, sdxl-random
    python benchmarks/probes/step_scout.py bucket16 --out b16.json --budget 420
    python benchmarks/probes/step_scout.py controlnet --model tiny --side 128 --build-missing --out /tmp/cn.json  # CPU
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_scout import OutOfBudget, Record, Timed, attempt, rel_err, side_by_side, within  # noqa: E402

from storyboard_cli.engine.device import DTYPES  # noqa: E402
from storyboard_cli.engine.conditions.control import embed_guide, embedding_apart  # noqa: E402
from storyboard_cli.engine.eager import controlnet_call  # noqa: E402
from storyboard_cli.engine.kernels import artifacts, export as exporting, fp8  # noqa: E402
from storyboard_cli.engine.kernels.artifacts import Target, build  # noqa: E402
from storyboard_cli.engine.kernels.calls import CompiledKernels, load  # noqa: E402
from storyboard_cli.engine.kernels.export import example_inputs  # noqa: E402
from storyboard_cli.models.loader import load_sdxl  # noqa: E402

ERROR_T = (999.0, 500.0, 50.0)


def fresh(models, module: str) -> torch.nn.Module:
    """A module of the same config without values (bound at load), as engine/kernels/builds.py's child makes it."""
    live = models.unet if module == "unet" else models.controlnets[0]
    with torch.device("meta"):
        model = type(live).from_config(dict(live.config))
    return model.to_empty(device=models.device).to(dtype=models.dtype).eval().requires_grad_(False)


def built(rec: Record, name: str, target: Target, models, folder: Path, seconds: float) -> Path | None:
    """artifacts.build of `target` into `folder`, stopped after `seconds`; None (recorded) if it failed."""
    path = folder / f"{name}-{target.module}{f'-{target.tag}' if target.tag else ''}-{target.width}x{target.height}.pt2"
    if path.is_file():
        rec.put(f"build_{name}", {"reused": path.name})
        return path
    t0 = time.perf_counter()
    try:
        with within(seconds):
            stats = build(target, fresh(models, target.module), path)
    except (OutOfBudget, Exception) as e:  # noqa: BLE001 - a scout records any failure and goes on
        rec.put(f"build_{name}", {"error": f"{type(e).__name__}: {str(e)[:1500]}",
                                  "wall_s": round(time.perf_counter() - t0, 1)})
        return None
    rec.put(f"build_{name}", {**stats, "wall_s": round(time.perf_counter() - t0, 1)})
    return path


def production(args, rec: Record, k: CompiledKernels, target: Target, models) -> Callable | None:
    """The cache's production artifact for `target` loaded through `k` (built first with --build-missing); None, and
    why in the record, without one."""
    prod = k.path(target)
    if not prod.is_file() and args.build_missing:
        prod = built(rec, "prod", target, models, args.build_dir, args.budget - rec.elapsed() - 60)
    if prod is not None and prod.is_file() and k.add(target, prod):
        return k.calls[target]
    rec.put("prod", {"error": f"no production {target.label} artifact ({prod}); {k.notes}"})
    return None


def inputs(module: str, model, rows: int, side: int, t: float, seed: int) -> tuple:
    """The exported call's inputs at `rows` (export.example_inputs), t set, a sparse control image in [0, 1] embedded
    by the net (the guide the step hands its ControlNet)."""
    torch.manual_seed(seed)
    args = list(example_inputs(module, model, rows, side // 8, side // 8))
    args[1] = torch.tensor(t, dtype=torch.float32, device=model.device)
    if module == "controlnet":
        image = torch.rand(rows, 3, side, side, device=model.device) > 0.9  # lines on black, as an edge map
        args[5] = embed_guide(model, image.to(args[5].dtype))
    return tuple(args)


def eager_controlnet(net, *args):
    """The eager net with the step's [rows] timestep, as the eager engine calls it."""
    args = list(args)
    args[1] = args[1].expand(args[0].shape[0])
    return controlnet_call(embedding_apart(net), *args)


class Scales:
    """The FP8 ControlNet artifact's constants beyond the net's own tensors (fp8.InputScales' form)."""

    def __init__(self, amax: dict[str, float], net, device):
        self.x_scales = fp8.input_scales(amax, net, device)

    def tensors(self, models, module):
        return {**fp8.weights(models, module), **self.x_scales}


def errors(rec: Record, key: str, call, want: dict, err_inputs: dict) -> None:
    def measured() -> dict:
        out = {}
        for t, x in err_inputs.items():
            got = call(*x)
            got = got if isinstance(got, (tuple, list)) else (got,)
            out[f"t{int(t)}"] = round(max(rel_err(g, w) for g, w in zip(got, want[t])), 6)
        return out
    got = attempt(rec, key, measured)
    if got is not None:
        rec.put(key, got)


def timing(rec: Record, key: str, calls: dict, make, rows_list, loops: int, replays: int) -> None:
    """Each call captured at each row count (static inputs from `make(rows)`), timed side by side."""
    cuda = torch.cuda.is_available()
    out = {}
    for rows in rows_list:
        args = make(rows)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        timed = {}
        for name, call in calls.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t = attempt(rec, f"capture_{key}_{name}_{rows}", lambda: Timed(call, args, pool))
            if t is None:
                continue
            timed[name] = t
            if cuda:
                rec.put(f"memory_{key}_{name}_{rows}_rows_gb",
                        round((torch.cuda.max_memory_allocated() - before) / 2**30, 2))
        images = rows // 2
        out[f"{images}_images"] = side_by_side(timed, images, loops, replays)
        rec.put(key, out)


def scout_controlnet(args, rec: Record, models) -> None:
    side = args.side
    net = models.controlnets[0]
    k = CompiledKernels(models, root=args.cache)  # fuses the live modules' projections, as a render does
    fp16_t, fp8_t = Target("controlnet", side, side), Target("controlnet", side, side, "fp8")
    t0 = time.perf_counter()
    amax = fp8.calibrate_controlnet(models)  # the product's calibration of the net
    rec.put("calibration", {"linears": len(amax), "seconds": round(time.perf_counter() - t0, 1),
                            "amax_min": min(amax.values()), "amax_max": max(amax.values())})
    calls = {"plain": partial(eager_controlnet, net)}
    if (prod := production(args, rec, k, fp16_t, models)) is not None:
        calls["prod"] = prod
    path = built(rec, "fp8", fp8_t, models, args.build_dir, args.budget - rec.elapsed() - 60)
    if path is not None:
        try:
            calls["fp8"] = load(fp8_t, models, path, Scales(amax, net, models.device))
        except Exception as e:  # noqa: BLE001
            rec.put("load_fp8", {"error": f"{type(e).__name__}: {str(e)[:1500]}"})
    with torch.no_grad():
        err_inputs = {t: inputs("controlnet", net, 16, side, t, 7) for t in ERROR_T}
        want = {t: [w.float() for w in calls["plain"](*x)] for t, x in err_inputs.items()}
        for name in ("prod", "fp8"):
            if name in calls:
                errors(rec, f"rel_err_{name}_vs_eager", calls[name], want, err_inputs)
        timing(rec, "controlnet_timing", calls, lambda rows: inputs("controlnet", net, rows, side, 500.0, 11),
               (4, 16), args.loops, args.replays)


def scout_bucket16(args, rec: Record, models) -> None:
    side = args.side
    k = CompiledKernels(models, root=args.cache)
    target = Target("unet", side, side)
    calls = {}
    if (prod := production(args, rec, k, target, models)) is not None:
        calls["prod16rows"] = prod
    # the same recipe with the rows dynamic up to 32 (the artifact key's "rows" follows)
    exporting.MAX_ROWS = artifacts.MAX_ROWS = 32
    path = built(rec, "rows32", target, models, args.build_dir, args.budget - rec.elapsed() - 60)
    if path is not None:
        try:
            calls["rows32"] = load(target, models, path)
        except Exception as e:  # noqa: BLE001
            rec.put("load_rows32", {"error": f"{type(e).__name__}: {str(e)[:1500]}"})
    with torch.no_grad():
        make = partial(lambda rows: inputs("unet", models.unet, rows, side, 500.0, 11))
        if "prod16rows" in calls and "rows32" in calls:  # the same inputs, two artifacts
            x = make(16)
            rec.put("rel_err_rows32_vs_prod", round(rel_err(calls["rows32"](*x), calls["prod16rows"](*x)), 6))
        timing(rec, "unet_timing_8_images", calls, make, (16,), args.loops, args.replays)
        if "rows32" in calls:
            timing(rec, "unet_timing_16_images", {"rows32": calls["rows32"]}, make, (32,), args.loops, args.replays)


def keep_wrapper(artifact: Path, out: Path) -> None:
    """The artifact's generated wrapper (its Triton kernels' sources are in it as comments), gzipped beside the
    record: which buffers the kernels read and write in which layout."""
    import gzip
    import zipfile

    with zipfile.ZipFile(artifact) as z:
        name = next(n for n in z.namelist() if n.endswith(".wrapper.cpp"))
        out.write_bytes(gzip.compress(z.read(name)))


OPTIONS = {  # scout -> (the UNet's variant, the inductor options added to production's)
    "layout_force": ("compiled", {"force_layout_optimization": True}),
    "layout_nd": ("compiled", {"triton.prefer_nd_tiling": True}),
    "tune_fp8": ("fp8", {"max_autotune_pointwise": True, "coordinate_descent_tuning": True}),
    "fp8_inverse": ("fp8", {}),  # with RECIPES' change
    "fp8_unfused": ("fp8", {}),
    "fp8_noconv": ("fp8", {}),
    "fp8_fastaccum": ("fp8", {}),
    "autotune": ("compiled", {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}),
    "fp8_autotune": ("fp8", {"max_autotune_gemm": True}),
}


class InverseScale:
    """The FP8 Linears' inputs quantised by multiplying with a bound inverse scale (`x_inv`, a constant of its own),
    not by dividing by the scale: GEGLU's fused kernel is bound by its arithmetic, a full fp32 division an element
    among it (benchmarks/probes/pointwise_scout.py). The reciprocal cannot be taken inside the artifact: inductor folds
    an op on constants alone at build time, with the build's placeholder values (0.49 error, seen on the CPU)."""

    def __init__(self, constants):
        self.base = constants
        self.note = constants.note

    def tensors(self, models, model) -> dict:
        out = dict(self.base.tensors(models, model))
        out.update({n[: -len("x_scale")] + "x_inv": t.reciprocal() for n, t in out.items() if n.endswith(".x_scale")})
        return out

    @staticmethod
    def patches():
        init = fp8.Fp8Linear.__init__

        def with_inverse(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.register_buffer("x_inv", torch.ones_like(self.x_scale))

        def quantise(self, x):
            return (x * self.x_inv).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)

        return [mock.patch.object(fp8.Fp8Linear, "__init__", with_inverse),
                mock.patch.object(fp8.Fp8Linear, "quantise", quantise)]


class Production:
    """A recipe change that binds production's constants as they are (the FP8 row's scales and weights): only its
    build's patches differ."""

    def __init__(self, constants):
        self.base = constants
        self.note = constants.note

    def tensors(self, models, model) -> dict:
        return self.base.tensors(models, model)


class Unfused(Production):
    """The FP8 recipe before its feed-forwards were fused (engine/kernels/geglu.py `fuse` does nothing): the GEMM on
    cuBLASLt and the compiler's GEGLU and quantisation kernel, as the FP8 artifacts were built until 2026-12-06."""

    @staticmethod
    def patches():
        from storyboard_cli.engine.kernels import geglu

        return [mock.patch.object(geglu, "fuse", lambda model: 0)]


class NoConvs(Production):
    """The FP8 recipe without its FP8 convolutions (engine/kernels/conv8.py `convs` names none): the inner convolutions
    on cuDNN in fp16, as the FP8 artifacts were built until 2026-12-06. Its constants leave out the FP8 convolutions'
    (the artifact reads those names' fp16 channels_last weights)."""

    def tensors(self, models, model) -> dict:
        from storyboard_cli.engine.kernels import conv8

        drop = {f"{n}.{t}" for n in conv8.convs(model) for t in ("weight", "w_scale", "x_scale")}
        return {k: v for k, v in self.base.tensors(models, model).items() if k not in drop}

    @staticmethod
    def patches():
        from storyboard_cli.engine.kernels import conv8

        return [mock.patch.object(conv8, "convs", lambda model: [])]


class FastAccum(Production):
    """The FP8 Linears' GEMMs with cuBLASLt's fast accumulation (`torch._scaled_mm(..., use_fast_accum=True)`), the
    rest of production's recipe as it is: the export records the flag on each `_scaled_mm` it traces, the artifact's
    cuBLASLt call takes it. The fused feed-forward and the FP8 convolutions (Triton kernels of ours) accumulate at the
    Hopper's reduced precision already."""

    @staticmethod
    def patches():
        real = torch._scaled_mm

        def fast(*args, **kwargs):
            return real(*args, **{**kwargs, "use_fast_accum": True})

        return [mock.patch.object(fp8.torch, "_scaled_mm", fast)]


class Fp8Autotune(Production):
    """Production's FP8 UNet with its `_scaled_mm`s autotuned over cuBLASLt and inductor's Triton templates: the FP8 row's
    own options (fp8.OPTIONS, which name cuBLASLt alone and come after the scout's) opened to both."""

    @staticmethod
    def patches():
        return [mock.patch.dict(fp8.OPTIONS, {"max_autotune_gemm_backends": "ATEN,TRITON"})]


RECIPES = {"fp8_inverse": InverseScale, "fp8_unfused": Unfused, "fp8_noconv": NoConvs,  # scout -> its recipe change:
           "fp8_fastaccum": FastAccum, "fp8_autotune": Fp8Autotune}  # the build's patches, the constants it binds


def tunes_on_gpu(name: str) -> bool:
    """Whether the scout's build autotunes its GEMMs: inductor times each candidate kernel on the GPU as it builds."""
    return bool(OPTIONS[name][1].get("max_autotune_gemm"))


@contextmanager
def timing_turn(args, rec: Record, key: str):
    """The lanes' one turn at the GPU's clock (a file lock beside the build folders): held while a scout times, and
    while an autotuning build benchmarks; how long it waited in the record under `key`."""
    import fcntl

    with open(args.build_dir.parent / "step-scout-timing.lock", "w") as lock:
        t0 = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec.put(key, round(time.perf_counter() - t0, 1))
        yield


def scout_options(args, rec: Record, models) -> None:
    """The production UNet (OPTIONS' variant) built with more inductor options, against the cache's artifact."""
    side = args.side
    name = args.what
    variant, extra = OPTIONS[name]
    k = CompiledKernels(models, root=args.cache, variant=variant)  # its constants: FP8's scales from the cache
    target = k.unet_target(side, side)
    calls = {}
    if (prod := production(args, rec, k, target, models)) is not None:
        calls["prod"] = prod
    artifacts.INDUCTOR_OPTIONS.update(extra)
    recipe = RECIPES.get(name)
    with ExitStack() as patched:
        for patch in recipe.patches() if recipe else ():
            patched.enter_context(patch)
        if tunes_on_gpu(name):  # its build benchmarks kernels on the GPU: not while the other lane times
            patched.enter_context(timing_turn(args, rec, "build_lock_wait_s"))
        path = built(rec, name, target, models, args.build_dir, args.budget - rec.elapsed() - 60)
    if path is not None:
        keep_wrapper(path, args.out.with_suffix(".wrapper.cpp.gz"))
        try:
            constants = k.constants.get(variant)
            calls[name] = load(target, models, path, recipe(constants) if recipe else constants)
        except Exception as e:  # noqa: BLE001
            rec.put(f"load_{name}", {"error": f"{type(e).__name__}: {str(e)[:1500]}"})
    with timing_turn(args, rec, "lock_wait_s"), torch.no_grad():  # the other lane's timings first, if they began first
        make = partial(lambda rows: inputs("unet", models.unet, rows, side, 500.0, 11))
        if "prod" in calls and name in calls:
            x = make(16)
            rec.put(f"rel_err_{name}_vs_prod", round(rel_err(calls[name](*x), calls["prod"](*x)), 6))
        timing(rec, "unet_timing", calls, make, (4, 16), args.loops, args.replays)


def scout_recipe(args, rec: Record, models) -> None:
    """The cache's UNets (today's recipe, named args.what) against the ones built before it, fp16 and FP8 at `side`,
    side by side."""
    import glob
    import re

    side = args.side
    for variant in ("compiled", "fp8"):
        k = CompiledKernels(models, root=args.cache, variant=variant)
        target = k.unet_target(side, side)
        new = k.path(target)
        deadline = time.perf_counter() + max(0.0, args.budget - rec.elapsed() - 150)
        while not new.with_suffix(".ok").is_file() and time.perf_counter() < deadline:
            time.sleep(5)  # a build beside this scout
        pattern = re.compile(rf"unet-{'fp8-' if variant == 'fp8' else ''}{side}x{side}-[0-9a-f]{{20}}\.pt2$")
        old = [Path(p) for p in glob.glob(str(new.parent / "unet-*.pt2")) if pattern.search(p) and Path(p) != new]
        rec.put(f"{variant}_artifacts", {"new": new.name, "new_ready": new.with_suffix(".ok").is_file(),
                                         "old": [p.name for p in old]})
        if not old or not new.with_suffix(".ok").is_file():
            continue
        keep_wrapper(new, args.out.with_name(args.out.stem + f"-{variant}.wrapper.cpp.gz"))
        calls = {}
        after = args.what
        for name, path in (("before", old[0]), (after, new)):
            try:
                calls[name] = load(target, models, path, k.constants.get(variant))
            except Exception as e:  # noqa: BLE001
                rec.put(f"load_{variant}_{name}", {"error": f"{type(e).__name__}: {str(e)[:1500]}"})
        with torch.no_grad():
            make = partial(lambda rows: inputs("unet", models.unet, rows, side, 500.0, 11))
            if len(calls) == 2:
                x = make(16)
                rec.put(f"rel_err_{variant}_{after}_vs_before",
                        round(rel_err(calls[after](*x), calls["before"](*x)), 6))
            timing(rec, f"{variant}_unet_timing", calls, make, (4, 16), args.loops, args.replays)
        del calls
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("controlnet", "bucket16", "skip_cat", "persistent", *OPTIONS))
    p.add_argument("--out", type=Path, required=True, help="the JSON record (rewritten after each stage)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    p.add_argument("--model", default="sdxl-random")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp16 on CUDA, fp32 on a CPU")
    p.add_argument("--side", type=int, default=1024, help="image side in pixels")
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--replays", type=int, default=6)
    p.add_argument("--cache", type=Path, default=None, help="the compiled artifacts' folder (default: $BCG_CACHE's)")
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/step-scout"))
    p.add_argument("--build-missing", action="store_true", help="build the production artifact if the cache lacks it")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.budget + 15, exit=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]
    args.build_dir.mkdir(parents=True, exist_ok=True)
    rec = Record(args.out, what=args.what, model=args.model, dtype=str(dtype), side=args.side,
                 torch=torch.__version__, gpu=torch.cuda.get_device_name() if cuda else None,
                 cores=len(os.sched_getaffinity(0)), budget_s=args.budget)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    models = load_sdxl(args.model, args.model if args.what == "controlnet" else None, device, dtype)
    rec.put("load_s", round(time.perf_counter() - t0, 1))
    scout = {"controlnet": scout_controlnet, "bucket16": scout_bucket16,
             "skip_cat": scout_recipe, "persistent": scout_recipe}.get(args.what, scout_options)
    scout(args, rec, models)
    if cuda:
        rec.put("peak_gb", round(torch.cuda.max_memory_allocated() / 2**30, 1))
    rec.put("done", True)


if __name__ == "__main__":
    main()
