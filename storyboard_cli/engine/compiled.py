"""Compiled denoiser kernels: the UNet and ControlNet calls of the step, exported once with dynamic
rows and latent size, compiled ahead of time by AOTInductor, kept under $BCG_CACHE and loaded in
seconds. They run inside GraphRunner's graphs (ShapeKey.variant = "compiled").

- One artifact per module (UNet, ControlNet), not per shape: rows (2 x images, CFG) and the latent
  height/width are dynamic, so a job's 10-13 shapes cost two compiles, and a new job's shapes none.
- Weights stay outside the artifact (`package_constants_in_so=False`) and are handed over as the
  eager modules' own tensors (`load_constants(user_managed=True)`): one copy of the weights in memory,
  and an in-place weight update (LoRA) is seen by the compiled kernels as by the eager ones.
- The UNet is exported WITH ControlNet residual inputs; a shape without ControlNet feeds it zeros
  (a few element-wise adds; their cost is not measured yet), so one UNet artifact serves both.
- An artifact's key covers everything that changes the generated code: module class and config,
  parameter names/shapes/dtypes (not values: weights are passed in), torch/triton/CUDA versions,
  GPU name and capability, the dynamic ranges and the compile options. A stale key is never
  looked up; a corrupt file fails to load and the caller falls back to the plain graph.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from storyboard_cli.engine.eager import StepCalls, controlnet_call, unet_call
from storyboard_cli.models.tiny import cache_root

log = logging.getLogger(__name__)
FORMAT = 2  # bump when the export wrappers or options below change what is compiled
MODULES = ("unet", "controlnet")
MAX_ROWS = 16  # 2 x the largest bucket (8 images, CFG doubled)
LATENT_RANGE = (2, 32)  # latent side / 8, i.e. images of 128..2048 pixels a side, multiples of 64
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


class UNetCall(torch.nn.Module):
    """The step's UNet call (engine/eager.py unet_call) as a module to export: down is a tuple."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, latents, t, embeds, pooled, time_ids, mid, down):
        return unet_call(self.unet, latents, t, embeds, pooled, time_ids, mid, list(down))


class ControlNetCall(torch.nn.Module):
    """The step's ControlNet call (engine/eager.py controlnet_call) as a module to export."""

    def __init__(self, controlnet: torch.nn.Module):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, latents, t, embeds, pooled, time_ids, image, scale):
        return controlnet_call(self.controlnet, latents, t, embeds, pooled, time_ids, image, scale)


@dataclass(frozen=True)
class Residuals:
    """Shapes of the UNet's ControlNet residual inputs, as multiples of the latent side: (channels, divisor)."""

    down: tuple[tuple[int, int], ...]
    mid: tuple[int, int]

    @classmethod
    def of(cls, unet: torch.nn.Module) -> Residuals:
        # as diffusers' ControlNetModel: conv_in, then each down block's resnets and downsampler
        cfg = unet.config
        chans, divisor = [(cfg.block_out_channels[0], 1)], 1
        for i, c in enumerate(cfg.block_out_channels):
            chans += [(c, divisor)] * cfg.layers_per_block
            if i < len(cfg.block_out_channels) - 1:
                divisor *= 2
                chans.append((c, divisor))
        return cls(tuple(chans), (cfg.block_out_channels[-1], divisor))

    def zeros(self, rows: int, h: int, w: int, dtype: torch.dtype, device: torch.device):
        mid = torch.zeros(rows, self.mid[0], h // self.mid[1], w // self.mid[1], dtype=dtype, device=device)
        return mid, [torch.zeros(rows, c, h // d, w // d, dtype=dtype, device=device) for c, d in self.down]


def example_inputs(module: str, unet: torch.nn.Module, rows: int, h: int, w: int, dtype, device,
                   text_dim: int, pooled_dim: int) -> tuple:
    """Inputs of the exported call, at one concrete shape (values do not matter)."""
    latents = torch.randn(rows, 4, h, w, dtype=dtype, device=device)
    t = torch.tensor(500.0, device=device)
    embeds = torch.randn(rows, 77, text_dim, dtype=dtype, device=device)
    pooled = torch.randn(rows, pooled_dim, dtype=dtype, device=device)
    time_ids = torch.tensor([8 * h, 8 * w, 0, 0, 8 * h, 8 * w], dtype=dtype, device=device).expand(rows, 6).clone()
    if module == "controlnet":
        image = torch.rand(rows, 3, 8 * h, 8 * w, dtype=dtype, device=device)
        return latents, t, embeds, pooled, time_ids, image, torch.ones(rows, 1, 1, 1, dtype=dtype, device=device)
    mid, down = Residuals.of(unet).zeros(rows, h, w, dtype, device)
    return latents, t, embeds, pooled, time_ids, mid, tuple(down)


def dynamic_shapes(module: str, unet: torch.nn.Module) -> tuple:
    """torch.export Dims: rows 2..MAX_ROWS, latent h and w multiples of 8 in LATENT_RANGE."""
    from torch.export import Dim

    rows = Dim("rows", min=2, max=MAX_ROWS)
    h8, w8 = Dim("h8", min=LATENT_RANGE[0], max=LATENT_RANGE[1]), Dim("w8", min=LATENT_RANGE[0], max=LATENT_RANGE[1])
    latents = {0: rows, 2: 8 * h8, 3: 8 * w8}
    common = (latents, None, {0: rows}, {0: rows}, {0: rows})
    if module == "controlnet":
        return (*common, {0: rows, 2: 64 * h8, 3: 64 * w8}, {0: rows})
    res = Residuals.of(unet)
    mid = {0: rows, 2: (8 // res.mid[1]) * h8, 3: (8 // res.mid[1]) * w8}
    return (*common, mid, tuple({0: rows, 2: (8 // d) * h8, 3: (8 // d) * w8} for _, d in res.down))


def fits(batch: int, height: int, width: int) -> str | None:
    """None if a shape is inside the compiled ranges, else why not."""
    lo, hi = 64 * LATENT_RANGE[0], 64 * LATENT_RANGE[1]
    if 2 * batch > MAX_ROWS:
        return f"{batch} images exceed the compiled range (at most {MAX_ROWS // 2})"
    if height % 64 or width % 64 or not (lo <= height <= hi and lo <= width <= hi):
        return f"{width}x{height} is outside the compiled sizes (multiples of 64, {lo}-{hi})"
    return None


def artifact_key(module: str, model: torch.nn.Module) -> str:
    """Everything that changes the generated code (not the weight values, which are passed in)."""
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        import triton

        target = {"triton": triton.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(dev),
                  "capability": torch.cuda.get_device_capability(dev)}
    else:
        target = {"cpu": platform.machine(), "compiler": platform.python_compiler()}
    facts = {
        "format": FORMAT, "module": module, "class": type(model).__name__,
        "config": {k: v for k, v in dict(model.config).items() if not k.startswith("_")},
        "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.state_dict().items()],
        "torch": torch.__version__, "rows": MAX_ROWS, "latent": LATENT_RANGE, "options": INDUCTOR_OPTIONS,
        **target,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def artifact_path(module: str, model: torch.nn.Module, root: Path | None = None) -> Path:
    return (root or cache_root() / "compiled") / f"{module}-{artifact_key(module, model)}.pt2"


def build(module: str, models: Any, path: Path) -> float:
    """Exports and compiles `module` ("unet" or "controlnet") of `models` to `path`; returns seconds.
    Minutes of work: `bcg capture --warm` does it, a render never does."""
    from torch._inductor import aoti_compile_and_package

    unet = models.unet
    wrapper = UNetCall(unet) if module == "unet" else ControlNetCall(models.controlnet)
    text_dim = unet.config.cross_attention_dim
    pooled_dim = models.text_encoders[1].config.projection_dim
    args = example_inputs(module, unet, 2, 128, 128, models.dtype, models.device, text_dim, pooled_dim)
    t0 = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(module, unet), strict=False)
    # the archive's root folder is named after the file: build under the final name in a private
    # folder, then move it into place (atomic: a killed compile leaves no half artifact behind)
    tmp = path.parent / f".build-{os.getpid()}" / path.name
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        aoti_compile_and_package(exported, package_path=str(tmp), inductor_configs=dict(INDUCTOR_OPTIONS))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.parent.rmdir()
    return time.perf_counter() - t0


def load(module: str, models: Any, path: Path) -> Callable:
    """The compiled call, its constants bound to the eager module's own parameter tensors."""
    from torch._inductor import aoti_load_package

    model, prefix = _module(models, module), f"{module}."
    # single-threaded: no thread synchronisation around each run, which would conflict with our CUDA
    # graph capture (torch's own advice for CUDA graphs; huggingface/flux-fast loads its packages so)
    compiled = aoti_load_package(str(path), run_single_threaded=True)
    tensors = {prefix + n: t for n, t in model.state_dict(keep_vars=True).items()}
    wanted = compiled.get_constant_fqns()
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise RuntimeError(f"artifact wants {len(missing)} constants the model lacks, e.g. {missing[0]}")
    constants = {n: tensors[n].detach() for n in wanted}  # the same storages, without autograd state
    compiled.load_constants(constants, check_full_update=True, user_managed=True)
    compiled.bcg_constants = constants  # user-managed: the loader keeps pointers, we keep the tensors alive
    return compiled


def loads_here(path: Path) -> bool:
    """Whether the artifact loads on this machine, tried once in a child process (a broken or foreign
    shared library can take the loading process down, which must never be a render); remembered in a
    marker file next to it."""
    marker, bad = path.with_suffix(".ok"), path.with_suffix(".bad")
    for seen in (marker, bad):
        if seen.is_file() and seen.stat().st_mtime >= path.stat().st_mtime:
            return seen is marker
    code = "import sys, torch._inductor as i; i.aoti_load_package(sys.argv[1], run_single_threaded=True)"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    if done.returncode != 0:
        log.warning("compiled artifact %s does not load here (exit %s)", path.name, done.returncode)
        bad.write_text(f"exit {done.returncode}\n")  # not tried again until the artifact is rebuilt
        return False
    marker.write_text("loaded\n")
    return True


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """The exported calls take the timestep as a scalar; the step passes a row of its coefficient table
    expanded to [2B]. Cloned: a view into the table is not 16-byte aligned, which compiled kernels assume."""
    return t.reshape(-1)[0].clone()


class CompiledCalls(StepCalls):
    """The step's module calls on compiled kernels (see StepCalls), for shapes inside the compiled ranges.

    A shape without ControlNet feeds the UNet's residual inputs from one zero buffer (read-only views:
    the compiled code never writes its inputs); without a ControlNet artifact the ControlNet runs as
    the plain module inside the same graph."""

    def __init__(self, models: Any, unet: Callable, controlnet: Callable | None):
        self.models, self.residuals = models, Residuals.of(models.unet)
        self._compiled_unet, self._compiled_cn = unet, controlnet
        plain_cn = None if models.controlnet is None else partial(controlnet_call, models.controlnet)
        super().__init__(self._unet, self._controlnet if controlnet is not None else plain_cn)
        self.zeros = torch.zeros(0, dtype=models.dtype, device=models.device)

    def reserve(self, max_batch: int, max_pixels: int) -> None:
        """The zero residuals for the largest shape, allocated before any capture (graphs keep the pointer)."""
        rows, latent = 2 * max_batch, max_pixels // 64
        need = rows * max(c * latent // (d * d) for c, d in (*self.residuals.down, self.residuals.mid))
        if self.zeros.numel() < need:
            self.zeros = torch.zeros(need, dtype=self.models.dtype, device=self.models.device)

    def _zero_residuals(self, rows: int, h: int, w: int):
        def view(c: int, d: int) -> torch.Tensor:
            return self.zeros[: rows * c * (h // d) * (w // d)].view(rows, c, h // d, w // d)
        return view(*self.residuals.mid), tuple(view(c, d) for c, d in self.residuals.down)

    def _unet(self, latents, t, embeds, pooled, time_ids, mid, down):
        if mid is None:
            mid, down = self._zero_residuals(latents.shape[0], latents.shape[2], latents.shape[3])
        return self._compiled_unet(latents, _scalar(t), embeds, pooled, time_ids, mid, tuple(down))

    def _controlnet(self, latents, t, embeds, pooled, time_ids, image, scale):
        return self._compiled_cn(latents, _scalar(t), embeds, pooled, time_ids, image, scale)

    def fits(self, batch: int, height: int, width: int) -> str | None:
        return fits(batch, height, width)


@dataclass
class CompileEvent:
    module: str
    state: str  # "compiling" | "done" | "failed"
    elapsed_s: float
    estimate_s: float
    message: str = ""


def missing(models: Any, root: Path | None = None) -> list[str]:
    """The modules of `models` without a usable artifact in the cache."""
    todo = []
    for module in (m for m in MODULES if m == "unet" or models.controlnet is not None):
        path = artifact_path(module, _module(models, module), root)
        if path.is_file() and not loads_here(path):
            path.unlink()  # corrupt or foreign: rebuilt
            path.with_suffix(".bad").unlink(missing_ok=True)
        if not path.is_file():
            todo.append(module)
    return todo


def _module(models: Any, module: str) -> torch.nn.Module:
    return models.unet if module == "unet" else models.controlnet


def build_missing(models: Any, model_spec: str, controlnet_spec: str | None,
                  on_event: Callable[[CompileEvent], None] | None = None, root: Path | None = None) -> list[str]:
    """Builds every missing artifact, one child process per module, in parallel; returns failure notes.
    Children load the weights themselves (their compile holds memory the parent's render would want)."""
    from storyboard_cli.engine.build import dtype_flag

    on_event = on_event or (lambda e: None)
    dtype = dtype_flag(models.dtype)
    todo = missing(models, root)
    procs = {}
    for module in todo:
        path = artifact_path(module, _module(models, module), root)
        cmd = [sys.executable, "-m", "storyboard_cli.engine.compiled", module, model_spec, controlnet_spec or "-",
               dtype, str(path)]
        procs[module] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), path)
    t0, notes = time.perf_counter(), []
    while procs:
        for module, (proc, path) in list(procs.items()):
            elapsed = time.perf_counter() - t0
            if proc.poll() is None:
                on_event(CompileEvent(module, "compiling", elapsed, ESTIMATE_S[module]))
                continue
            del procs[module]
            out, err = proc.communicate()
            if proc.returncode == 0 and path.is_file() and loads_here(path):
                on_event(CompileEvent(module, "done", elapsed, ESTIMATE_S[module]))
            else:
                last = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
                notes.append(f"compiling the {module} failed: {last}")
                on_event(CompileEvent(module, "failed", elapsed, ESTIMATE_S[module], last))
        time.sleep(0.5)
    return notes


def load_calls(models: Any, root: Path | None = None) -> tuple[CompiledCalls | None, list[str]]:
    """CompiledCalls from the cache, or None with the reason. Never raises: a missing, stale (other key),
    corrupt or foreign artifact means the plain graphs."""
    loaded = {}
    for module in (m for m in MODULES if m == "unet" or models.controlnet is not None):
        p = artifact_path(module, _module(models, module), root)
        if not p.is_file():
            if module == "unet":
                return None, ["no compiled kernels for this model, GPU and torch in the cache"]
            continue
        try:
            if not loads_here(p):
                raise RuntimeError("it does not load on this machine")
            loaded[module] = load(module, models, p)
        except Exception as e:  # noqa: BLE001 - any broken artifact: plain graphs, and say why
            if module == "unet":
                return None, [f"compiled kernels not used: {p.name}: {str(e).splitlines()[0][:200]}"]
    return CompiledCalls(models, loaded["unet"], loaded.get("controlnet")), []


# Measured on one H200 (docs/PERFORMANCE.md, "Compiled kernels"): cold compile seconds per module when
# the two build side by side, as `capture --warm` builds them (alone: 365 and 209 s), for the progress
# estimate and the advice below.
ESTIMATE_S = {"unet": 380.0, "controlnet": 270.0}


def advice() -> str:
    """What `--compile auto` says when the cache has no kernels: the compile's measured cost. (Their
    speed-up on a job is not measured yet, so it is not promised; docs/PERFORMANCE.md.)"""
    unet, controlnet = ESTIMATE_S["unet"] / 60, ESTIMATE_S["controlnet"] / 60
    return (f"compiled kernels are not in the cache: `bcg capture JOB --warm` compiles them once (on an H200 "
            f"{unet:.0f} minutes for the UNet, {controlnet:.1f} for a ControlNet, side by side) and later "
            f"renders load them")


def _main(argv: list[str]) -> None:
    """Child process of build_missing: MODULE MODEL CONTROLNET DTYPE PATH."""
    from storyboard_cli.engine.build import resolve_device
    from storyboard_cli.models.loader import load_sdxl

    module, model_spec, controlnet_spec, dtype, path = argv
    device, dt = resolve_device("cuda" if torch.cuda.is_available() else "cpu", dtype)
    models = load_sdxl(model_spec, None if controlnet_spec == "-" else controlnet_spec, device, dt)
    build(module, models, Path(path))


if __name__ == "__main__":
    _main(sys.argv[1:])
