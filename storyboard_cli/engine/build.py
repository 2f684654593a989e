"""The choice of engine (auto / graph / eager), of the kernels' row (engine/variants.py: --kernels auto / compiled /
fp8 / plain) and of when compiled kernels are built (compile auto / on / off)."""

from __future__ import annotations

from typing import Callable

from storyboard_cli.engine.base import Engine, Shape
from storyboard_cli.engine.device import DTYPES, device_name, dtype_flag, dtype_name, resolve_device  # noqa: F401
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.ledger import CheckLedger
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.kernels.builds import Builds
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.variants import AUTO, VARIANTS, choose, fit
from storyboard_cli.errors import BadInput
from storyboard_cli.models.loader import SdxlModels

ENGINES = ("auto", "graph", "eager")
COMPILE = ("auto", "on", "off")


def check_engine(kind: str, compile: str, device, kernels: str = AUTO) -> str:
    """The engine options against each other and the device, before anything is loaded; returns the name of the
    kernels' row they run (`kernels`: `--kernels`, engine/variants.py `choose`)."""
    if kind not in ENGINES:
        raise BadInput(f"--engine: unknown engine {kind!r} (use auto, graph or eager)")
    if compile not in COMPILE:
        raise BadInput(f"--compile: unknown value {compile!r} (use auto, on or off)")
    row = choose(kernels, kind, compile, device)
    if device.type != "cuda":
        if kind == "graph":
            raise BadInput("--engine graph needs a CUDA device (use --engine eager or auto)")
        if compile == "on":
            raise BadInput("--compile on needs a CUDA device (use --compile auto or off)")
    elif compile == "on" and kind == "eager":
        raise BadInput("--compile on runs compiled kernels inside the CUDA graphs (use --engine graph or auto)")
    return row


def compiled_kernels(models: SdxlModels, shapes: list[Shape], compile: str, notes: list[str],
                     on_event: Callable | None = None, kernels: str = AUTO,
                     defer: bool = True) -> CompiledKernels | None:
    """The one place that chooses compiled kernels for the graphs (engine/kernels/): `kernels`' row (`auto`: the
    best the device allows, engine/variants.py `choose`), or the row it falls back to where its kernels are not built
    for a part of the models (`fit`, with a note); none for a row without compiled kernels (`plain`, or `auto` with
    "off" or on the CPU). "auto" loads what the cache has for these shapes and compiles the rest in the background
    while the plain graphs render; "on" compiles what is missing first, side by side, with progress events. `defer`:
    the cache's best artifacts are loaded before their graphs' first captures (GraphRunner binds them); False for a
    caller that calls the kernels outside a GraphRunner, which needs them loaded here."""
    row = VARIANTS[fit(choose(kernels, "graph", compile, models.device), models, notes)]
    if not row.compiled:
        return None
    builds = Builds(models.device, on_event, retry_failed=compile == "on", notes=notes)
    compiled = CompiledKernels(models, builds, notes, variant=row.name)
    if compile == "on" and compiled.want(compiled.targets(shapes), defer=defer):
        compiled.wait()
    if compiled.load_s or compiled.deferred():
        notes.append(compiled.load_note())
    return compiled


def graph_runner(models: SdxlModels, shapes: list[Shape], compile: str = "auto", notes: list[str] | None = None,
                 on_event: Callable | None = None, kernels: str = AUTO) -> GraphRunner:
    """A GraphRunner with static buffers that fit every shape (nothing captured yet)."""
    compiled = compiled_kernels(models, shapes, compile, [] if notes is None else notes, on_event, kernels)
    runner = GraphRunner(models, compiled=compiled, ledger=None if compiled is None else CheckLedger(models, compiled))
    runner.ensure_capacity(shapes)
    return runner


def build_engine(models: SdxlModels, kind: str, shapes: list[Shape], notes: list[str],
                 compile: str = "auto", on_event: Callable | None = None, kernels: str = AUTO) -> Engine:
    """The engine for `kind` on the models' device, its graphs on `kernels`' row (a name of engine/variants.py, or
    `auto`). Nothing is captured here: `Engine.prepare` does it."""
    kernels = check_engine(kind, compile, models.device, kernels)
    if models.device.type != "cuda":
        if kind == "auto":
            notes.append("engine auto: CPU device, so the eager engine (CUDA graphs need a GPU)")
        return EagerEngine(models)
    if kind == "eager":
        return EagerEngine(models)
    return graph_runner(models, shapes, compile, notes, on_event, kernels)
