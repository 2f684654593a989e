"""Compiled denoiser kernels: the step's UNet and ControlNet calls, exported once per image size with
the rows (2 x images, CFG) dynamic, compiled ahead of time by AOTInductor, kept under $BCG_CACHE and
loaded in well under a second. They run inside GraphRunner's graphs (ShapeKey.variant "compiled").

- One artifact per (module, image size), rows 2..16. An artifact with the image size dynamic too was
  measured 3-8% faster than the plain graphs and took 50 s to load; with the size static the same
  compiler gave 1.19-1.31x and loads at once (docs/PERFORMANCE.md, "Compiled kernels per size"). A
  job uses a handful of sizes, so it costs a handful of compiles, built in the background while the
  render runs on the plain graphs (engine/builds.py), and the next job with those sizes none.
- What the export sees (the recipe): the attention projections fused as diffusers'
  `fuse_qkv_projections` (one GEMM for q, k and v), every convolution weight channels_last (NHWC
  convolutions, no layout flips), 1x1 convolutions as matmuls. The rendering process keeps its own
  attention processors and NCHW weights, so the plain graphs and the eager step are untouched: to_q,
  to_k and to_v become views into the fused weight, and the convolutions' channels_last weights are
  copies that every in-place weight write refreshes (SdxlModels.written). A LoRA swap reaches the
  compiled kernels as it reaches the plain ones, and no pointer a graph holds changes.
- Weights stay outside the artifact (`package_constants_in_so=False`) and are bound to those tensors
  (`load_constants(user_managed=True)`): no second copy of the weights beyond the conv copies.
- The UNet is exported WITH ControlNet residual inputs; a shape without ControlNet feeds it zeros, so
  one UNet artifact per size serves both.
- An artifact's key covers everything that changes the generated code: module class and config,
  parameter names/shapes/dtypes (not values), the size, torch/triton/CUDA versions, GPU name and
  capability, the row range and the compile options. A stale key is never looked up; a corrupt file
  fails to load and that size keeps its plain graph.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.eager import StepCalls, controlnet_call, unet_call
from storyboard_cli.errors import one_line
from storyboard_cli.models.tiny import cache_root

log = logging.getLogger(__name__)
FORMAT = 6  # bump when the export wrappers, the recipe or the options below change what is compiled (5: the
# timestep input is float32; format 4 built it in the model's dtype and read the step's float32 timestep as fp16
# bits. 6: the export runs at the float32 default dtype, as the rendering process does)
MODULES = ("unet", "controlnet")
MIN_ROWS = 2  # rows = 2 x images (CFG) or, for the conditional rows alone, the images
MAX_ROWS = 16  # 2 x the largest bucket (8 images, CFG doubled)
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
RECIPE = ("fused-qkv", "channels-last-weights")  # part of the key: what build() does to the module


@dataclass(frozen=True, order=True)
class Target:
    """One artifact: a module compiled for one image size (pixels), rows dynamic."""

    module: str  # "unet" | "controlnet"
    height: int
    width: int
    precision: str = "fp16"  # "fp8": the UNet's transformer Linears in FP8 (engine/fp8.py)

    @property
    def label(self) -> str:
        return f"{self.module} {self.width}x{self.height}" + ("" if self.precision == "fp16" else f" {self.precision}")

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"


def fits(batch: int, height: int, width: int) -> str | None:
    """None if compiled kernels can exist for this shape, else why not."""
    lo, hi = SIDES
    if 2 * batch > MAX_ROWS:
        return f"{batch} images exceed the compiled range (at most {MAX_ROWS // 2})"
    if height % 64 or width % 64 or not (lo <= height <= hi and lo <= width <= hi):
        return f"{width}x{height} is outside the compiled sizes (multiples of 64, {lo}-{hi})"
    return None


def targets(shapes: Iterable[Shape], controlnet: bool, fp8: bool = False) -> list[Target]:
    """The artifacts these shapes use: a UNet per size (`fp8`: its FP8 kernels), a ControlNet per size used with a
    control image. Largest sizes first, UNets before ControlNets (a UNet serves every shape of its size)."""
    need = set()
    for s in shapes:
        if fits(s.batch, s.height, s.width) is None:
            need.add(Target("unet", s.height, s.width, "fp8" if fp8 else "fp16"))
            if s.control and controlnet:
                need.add(Target("controlnet", s.height, s.width))
    return sorted(need, key=lambda t: (t.module != "unet", -t.height * t.width, t.height))


# ------------------------------------------------------------------ what the export sees


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


def text_dims(model: torch.nn.Module) -> tuple[int, int]:
    """(token embedding width, pooled embedding width) from a UNet's or ControlNet's own config (SDXL's
    text_time embedding: the pooled text plus 6 time ids of addition_time_embed_dim each)."""
    cfg = model.config
    return cfg.cross_attention_dim, cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim


def example_inputs(module: str, model: torch.nn.Module, rows: int, h: int, w: int) -> tuple:
    """Inputs of the exported call for `model` at latent size h x w (values do not matter)."""
    dtype, device = model.dtype, model.device
    text_dim, pooled_dim = text_dims(model)
    latents = torch.randn(rows, 4, h, w, dtype=dtype, device=device)
    # float32 whatever the default dtype (a build child sets the model's): the step passes its float32 timestep,
    # and an artifact reads its inputs as the dtypes it was exported with, unchecked
    t = torch.tensor(500.0, dtype=torch.float32, device=device)
    embeds = torch.randn(rows, 77, text_dim, dtype=dtype, device=device)
    pooled = torch.randn(rows, pooled_dim, dtype=dtype, device=device)
    time_ids = torch.tensor([8 * h, 8 * w, 0, 0, 8 * h, 8 * w], dtype=dtype, device=device).expand(rows, 6).clone()
    if module == "controlnet":
        image = torch.rand(rows, 3, 8 * h, 8 * w, dtype=dtype, device=device)
        return latents, t, embeds, pooled, time_ids, image, torch.ones(rows, 1, 1, 1, dtype=dtype, device=device)
    mid, down = Residuals.of(model).zeros(rows, h, w, dtype, device)
    # channels_last, as the compiled ControlNet (channels_last convolutions) hands them over
    mid, down = _nhwc(mid), tuple(_nhwc(d) for d in down)
    return latents, t, embeds, pooled, time_ids, mid, down


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def dynamic_shapes(args: tuple) -> tuple:
    """torch.export Dims: the rows of every batched input dynamic (2..MAX_ROWS), everything else static."""
    from torch.export import Dim

    rows = Dim("rows", min=MIN_ROWS, max=MAX_ROWS)

    def spec(a):
        return tuple(spec(x) for x in a) if isinstance(a, tuple) else (None if a.dim() == 0 else {0: rows})
    return tuple(spec(a) for a in args)


def fuse_projections(model: torch.nn.Module, processor: bool = False) -> None:
    """Attention projections fused as diffusers' fuse_qkv_projections (q, k, v of self-attention; k, v of
    cross-attention), with to_q/to_k/to_v left as views into the fused weight: one storage, so a write
    to either (a LoRA swap) is seen by both. `processor`: also switch to diffusers' fused processor (the
    export does; the rendering process keeps its processors, and with them the plain step's numbers)."""
    from diffusers.models.attention_processor import Attention, FusedAttnProcessor2_0

    with torch.no_grad():
        for attn in model.modules():
            if not isinstance(attn, Attention) or getattr(attn, "bcg_fused", False):
                continue
            attn.fuse_projections()
            fused, parts = ((attn.to_kv, (attn.to_k, attn.to_v)) if attn.is_cross_attention
                            else (attn.to_qkv, (attn.to_q, attn.to_k, attn.to_v)))
            fused.requires_grad_(False)
            start = 0
            for part in parts:
                n = part.weight.shape[0]
                part.weight.data = fused.weight.data[start:start + n]  # a row slice: contiguous
                if part.bias is not None:
                    part.bias.data = fused.bias.data[start:start + n]
                start += n
            attn.bcg_fused = True
    if processor:
        model.set_attn_processor(FusedAttnProcessor2_0())


def channels_last_weights(models: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> a channels_last copy of each 4-d weight of `model` (what the artifact's convolutions read),
    made once and registered with `models`, whose `written` refreshes a copy after an in-place write."""
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 4:
            out[name] = models.copy_of(p, lambda t: t.contiguous(memory_format=torch.channels_last))
    return out


# ------------------------------------------------------------------ key, path, build, load


def options(target: Target) -> dict:
    """The inductor options of `target`'s build."""
    from storyboard_cli.engine import fp8

    return {**INDUCTOR_OPTIONS, **fp8.OPTIONS} if target.fp8 else dict(INDUCTOR_OPTIONS)


def artifact_key(target: Target, model: torch.nn.Module) -> str:
    """Everything that changes the generated code (not the weight values, which are passed in)."""
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        import triton

        where = {"triton": triton.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(dev),
                 "capability": torch.cuda.get_device_capability(dev)}
    else:
        where = {"cpu": platform.machine(), "compiler": platform.python_compiler()}
    facts = {
        "format": FORMAT, "target": [target.module, target.height, target.width], "class": type(model).__name__,
        "config": {k: v for k, v in dict(model.config).items() if not k.startswith("_")},
        "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.state_dict().items()
                   if not n.endswith(("to_qkv.weight", "to_kv.weight"))],  # made by fuse_projections
        "torch": torch.__version__, "rows": MAX_ROWS, "options": options(target), "recipe": RECIPE, **where,
    }
    if target.fp8:  # (an fp16 key stays what it was before FP8 existed: the caches keep their artifacts)
        facts["recipe"] = RECIPE + ("fp8-linears",)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def artifact_path(target: Target, model: torch.nn.Module, root: Path | None = None) -> Path:
    kind = target.module + ("-fp8" if target.fp8 else "")
    name = f"{kind}-{target.width}x{target.height}-{artifact_key(target, model)}.pt2"
    return (root or cache_root() / "compiled") / name


def build(target: Target, model: torch.nn.Module, path: Path) -> dict:
    """Exports and compiles `model` (a UNet or ControlNet: its values do not matter) for `target` to
    `path`, then loads it once in this process; returns seconds per stage. Minutes of work: a child
    process does it (engine/builds.py), never a render."""
    from torch._inductor import aoti_compile_and_package

    fuse_projections(model, processor=True)
    model.to(memory_format=torch.channels_last)
    if target.fp8:
        from storyboard_cli.engine import fp8

        fp8.swap_in(model)
    wrapper = UNetCall(model) if target.module == "unet" else ControlNetCall(model)
    args = example_inputs(target.module, model, 2, target.height // 8, target.width // 8)
    t0 = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes(args), strict=False)
    t1 = time.perf_counter()
    # the archive's root folder is named after the file: build under the final name in a private
    # folder, load it there, then move it into place (atomic: a killed or crashing build leaves nothing)
    tmp = path.parent / f".build-{os.getpid()}" / path.name
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
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
            "mb": round(path.stat().st_size / 2**20, 1)}


def open_package(path: Path) -> Any:
    """The compiled call in an artifact, as `aoti_load_package` gives it, without that function's device
    survey: before the loader it compares the machine with the one that built the package, only to warn,
    and finding the CPU's vector ISA compiles and runs test programs: 35-50 s in a fresh process on the
    H200 (bench/load_probe.py), where the load itself takes 0.02 s. The artifact key already names the
    GPU, CUDA, triton and torch that built it."""
    from torch._inductor.package import AOTICompiledModel

    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is None:  # a torch without the loader class here: the public function
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path), run_single_threaded=True)
    # single-threaded: no thread synchronisation around each run, which would conflict with our CUDA
    # graph capture (torch's own advice for CUDA graphs; huggingface/flux-fast loads its packages so)
    return AOTICompiledModel(loader(str(path), "model", True, 1, -1))


def module_of(models: Any, module: str) -> torch.nn.Module:
    return models.unet if module == "unet" else models.controlnet


def load(target: Target, models: Any, path: Path, x_scales: dict[str, torch.Tensor] | None = None) -> Callable:
    """The compiled call, its constants bound to the rendering modules' own tensors (the fused attention
    weights, the channels_last convolution copies, every other parameter as it is; an FP8 artifact: the FP8
    weights and scales derived from them, and `x_scales`, its calibrated input scales)."""
    model, prefix = module_of(models, target.module), f"{target.module}."
    compiled = open_package(path)
    tensors = {prefix + n: t for n, t in model.state_dict(keep_vars=True).items()}
    tensors.update({prefix + n: t for n, t in channels_last_weights(models, model).items()})
    if target.fp8:
        from storyboard_cli.engine import fp8

        tensors.update({prefix + n: t for n, t in {**fp8.weights(models, model), **(x_scales or {})}.items()})
    wanted = compiled.get_constant_fqns()
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise RuntimeError(f"artifact wants {len(missing)} constants the model lacks, e.g. {missing[0]}")
    constants = {n: tensors[n].detach() for n in wanted}  # the same storages, without autograd state
    compiled.load_constants(constants, check_full_update=True, user_managed=True)
    compiled.bcg_constants = constants  # user-managed: the loader keeps pointers, we keep the tensors alive
    return compiled


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
    code = "import sys; from pathlib import Path; from storyboard_cli.engine.compiled import open_package; " \
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


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """The exported calls take the timestep as a scalar; the step passes a row of its coefficient table
    expanded to [2B]. Cloned: a view into the table is not 16-byte aligned, which compiled kernels assume."""
    return t.reshape(-1)[0].clone()


class CompiledKernels(StepCalls):
    """The step's module calls on compiled kernels, one artifact per module and size (see StepCalls).

    Holds the artifacts loaded so far; `builds` (engine/builds.py) makes the missing ones in the
    background, and `poll` (between batches) loads what they finished, so a size switches to its
    compiled graph as soon as its kernels are ready. A shape without ControlNet feeds the UNet's residual
    inputs from one zero buffer (read-only views: the compiled code never writes its inputs)."""

    def __init__(self, models: Any, builds: Any = None, notes: list[str] | None = None, root: Path | None = None,
                 fp8: bool = False):
        """`fp8`: the UNet's artifacts are the FP8 ones (engine/fp8.py), whose input scales are calibrated here
        (once per model: then read from the cache), so the UNet must carry no LoRA now."""
        self.models, self.builds, self.root, self.fp8 = models, builds, root, fp8
        self.notes = notes if notes is not None else []
        self.residuals = Residuals.of(models.unet)
        self.calls: dict[Target, Callable] = {}
        self.built_s: dict[Target, float] = {}  # seconds a build of this run took, per target
        self.load_s: dict[Target, float] = {}  # seconds each load and constant binding took
        self.waiting: list[Target] = []  # missing, handed to the builds at `start`
        super().__init__(self._unet, self._controlnet)
        self.zeros = torch.zeros(0, dtype=models.dtype, device=models.device)
        for module in MODULES:
            if module_of(models, module) is not None:
                fuse_projections(module_of(models, module))  # before any graph holds a pointer to to_q & co
        self.x_scales: dict[str, torch.Tensor] = {}
        self.scales_file: Path | None = None
        if fp8:
            from storyboard_cli.engine import fp8 as F

            t0 = time.perf_counter()
            amax, self.scales_file, calibrated = F.scales(models, root or cache_root() / "compiled")
            self.x_scales = F.input_scales(amax, models.unet, models.device)
            how = f"calibrated now in {time.perf_counter() - t0:.1f} s" if calibrated else "stored"
            self.notes.append(f"UNet kernels in FP8 (--fp8): input scales {how}, {self.scales_file}")

    def targets(self, shapes: Iterable[Shape]) -> list[Target]:
        """What these shapes are built for: the UNet in this run's precision, the ControlNets."""
        return targets(shapes, self.models.controlnet is not None, self.fp8)

    def unet_target(self, height: int, width: int, variant: str | None = None) -> Target:
        """The UNet artifact of a variant ("compiled": fp16, "fp8"; None: this run's precision)."""
        fp8 = self.fp8 if variant is None else variant == "fp8"
        return Target("unet", height, width, "fp8" if fp8 else "fp16")

    def variants(self, batch: int, height: int, width: int, control: bool) -> list[str]:
        """The ShapeKey variants this shape can run on now, best first: with --fp8 its FP8 kernels, then the fp16 ones
        when the cache had them (while the FP8 ones build, or after they failed their check)."""
        if fits(batch, height, width) is not None or (control and Target("controlnet", height, width) not in self.calls):
            return []
        return self._loaded(height, width)

    def _loaded(self, height: int, width: int) -> list[str]:
        """The variants whose UNet kernels for this size are loaded, best first."""
        return [v for v in (("fp8", "compiled") if self.fp8 else ("compiled",))
                if self.unet_target(height, width, v) in self.calls]

    def calls_for(self, variant: str) -> StepCalls:
        """The step's module calls on one variant's kernels (what a graph of that variant captures)."""
        return StepCalls(partial(self._unet, variant=variant), self._controlnet)

    def path(self, target: Target) -> Path:
        return artifact_path(target, module_of(self.models, target.module), self.root)

    def add(self, target: Target, path: Path) -> bool:
        """Loads one artifact; False (and a note) if it cannot be used, and that size keeps its plain graph."""
        try:
            if not loads_here(path):
                raise RuntimeError("it does not load on this machine")
            t0 = time.perf_counter()
            self.calls[target] = load(target, self.models, path, self.x_scales)
            self.load_s[target] = time.perf_counter() - t0
            return True
        except Exception as e:  # noqa: BLE001 - any broken artifact: plain graphs, and say why
            self.notes.append(f"compiled kernels for {target.label} not used: {path.name}: {one_line(e, 200)}")
            return False

    def want(self, targets: Iterable[Target]) -> list[Target]:
        """Loads what the cache has for `targets`; returns the ones it lacks (also kept for `start`). With --fp8, the
        fp16 UNets of the same sizes are loaded too where the cache has them (never built): a size runs on them until
        its FP8 kernels land."""
        targets = list(targets)
        if self.fp8:
            for t in targets:
                fp16 = self.unet_target(t.height, t.width, "compiled")
                path = self.path(fp16) if t.fp8 else None
                if path is not None and fp16 not in self.calls and path.is_file():
                    self.add(fp16, path)
        for t in targets:
            if t in self.calls or t in self.waiting:
                continue
            path = self.path(t)
            if path.is_file() and self.add(t, path):
                continue
            for f in (path, path.with_suffix(".ok"), path.with_suffix(".bad")):
                f.unlink(missing_ok=True)  # a broken artifact is rebuilt, not tried again (a loaded copy stays mapped)
            self.waiting.append(t)
        return list(self.waiting)

    def start(self, background: bool = True) -> None:
        """Hands what is missing to the builds (never waits: `wait` does)."""
        todo = [t for t in self.waiting if self.builds is not None and t not in self.builds.builds]
        if todo:
            self.builds.want([(t, self.path(t), module_of(self.models, t.module)) for t in todo])
            if background:
                self.notes.append(f"compiling kernels for {', '.join(t.label for t in todo)} in the background; "
                                  f"their shapes switch to them as they finish (a build still running at the "
                                  f"end goes on, for the next render)")

    def poll(self) -> None:
        """Loads the artifacts the builds finished since the last call (a few ms when none did)."""
        if self.builds is not None:
            self._take(self.builds.poll())

    def wait(self) -> None:
        """Starts what is missing and loads it when built, side by side (`--compile on`, `capture --warm`)."""
        self.start(background=False)
        if self.builds is not None:
            self._take(self.builds.wait())

    def _take(self, ready: list[tuple[Target, Path, float]]) -> None:
        for t, path, seconds in ready:
            if t in self.waiting and self.add(t, path):
                self.waiting.remove(t)
                self.built_s[t] = seconds
                self.notes.append(f"compiled kernels for {t.label} ready after {seconds:.0f} s")

    def reserve(self, max_batch: int, max_pixels: int) -> None:
        """The zero residuals for the largest shape, allocated before any capture (graphs keep the pointer)."""
        rows, latent = 2 * max_batch, max_pixels // 64
        need = rows * max(c * latent // (d * d) for c, d in (*self.residuals.down, self.residuals.mid))
        if self.zeros.numel() < need:
            self.zeros = torch.zeros(need, dtype=self.models.dtype, device=self.models.device)

    def ready(self, batch: int, height: int, width: int, control: bool) -> str | None:
        """None if this shape can run on this run's kernels now (FP8 with --fp8), else why not."""
        why = fits(batch, height, width)
        if why:
            return why
        need = [self.unet_target(height, width)] + ([Target("controlnet", height, width)] if control else [])
        lacking = [t.label for t in need if t not in self.calls]
        return f"no compiled kernels for {', '.join(lacking)} yet" if lacking else None

    def compile_s(self, height: int, width: int) -> float:
        return self.built_s.get(self.unet_target(height, width), 0.0)

    def _zero_residuals(self, rows: int, h: int, w: int):
        def view(c: int, d: int) -> torch.Tensor:  # channels_last views, as the artifact reads them
            return self.zeros[: rows * c * (h // d) * (w // d)].view(rows, h // d, w // d, c).permute(0, 3, 1, 2)
        return view(*self.residuals.mid), tuple(view(c, d) for c, d in self.residuals.down)

    def _unet(self, latents, t, embeds, pooled, time_ids, mid, down, variant: str | None = None):
        """`variant`: which UNet kernels ("compiled", "fp8"); None: the best loaded for the size."""
        rows, _, h, w = latents.shape
        if mid is None:
            mid, down = self._zero_residuals(rows, h, w)
        # the artifact reads its inputs with the strides it was compiled for: the compiled ControlNet's
        # residuals are channels_last already (no copy); any other layout is made so
        mid, down = _nhwc(mid), tuple(_nhwc(d) for d in down)
        call = self.calls[self.unet_target(8 * h, 8 * w, variant or self._loaded(8 * h, 8 * w)[0])]
        return call(latents, _scalar(t), embeds, pooled, time_ids, mid, down)

    def _controlnet(self, latents, t, embeds, pooled, time_ids, image, scale):
        call = self.calls[Target("controlnet", 8 * latents.shape[2], 8 * latents.shape[3])]
        return call(latents, _scalar(t), embeds, pooled, time_ids, image, scale)
