"""Compiled denoiser kernels as artifacts: the step's UNet and ControlNet calls (engine/kernels/export.py), exported
once per image size with the rows (2 x images, CFG) dynamic, compiled ahead of time by AOTInductor, kept under
$BCG_CACHE and loaded in well under a second. They run inside GraphRunner's graphs (ShapeKey.variant "compiled", or
another compiled row of engine/variants.py).

- One artifact per (module, image size, precision), rows 2..16. An artifact with the image size dynamic too was
  measured 3-8% faster than the plain graphs and took 50 s to load; with the size static the same
  compiler gave 1.19-1.31x and loads at once (docs/PERFORMANCE.md, "Compiled kernels per size"). A
  job uses a handful of sizes, so it costs a handful of compiles, built in the background while the
  render runs on the plain graphs (engine/kernels/builds.py), and the next job with those sizes none.
- Weights stay outside the artifact (`package_constants_in_so=False`) and are bound to the rendering modules'
  tensors (`load_constants(user_managed=True)`, engine/kernels/calls.py): no second copy of the weights beyond the
  conv copies.
- An artifact's key covers everything that changes the generated code: module class and config,
  parameter names/shapes/dtypes (not values), the size, torch/triton/CUDA versions, the GPU's capability and the
  properties the compiler reads of it (`gpu_facts`), the row range, the recipe and the compile options. A stale key
  is never looked up; a corrupt file fails to load and that size keeps its plain graph.
- Not the GPU's name: a cache built on one card serves every card of the same chip and configuration (a farm's H100
  SXMs and H200s, where their facts match: the same GH100 with 132 SMs, only the memory differs). Each card model's
  first replay of a graph is still checked against the eager step (engine/graph/ledger.py names the card).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterable

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.device import capability
from storyboard_cli.engine.kernels.export import (CONTROLNET_RECIPE, MAX_ROWS, PERSISTENT_INNER, RECIPE, UNET_RECIPE,
                                                  Target, export)
from storyboard_cli.engine.variants import COMPILED, VARIANTS
from storyboard_cli.models.tiny import cache_root

log = logging.getLogger(__name__)
FORMAT = 6  # bump when the export wrappers, the recipe or the options below change what is compiled (5: the
# timestep input is float32; format 4 built it in the model's dtype and read the step's float32 timestep as fp16
# bits. 6: the export runs at the float32 default dtype, as the rendering process does)
MODULES = ("unet", "controlnet")
SIDES = (128, 2048)  # image side in pixels, multiples of 64 (three 2x downsamplings of the latent)
INDUCTOR_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,  # weights come from the eager modules at load
    # every weight stays a bindable constant: without it inductor inlines the VALUES of tiny ones
    # (shape () or <= 8 elements, e.g. the UNet's conv_out.bias) into the code, and a LoRA or other
    # weights would not reach them; no runtime folding: it would keep a second copy of the weights
    "always_keep_tensor_constants": True,
    "aot_inductor.use_runtime_constant_folding": False,
    "conv_1x1_as_mm": True,
    # link the shared libstdc++ (the one the loading process has) ahead of the compiler's own choice:
    # a compiler that puts a static copy of libstdc++ into the library (seen on the H200 image) gives
    # it a private, never-initialised locale, and AOTInductor's loader (std::regex on the device
    # string) crashes on it at load, in every process (docs/PERFORMANCE.md, "Compiled kernels")
    "aot_inductor.custom_op_libs": [":libstdc++.so.6"] if sys.platform.startswith("linux") else None,
}


def fits(batch: int, height: int, width: int) -> str | None:
    """None if compiled kernels can exist for this shape, else why not."""
    lo, hi = SIDES
    if 2 * batch > MAX_ROWS:
        return f"{batch} images exceed the compiled range (at most {MAX_ROWS // 2})"
    if height % 64 or width % 64 or not (lo <= height <= hi and lo <= width <= hi):
        return f"{width}x{height} is outside the compiled sizes (multiples of 64, {lo}-{hi})"
    return None


def targets(shapes: Iterable[Shape], controlnet: bool, variant: str = COMPILED, refs: int = 0,
            tags: tuple[str, ...] = ()) -> list[Target]:
    """The artifacts these shapes use: a UNet per size, a ControlNet per size used with a control image, both in
    `variant`'s precision. Largest sizes first, UNets before ControlNets (a UNet serves every shape of its size). The
    ControlNet artifact is the first net's (bound to its weights): a shape's further nets run their modules inside
    the graph (StepCalls.others)."""
    need, precision = set(), VARIANTS[variant].precision
    for s in shapes:
        if fits(s.batch, s.height, s.width) is None:
            need.add(Target("unet", s.height, s.width, precision, refs, tags))
            if s.control & 1 and controlnet:
                need.add(Target("controlnet", s.height, s.width, precision))
    return sorted(need, key=lambda t: (t.module != "unet", -t.height * t.width, t.height))


def module_of(models: Any, module: str) -> torch.nn.Module:
    if module == "unet":
        return models.unet
    return models.controlnets[0] if models.controlnets else None  # the first net's (targets)


def options(target: Target) -> dict:
    """The inductor options of `target`'s build."""
    return {**INDUCTOR_OPTIONS, **target.variant.options}


# what of a GPU the generated code depends on: inductor's device properties (its kernels' launch and reduction
# heuristics read the SM count, the registers and threads per SM, the warp: torch/_inductor/runtime/hints.py
# `DeviceProperties`) and Triton's shared memory per block. Not the L2's size: inductor reads it only to flush the
# cache between autotuning's timings, which a build does not run, and it is what tells an H200 (60 MiB) from an H100
# SXM (50 MiB), whose other properties match (docs/PERFORMANCE.md, thirty-fifth session). Missing ones (an older
# torch) count as None.
GPU_FACTS = ("multi_processor_count", "regs_per_multiprocessor", "max_threads_per_multi_processor",
             "max_threads_per_block", "warp_size", "shared_memory_per_block_optin")


def gpu_facts(dev: torch.device) -> dict:
    """The GPU as an artifact's key names it beside its capability: `GPU_FACTS`, not its name."""
    props = torch.cuda.get_device_properties(dev)
    return {f: getattr(props, f, None) for f in GPU_FACTS}


def artifact_key(target: Target, model: torch.nn.Module) -> str:
    """Everything that changes the generated code (not the weight values, which are passed in)."""
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        import triton

        where = {"triton": triton.__version__, "cuda": torch.version.cuda, "gpu": gpu_facts(dev),
                 "capability": capability(dev)}
    else:
        where = {"cpu": platform.machine(), "compiler": platform.python_compiler()}
        if target.precision == "fp8":  # FP8 on the CPU is the dequantised matmul (fp8.Fp8Linear), not _scaled_mm
            where["fp8"] = "dequantised"
    facts = {
        "format": FORMAT, "target": [target.module, target.height, target.width], "class": type(model).__name__,
        "config": {k: v for k, v in dict(model.config).items() if not k.startswith("_")},
        "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.state_dict().items()
                   if not n.endswith(("to_qkv.weight", "to_kv.weight"))],  # made by fuse_projections
        # the fp16 row adds nothing to the recipe: its key stays what it was before FP8 existed, and caches keep it
        "torch": torch.__version__, "rows": MAX_ROWS, "options": options(target),
        "recipe": RECIPE + (UNET_RECIPE if target.module == "unet" else CONTROLNET_RECIPE) + target.variant.recipe,
        **where,
    }
    if target.refs:  # only where there are: a UNet without an adapter keeps the key it had
        facts["refs"] = target.refs
    if target.tags:  # the same: a UNet that takes no further kind's inputs keeps its key
        facts["tags"] = list(target.tags)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def artifact_path(target: Target, model: torch.nn.Module, root: Path | None = None) -> Path:
    kind = target.module + (f"-{target.tag}" if target.tag else "") + (f"-refs{target.refs}" if target.refs else "")
    kind += "".join(f"-{t}" for t in target.tags)
    name = f"{kind}-{target.width}x{target.height}-{artifact_key(target, model)}.pt2"
    return (root or cache_root() / "compiled") / name


def persistent_choices():
    """Inductor's choices with the GPU's inner reductions persistent (one pass) up to PERSISTENT_INNER elements, not
    inductor's 1024: the UNet's LayerNorms over 1280 channels then read their input once, not twice (with the FP8
    quantisation fused, 50 µs a call against 87 at 8 x 1024²: docs/PERFORMANCE.md, eighteenth session)."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint

    class Choices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            n = features.reduction_numel
            if (config.triton.persistent_reductions and not cooperative_reduction and getattr(n, "is_number", True)
                    and features.get_reduction_hint() == ReductionHint.INNER):
                return int(n) <= PERSISTENT_INNER
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

        def uuid(self) -> str:  # the graph cache's key (where torch has config.inductor_choices_class)
            return f"bcg-persistent-inner-{PERSISTENT_INNER}"

    return Choices()


@contextmanager
def unet_choices():
    """The UNet's inductor choices (UNET_RECIPE) around its build. The graph cache must not hand a build the code of a
    graph compiled under other choices: where torch's config names the choices, its key covers them; otherwise the
    build skips that cache."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    # the handler first: it saves the thread's choices before the config names others, and restores them
    patch = ({"inductor_choices_class": persistent_choices} if hasattr(config, "inductor_choices_class")
             else {"fx_graph_cache": False})
    with V.set_choices_handler(persistent_choices()), config.patch(**patch):
        yield


def build(target: Target, model: torch.nn.Module, path: Path) -> dict:
    """Exports and compiles `model` (a UNet or ControlNet: its values do not matter) for `target` to
    `path`, then loads it once in this process; returns seconds per stage. Minutes of work: a child
    process does it (engine/kernels/builds.py), never a render."""
    from torch._inductor import aoti_compile_and_package

    t0 = time.perf_counter()
    exported = export(target, model)
    t1 = time.perf_counter()
    # the archive's root folder is named after the file: build under the final name in a private
    # folder, load it there, then move it into place (atomic: a killed or crashing build leaves nothing)
    tmp = path.parent / f".build-{os.getpid()}" / path.name
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        with unet_choices() if target.module == "unet" else nullcontext():
            aoti_compile_and_package(exported, package_path=str(tmp), inductor_configs=options(target))
        t2 = time.perf_counter()
        open_package(tmp).get_constant_fqns()
        t3 = time.perf_counter()
        os.replace(tmp, path)
        path.with_suffix(".ok").write_text(f"loaded {_digest(path)}\n")
    finally:
        tmp.unlink(missing_ok=True)
        tmp.parent.rmdir()
    return {"export_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1), "load_s": round(t3 - t2, 2),
            "mb": round(path.stat().st_size / 2**20, 1), "phases_s": compile_phases()}


def compile_phases(least_s: float = 0.5) -> dict[str, float]:
    """The compiler's timed phases in this process so far (torch's `compilation_time_metrics`), seconds summed per
    phase, longest first, those of `least_s` or more: where a build's compile time goes (lowering, scheduling and
    fusion, kernel code, the C++ wrapper's compile). The phases nest (`fx_codegen_and_compile` holds the rest), and
    work in the compile workers counts where the build waits for it."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without the table: a record without phases, never a failed build
        return {}
    total = {name: sum(times) for name, times in compilation_time_metrics.items()}
    return {name: round(s, 1) for name, s in sorted(total.items(), key=lambda kv: -kv[1]) if s >= least_s}


def open_package(path: Path) -> Any:
    """The compiled call in an artifact, as `aoti_load_package` gives it, without that function's device
    survey: before the loader it compares the machine with the one that built the package, only to warn,
    and finding the CPU's vector ISA compiles and runs test programs: 35-50 s in a fresh process on the
    H200 (benchmarks/probes/load_probe.py), where the load itself takes 0.02 s. The artifact key already names the
    GPU, CUDA, triton and torch that built it."""
    from torch._inductor.package import AOTICompiledModel

    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is None:  # a torch without the loader class here: the public function
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path), run_single_threaded=True)
    # single-threaded: no thread synchronisation around each run, which would conflict with our CUDA
    # graph capture (torch's own advice for CUDA graphs; huggingface/flux-fast loads its packages so)
    return AOTICompiledModel(loader(str(path), "model", True, 1, -1))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a few ms for an artifact of 10 MB


def loads_here(path: Path) -> bool:
    """Whether the artifact loads on this machine. A build leaves a marker after loading it in its own
    process; an artifact without one (copied in from elsewhere) is tried once in a child process (a broken
    or foreign shared library can take the loading process down, which must never be a render). Markers
    name the artifact's digest, not its time: a cache copied to another machine keeps them."""
    marker, bad = path.with_suffix(".ok"), path.with_suffix(".bad")
    digest = _digest(path)
    for seen in (marker, bad):
        if seen.is_file() and seen.read_text().split()[-1:] == [digest]:
            return seen is marker
    code = "import sys; from pathlib import Path; from storyboard_cli.engine.kernels.artifacts import open_package; " \
           "open_package(Path(sys.argv[1]))"
    # output to a file, not a pipe: a process the child leaves behind (a compile worker) would hold a pipe
    # open, and waiting for its end would wait for that process, not for the load
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    with tempfile.TemporaryFile() as err:
        try:
            done = subprocess.run([sys.executable, "-c", code, str(path)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=err, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            log.warning("compiled artifact %s: its load check ran past 120 s", path.name)
            return False
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
    if done.returncode != 0:
        log.warning("compiled artifact %s does not load here (exit %s): %s", path.name, done.returncode,
                    tail[0] if tail else "no output")
        bad.write_text(f"exit {done.returncode} {digest}\n")  # not tried again until the artifact is rebuilt
        return False
    marker.write_text(f"loaded {digest}\n")
    return True
