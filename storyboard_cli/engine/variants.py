"""The kernel variants a graph captures, one row each, best first: `fp8` -> `compiled` -> `plain`, then the eager
engine. A shape runs the best variant its loaded kernels offer; one that fails its capture or first-replay check
falls back along the rows (`GraphRunner`, engine/graph/runner.py), and a plain graph that fails runs eager.

A row says what a variant is: its name (ShapeKey.variant, and a fallen-back graph's state), the precision of its
UNet artifacts (None: the loaded modules themselves), the recipe its builds add to the module the export sees and
the inductor options they add (engine/kernels/artifacts.py, export.py), how its constants are prepared beyond the
module's own tensors (engine/kernels/calls.py binds them), its first-replay check's limit, and what it falls back
to. Adding a variant (an FP8 ControlNet, a compiled VAE) is one row here plus its recipe module, as `fp8` is one
row plus engine/kernels/fp8.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from storyboard_cli.engine.kernels import fp8

FP8, COMPILED, PLAIN = "fp8", "compiled", "plain"
EAGER = "eager"  # no graph: the eager engine, where a plain graph falls back to


@dataclass(frozen=True)
class Variant:
    name: str
    fallback: str  # the variant a shape runs when this one fails its capture or check
    # relative L2 error a first replay may have against the eager step, in the next latents and in the prediction
    check_rtol: float
    precision: str | None = None  # of its UNet artifacts; None: no compiled kernels (the modules are captured)
    recipe: tuple[str, ...] = ()  # what its builds do to the module on top of the compiled recipe (the artifact key)
    options: dict[str, Any] = field(default_factory=dict)  # inductor options its builds add
    rewrite: Callable[[Any], object] | None = None  # the fused module changed before the export
    # made once per run (models, cache folder), before any LoRA: `.note` (a line for the render's notes) and
    # `.tensors(models, module)`, the artifact's constants beyond the module's own tensors
    constants: Callable[[Any, Any], Any] | None = None
    asked: bool = False  # used only where the user asks for it: it changes the pictures more than rounding does

    @property
    def compiled(self) -> bool:
        return self.precision is not None


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    # FP8 kernels: the quantisation's error, 3.4e-2 to 3.5e-2 in the noise prediction against the fp16 eager UNet on
    # sdxl-random at t = 999 / 500 / 50 (H200; the same without the compiler); broken kernels measured 1.2e-1 and
    # more (docs/PERFORMANCE.md): the limit sits between
    Variant(FP8, COMPILED, 8e-2, "fp8", ("fp8-linears",), fp8.OPTIONS, fp8.swap_in, fp8.InputScales, asked=True),
    # compiled kernels round once where eager rounds after every op: 1.6e-3 in the SDXL UNet's fp16 noise prediction
    # on an H200 (benchmarks/probes/fp8_scout.py); an artifact that read its timestep as fp16 bits was 1.2e-1 to
    # 1.6e-1 off
    Variant(COMPILED, PLAIN, 2e-2, "fp16"),
    Variant(PLAIN, EAGER, 2e-2),  # the eager kernels captured (0 measured)
)}
PRECISIONS: dict[str, Variant] = {v.precision: v for v in VARIANTS.values() if v.compiled}


def top(asked: bool = False) -> str:
    """The best compiled variant a run uses: the first row, or the first one not only used when asked (--fp8)."""
    return next(v.name for v in VARIANTS.values() if v.compiled and (asked or not v.asked))


def chain(name: str) -> list[Variant]:
    """`name`'s row and the rows it falls back to, in order, up to the plain graphs."""
    rows = [VARIANTS[name]]
    while rows[-1].fallback != EAGER:
        rows.append(VARIANTS[rows[-1].fallback])
    return rows
