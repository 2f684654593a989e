"""The choice of engine (auto / graph / eager) and of compiled kernels (compile auto / on / off)."""

from __future__ import annotations

from typing import Callable

from storyboard_cli.engine.base import Engine, Shape
from storyboard_cli.engine.device import DTYPES, device_name, dtype_flag, dtype_name, resolve_device  # noqa: F401
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.kernels.builds import Builds
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.variants import top
from storyboard_cli.errors import BadInput
from storyboard_cli.models.loader import SdxlModels

ENGINES = ("auto", "graph", "eager")
COMPILE = ("auto", "on", "off")


def check_engine(kind: str, compile: str, device, fp8: bool = False) -> None:
    """The engine options against each other and the device, before anything is loaded."""
    if fp8:
        if compile == "off" or kind == "eager":
            raise BadInput("--fp8 runs the compiled UNet's FP8 kernels (use --compile auto or on, and not "
                           "--engine eager)")
        if device.type != "cuda":
            raise BadInput("--fp8 needs a CUDA GPU with FP8 (compute capability 8.9 or later: Ada, Hopper)")
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
            raise BadInput(f"--fp8 needs FP8 tensor cores (compute capability 8.9 or later); "
                           f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")
    if kind not in ENGINES:
        raise BadInput(f"--engine: unknown engine {kind!r} (use auto, graph or eager)")
    if compile not in COMPILE:
        raise BadInput(f"--compile: unknown value {compile!r} (use auto, on or off)")
    if device.type != "cuda":
        if kind == "graph":
            raise BadInput("--engine graph needs a CUDA device (use --engine eager or auto)")
        if compile == "on":
            raise BadInput("--compile on needs a CUDA device (use --compile auto or off)")
    elif compile == "on" and kind == "eager":
        raise BadInput("--compile on runs compiled kernels inside the CUDA graphs (use --engine graph or auto)")


def compiled_kernels(models: SdxlModels, shapes: list[Shape], compile: str, notes: list[str],
                     on_event: Callable | None = None, fp8: bool = False) -> CompiledKernels | None:
    """The one place that chooses compiled kernels for the graphs (engine/kernels/):
    "off" never; "auto" loads what the cache has for these shapes and compiles the rest in the background
    while the plain graphs render; "on" compiles what is missing first, side by side, with progress events.
    `fp8`: the UNet's FP8 kernels (engine/kernels/fp8.py) instead of its fp16 ones."""
    if compile == "off" or models.device.type != "cuda":
        return None
    if fp8 and models.ip_adapter is not None:  # its calibration and Linears were measured without the adapter
        notes.append("--fp8: the FP8 kernels are not built with an IP-Adapter (ip_adapter:); fp16 compiled kernels")
        fp8 = False
    builds = Builds(models.device, on_event, retry_failed=compile == "on", notes=notes)
    kernels = CompiledKernels(models, builds, notes, variant=top(asked=fp8))
    if compile == "on" and kernels.want(kernels.targets(shapes)):
        kernels.wait()
    return kernels


def graph_runner(models: SdxlModels, shapes: list[Shape], compile: str = "auto", notes: list[str] | None = None,
                 on_event: Callable | None = None, fp8: bool = False) -> GraphRunner:
    """A GraphRunner with static buffers that fit every shape (nothing captured yet)."""
    kernels = compiled_kernels(models, shapes, compile, [] if notes is None else notes, on_event, fp8)
    runner = GraphRunner(models, compiled=kernels)
    runner.ensure_capacity(shapes)
    return runner


def build_engine(models: SdxlModels, kind: str, shapes: list[Shape], notes: list[str],
                 compile: str = "auto", on_event: Callable | None = None, fp8: bool = False) -> Engine:
    """The engine for `kind` on the models' device. Nothing is captured here: `Engine.prepare` does it."""
    check_engine(kind, compile, models.device, fp8)
    if models.device.type != "cuda":
        if kind == "auto":
            notes.append("engine auto: CPU device, so the eager engine (CUDA graphs need a GPU)")
        return EagerEngine(models)
    if kind == "eager":
        return EagerEngine(models)
    return graph_runner(models, shapes, compile, notes, on_event, fp8)
