"""The kernel variants a graph captures, one row each, best first: `fp8` -> `compiled` -> `plain`, then the eager
engine. A shape runs the best variant its loaded kernels offer; one that fails its capture or first-replay check
falls back along the rows (`GraphRunner`, engine/graph/runner.py), and a plain graph that fails runs eager.

A row says what a variant is: its name (ShapeKey.variant, and a fallen-back graph's state), the precision of its
UNet and ControlNet artifacts (None: the loaded modules themselves), the recipe its builds add to the module the export sees and
the inductor options they add (engine/kernels/artifacts.py, export.py), how its constants are prepared beyond the
module's own tensors (engine/kernels/calls.py binds them), its first-replay check's limit, and what it falls back
to. Adding a variant (a compiled VAE) is one row here plus its recipe module, as `fp8` is one row plus
engine/kernels/fp8.py.

A run names its row (`--kernels NAME`, `--fp8` for `--kernels fp8`; `auto`: the best row the options and the device
allow, never one only used when asked). A row also says what it needs and what it cannot be combined with: the CUDA
compute capability its kernels run on (asked of the driver once per process, engine/device.py `capability`), the
options it refuses (checked before anything loads: `choose`), and the parts of the loaded models its kernels are not
built with (the run takes the row it falls back to, with a note: `fit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from storyboard_cli.engine.device import capability
from storyboard_cli.engine.kernels import fp8
from storyboard_cli.errors import BadInput, did_you_mean

FP8, COMPILED, PLAIN = "fp8", "compiled", "plain"
EAGER = "eager"  # no graph: the eager engine, where a plain graph falls back to
AUTO = "auto"  # --kernels auto: the best row the run's options and device allow, of those not only used when asked
# what a row may refuse, as the command line spells it, and what to give instead
INSTEAD = {"--engine eager": "--engine auto or graph", "--compile off": "--compile auto or on"}
# the parts of the loaded models a row's kernels may be built without (SdxlModels' attributes, None when not loaded)
PARTS = {"ip_adapter": "an IP-Adapter (ip_adapter:)", "region_layout": "regional prompts (regions:)"}


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
    # the least CUDA compute capability its kernels run on, and what that is, in words (None: any device, no kernels
    # of its own)
    capability: tuple[int, int] | None = None
    hardware: str = ""
    refuses: tuple[str, ...] = ()  # options it cannot run with (INSTEAD's keys): refused before anything loads
    without: tuple[str, ...] = ()  # model parts its kernels are not built with (PARTS' keys): its fallback runs
    # the limit of a graph's check on its batch's first step against the batch's first image stepped alone
    # (graph/check.py first_step_of_part), where its kernels at 1 row and at the batch's round apart by far less;
    # None: its check steps the whole batch (the same kernels at the same rows)
    alone_rtol: float | None = None

    @property
    def compiled(self) -> bool:
        return self.precision is not None


# compiled kernels run inside the CUDA graphs, which --engine eager never captures, and --compile off never loads
COMPILED_ONLY = ("--engine eager", "--compile off")
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    # FP8 kernels: the quantisation's error, 3.4e-2 to 3.5e-2 in the noise prediction against the fp16 eager UNet on
    # sdxl-random at t = 999 / 500 / 50 (H200; the same without the compiler); broken kernels measured 1.2e-1 and
    # more (docs/PERFORMANCE.md): the limit sits between. The first ControlNet's artifacts are FP8 too (1.12x the fp16
    # net's at 2 x 1024², 1.20x at 8 on the H200, benchmarks/results/step/): a shape with a control image runs this row
    # once both of its size are loaded. Not built with an IP-Adapter: its calibration and its Linears were measured
    # without the adapter's attention. Its first-step check steps the whole batch (bitwise the graph's): the first
    # image alone came 5.0e-2 to 5.2e-2 off the replay's at guided bench shapes on the H200 (its FP8 GEMMs at other
    # rows round apart, and the next quantisation turns that into whole FP8 steps), too near the limit. It grows with
    # the guidance, 1.1e-2 at 1.5 to 1.22e-1 at 30, as far off as a first image whose latents were read 10% off
    # (1.3e-1; benchmarks/results/fp8/2026-12-05-92ef8a0-check.json): no one-image limit tells those apart. The first 2
    # or 4 of 8 images alone round as far apart as one (1.1e-2 to 1.24e-1 by guidance, H100:
    # benchmarks/results/fp8/2026-12-05-a923270-check-parts-h100.json): no part of the batch checks it cheaper.
    # Each feed-forward's first Linear, GEGLU and quantisation are one kernel of ours (engine/kernels/geglu.py: 3.5%
    # of the 8 x 1024² step on an H100), and the UNet's convolutions at its inner levels FP8 kernels of ours
    # (engine/kernels/conv8.py: 4.3% of it); with both the bench job's FP8 pictures are 48.0 dB from fp16.
    Variant(FP8, COMPILED, 8e-2, "fp8", ("fp8-linears", "fused-geglu", "fp8-convs-inner"), fp8.OPTIONS, fp8.rewrite,
            fp8.InputScales, asked=True,
            capability=(8, 9), hardware="FP8 tensor cores: Ada, Hopper or later", refuses=COMPILED_ONLY,
            without=("ip_adapter", "region_layout")),
    # compiled kernels round once where eager rounds after every op: 1.6e-3 in the SDXL UNet's fp16 noise prediction
    # on an H200 (benchmarks/probes/fp8_scout.py); an artifact that read its timestep as fp16 bits was 1.2e-1 to
    # 1.6e-1 off. Inductor's Triton kernels need compute capability 7.0 (torch refuses an older GPU: "too old to be
    # supported by the triton GPU compiler").
    # Built with an IP-Adapter (Target.refs) and with regions (their prompts' keys, masks and regional references:
    # Target.tags). The first image alone is 2.2e-3 to 2.3e-3 off the replay's first image (H200, bench shapes).
    Variant(COMPILED, PLAIN, 2e-2, "fp16", capability=(7, 0), hardware="Volta or later", refuses=COMPILED_ONLY,
            alone_rtol=2e-2),
    Variant(PLAIN, EAGER, 2e-2),  # the eager kernels captured (0 measured)
)}
PRECISIONS: dict[str, Variant] = {v.precision: v for v in VARIANTS.values() if v.compiled}


def why_not(row: Variant, engine: str, compile: str, device) -> str | None:
    """None if `row` can run with these options on this device, else why not (a clause after its name)."""
    refused = [o for o in row.refuses if o in (f"--engine {engine}", f"--compile {compile}")]
    if refused:
        return f"cannot run with {' and '.join(refused)} (use {', and '.join(INSTEAD[o] for o in refused)})"
    if row.capability is None:
        return None
    need, have = "compute capability {}.{} or later".format(*row.capability), capability(device)
    if have is None:
        return f"needs a CUDA GPU of {need} ({row.hardware})"
    if have < row.capability:
        return f"needs {need} ({row.hardware}); {torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}"
    return None


def choose(name: str, engine: str, compile: str, device) -> str:
    """The row `--kernels name` runs: `auto`, the best row these options and this device allow of those not only used
    when asked (as the default has always been: compiled kernels on a GPU, plain graphs or the eager engine
    otherwise); a row's name, that row if they allow it. Raises BadInput (one line) for a row they do not allow."""
    if name == AUTO:
        return next(v.name for v in VARIANTS.values() if not v.asked and why_not(v, engine, compile, device) is None)
    if name not in VARIANTS:
        raise BadInput(f"--kernels: unknown kernels {name!r}{did_you_mean(name, VARIANTS)} (use {AUTO}, "
                       f"{', '.join(VARIANTS)})")
    why = why_not(VARIANTS[name], engine, compile, device)
    if why is not None:
        raise BadInput(f"--kernels {name} {why}")
    return name


def fit(name: str, models: Any, notes: list[str]) -> str:
    """`name`'s row, or the first row it falls back to whose kernels are built for the loaded models' parts; a note
    says why for each row passed over."""
    row = VARIANTS[name]
    while parts := [p for p in row.without if getattr(models, p, None) is not None]:
        notes.append(f"--kernels {row.name}: its kernels are not built with {PARTS[parts[0]]}; {row.fallback} "
                     "kernels instead")
        row = VARIANTS[row.fallback]
    return row.name


def chain(name: str) -> list[Variant]:
    """`name`'s row and the rows it falls back to, in order, up to the plain graphs."""
    rows = [VARIANTS[name]]
    while rows[-1].fallback != EAGER:
        rows.append(VARIANTS[rows[-1].fallback])
    return rows
