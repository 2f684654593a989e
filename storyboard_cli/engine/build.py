"""Device and dtype resolution, and the choice of engine (auto / graph / eager, compile auto / on / off)."""

from __future__ import annotations

from typing import Callable

import torch

from storyboard_cli.engine.base import Engine, Shape
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.errors import BadInput
from storyboard_cli.models.loader import SdxlModels

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ENGINES = ("auto", "graph", "eager")
COMPILE = ("auto", "on", "off")


def resolve_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """`--device` / `--dtype` -> torch's; None: cuda when available, fp16 there and fp32 on the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"--device: unknown device {device!r} (use cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is available here (use --device cpu)")
    if dtype is None:
        dtype = "fp32" if device == "cpu" else "fp16"
    if dtype not in DTYPES:
        raise BadInput(f"--dtype: unknown dtype {dtype!r} (use fp16, bf16 or fp32)")
    if device == "cpu" and dtype == "fp16":
        raise BadInput("--dtype fp16 is not supported on the CPU (use fp32 or bf16)")
    return torch.device(device), DTYPES[dtype]


def device_name(device: torch.device) -> str:
    """The device as reports and bench records name it: `cpu`, or `cuda (<GPU model>)`."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_flag(dtype: torch.dtype) -> str:
    """The dtype as `--dtype` spells it (fp16, bf16, fp32): the inverse of DTYPES."""
    return next(flag for flag, dt in DTYPES.items() if dt == dtype)


def check_engine(kind: str, compile: str, device: torch.device) -> None:
    """The engine options against each other and the device, before anything is loaded."""
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


def compiled_calls(models: SdxlModels, compile: str, notes: list[str], on_event: Callable | None = None):
    """The one place that chooses compiled kernels for the graphs (engine/compiled.py): "off" never;
    "auto" when the cache has them for this model, GPU and torch (else a note on what `bcg capture
    --warm` would buy); "on" builds what is missing first (minutes, with progress events)."""
    if compile == "off" or models.device.type != "cuda":
        return None
    from storyboard_cli.engine import compiled

    if compile == "on":  # builds only what the cache lacks
        notes.extend(compiled.build_missing(models, models.name, models.controlnet_name, on_event))
    calls, why = compiled.load_calls(models)
    if calls is None:
        notes.extend(why if compile == "on" else [compiled.advice()])
    return calls


def graph_runner(models: SdxlModels, shapes: list[Shape], compile: str = "auto", notes: list[str] | None = None,
                 on_event: Callable | None = None):
    """A GraphRunner with static buffers that fit every shape (nothing captured yet)."""
    from storyboard_cli.engine.graphs import GraphRunner

    runner = GraphRunner(models, compiled=compiled_calls(models, compile, [] if notes is None else notes, on_event))
    runner.ensure_capacity(shapes)
    return runner


def build_engine(models: SdxlModels, kind: str, shapes: list[Shape], notes: list[str],
                 compile: str = "auto", on_event: Callable | None = None) -> Engine:
    """The engine for `kind` on the models' device. Nothing is captured here: `Engine.prepare` does it."""
    check_engine(kind, compile, models.device)
    if models.device.type != "cuda":
        if kind == "auto":
            notes.append("engine auto: CPU device, so the eager engine (CUDA graphs need a GPU)")
        return EagerEngine(models)
    if kind == "eager":
        return EagerEngine(models)
    return graph_runner(models, shapes, compile, notes, on_event)
