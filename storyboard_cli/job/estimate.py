"""How long a job's batches take, from the cost table (costs.py): each batch's steps by its step plan (the rows
guided or not, the ControlNets on or ended, DeepCache's shallow steps at their FLOPs' share), what the denoising does
not hide of its inputs, decode and PNGs, and per process the weights and each shape's graphs; split across GPUs as
`bcg render --gpus N` shares whole batches. `observe` adds what a render measured to the cache's table. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from storyboard_cli import costs, costs_h200
from storyboard_cli.costs import CPU, EAGER, Costs, StepShape
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.plan import Batch
from storyboard_cli.steps import SHALLOW_FLOPS

SPREAD = {"measured": 0.10, "extrapolated": 0.20}  # the range quoted: render farms quote +-20%
AUTO_GPU = "compiled"  # `--kernels auto` on a GPU: the compiled kernels, where the cache has them (else plain graphs)


def adapted(job) -> int:
    """1 where a kind the job uses changes the UNet itself rather than running a side network beside it (the
    IP-Adapter's processors: `StepShape.refs`), else 0."""
    return int(any(kind.needs(job) and not any(kind.shot_side(s)[0] for s in job.shots) for kind in KINDS))


def variant_for(kernels: str, device: str) -> str:
    """The table's variant a render with `--kernels` runs on `device`: the eager engine on the CPU."""
    if device == CPU:
        return EAGER
    return AUTO_GPU if kernels == "auto" else kernels


def tables(device: str, model: str) -> tuple[Costs | None, str]:
    """The table for a device and model, and what it is: this machine's measurements in the cache over the shipped
    figures, the shipped ones, a table of the same device for `sdxl-random` where the model has SDXL-base's shapes
    (any model but the tiny preset), or none."""
    cached = costs.read()
    shipped = {(costs_h200.DEVICE, costs_h200.MODEL): costs_h200.table()}
    for m in (model, costs_h200.MODEL if model != "tiny" else None):
        if m is None:
            continue
        base, mine = shipped.get((device, m)), cached.get((device, m))
        if base is None and mine is None:
            continue
        table = base or mine
        if base is not None and mine is not None:  # this machine's figures over the shipped ones
            table.steps.update(mine.steps)
            for name in ("encode_ms", "decode_ms", "save_ms", "load_s", "render_s"):
                if getattr(mine, name) is not None:
                    setattr(table, name, getattr(mine, name))
            for name in ("hidden", "capture_s", "check_s"):
                getattr(table, name).update(getattr(mine, name))
        what = ("measured on " + device + (" (this machine's measurements)" if mine is not None and base is None else
                                           " (this machine's measurements and bcg's figures)" if mine is not None else
                                           " (bcg's figures)"))
        if m != model:
            what += f", for {m} (SDXL-base's shapes), not {model}"
        return table, what
    return None, f"no measurement of {model} on {device}: FLOPs only"


@dataclass(frozen=True)
class BatchCost:
    shape: tuple[int, int, int, int]  # size, width, height, side networks: a graph per shape (Engine's Shape)
    seconds: float
    measured: bool
    loop: bool


@dataclass
class Estimate:
    """A job's time on `gpus` GPUs: `seconds` for its batches once every GPU is ready, `low`..`high` the range; a
    process's `cold_start_s` before that (`load_s` the weights, `prepare_s` its shapes' graphs, on the GPU with
    the most); `basis` says what the figures are."""

    basis: str
    device: str
    model: str
    variant: str
    gpus: int
    row_steps: int
    seconds: float | None = None
    low: float | None = None
    high: float | None = None
    load_s: float = 0.0
    prepare_s: float = 0.0
    per_gpu: list[float] = field(default_factory=list)
    extrapolated: int = 0  # of `shapes`: by FLOPs from another shape
    shapes: int = 0

    @property
    def cold_start_s(self) -> float:
        return self.load_s + self.prepare_s

    def to_json(self) -> dict:
        """`bcg plan --json`'s `estimate`; `wall_s`: a render in a fresh process (cold start included)."""
        r = (lambda v: None if v is None else round(v, 1))  # noqa: E731
        return {"seconds": r(self.seconds), "low_s": r(self.low), "high_s": r(self.high),
                "cold_start_s": r(self.cold_start_s) if self.seconds is not None else None,
                "load_s": r(self.load_s), "prepare_s": r(self.prepare_s),
                "wall_s": r(self.seconds + self.cold_start_s) if self.seconds is not None else None,
                "gpus": self.gpus, "per_gpu_s": [r(s) for s in self.per_gpu], "device": self.device,
                "model": self.model, "variant": self.variant, "basis": self.basis, "shapes": self.shapes,
                "shapes_extrapolated": self.extrapolated, "row_steps": self.row_steps}

    def line(self) -> str:
        """"time: ~14 min (12-16 min) on 1 GPU, measured on NVIDIA H200 (bcg's figures), compiled kernels; cold start
        40 s (weights 12 s, graphs 28 s)"; without a table, what it lacks."""
        gpus = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}" if self.device != CPU else "the CPU"
        if self.seconds is None:
            return f"time: {self.basis} ({self.row_steps:,} UNet row-steps); a render here measures it"
        flops = f", {self.extrapolated} of {self.shapes} shapes extrapolated by FLOPs" if self.extrapolated else ""
        return (f"time: ~{duration(self.seconds)} ({span(self.low, self.high)}) on {gpus}, {self.basis}, "
                f"{self.variant} kernels{flops}; cold start {duration(self.cold_start_s)} (weights "
                f"{duration(self.load_s)}, graphs {duration(self.prepare_s)})")


def duration(seconds: float) -> str:
    """12 s, 3 min 5 s, 1 h 4 min."""
    s = round(seconds)
    if s < 60:
        return f"{max(s, 0)} s" if seconds >= 0.5 or seconds == 0 else f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s < 600 else f"{round(seconds / 60)} min"
    return f"{s // 3600} h {round(s % 3600 / 60)} min"


def span(low: float, high: float) -> str:
    """"12-16 min", "40-49 s": a range in the unit of its top."""
    if high < 60:
        return f"{round(low)}-{round(high)} s"
    if high < 3600:
        return f"{round(low / 60)}-{round(high / 60)} min"
    return f"{low / 3600:.1f}-{high / 3600:.1f} h"


def batch_cost(table: Costs, batch: Batch, variant: str, refs: int = 0) -> BatchCost:
    """One batch's seconds: each step of its plan at its shape's ms (the conditional rows alone at B rows, a shallow
    DeepCache step at its share of the UNet's FLOPs, a step after the ControlNets' end without them), then what the
    denoising does not hide of its inputs, decode and PNGs."""
    key, b = batch.key, batch.size
    side = key.sides[0]  # the side networks (ControlNets) its steps run while they run
    ms, measured, loop, seen = 0.0, True, False, {}
    for kind in key.plan:
        shape = StepShape(key.width, key.height, b * (2 if kind.guided else 1), side if kind.control else 0, refs,
                          variant)
        found = seen.get(shape) or table.step(shape)
        seen[shape] = found
        measured, loop = measured and found.measured, loop or found.loop
        ms += found.ms * (SHALLOW_FLOPS[kind.branch] if kind.cache == "read" else 1.0)
    seconds = ms / 1000 + table.outside_s(len(batch.items), len(batch.items) * key.width * key.height / 1e6)
    return BatchCost((b, key.width, key.height, side), seconds, measured, loop)


def estimate(batches: list[Batch], model: str, device: str, kernels: str = "auto", gpus: int = 1,
             refs: int = 0) -> Estimate:
    """The job's batches on `gpus` GPUs of `device` (`bcg plan`). Each GPU loads the weights and captures the shapes
    of the batches it claims; batches are claimed largest first (run/dist.py), each by the GPU free first."""
    variant = variant_for(kernels, device)
    table, basis = tables(device, model)
    row_steps = sum(b.size * (2 if b.key.guided else 1) * b.key.runs for b in batches)
    est = Estimate(basis, device, model, variant, gpus, row_steps)
    if table is None or table.step(StepShape(64, 64, 2, 0, 0, variant)) is None:
        return est
    priced = [batch_cost(table, b, variant, refs) for b in batches]
    shapes = {c.shape: c for c in priced}
    est.shapes, est.extrapolated = len(shapes), sum(not c.measured for c in shapes.values())
    busy = [table.render_s] * gpus  # each GPU's share of a render outside its batches (the folder, the report)
    owned: list[set] = [set() for _ in range(gpus)]
    prepare = [0.0] * gpus
    order = sorted(priced, key=lambda c: -c.seconds) if gpus > 1 else priced
    for c in order:
        g = min(range(gpus), key=lambda i: busy[i] + prepare[i])
        if c.shape not in owned[g]:
            owned[g].add(c.shape)
            prepare[g] += table.prepare_s(variant, c.loop)
        busy[g] += c.seconds
    worst = max(range(gpus), key=lambda i: busy[i] + prepare[i])
    est.seconds, est.per_gpu = max(busy), busy
    est.load_s, est.prepare_s = table.load_s or 0.0, prepare[worst]
    spread = SPREAD["measured" if not est.extrapolated else "extrapolated"]
    est.low, est.high = est.seconds * (1 - spread), est.seconds * (1 + spread)
    return est


@dataclass(frozen=True)
class Observed:
    """What one render measured, as its report has it: each bucket's batch (one of them: they share a shape) with its
    row of report.json's `buckets` (`batches`, `rows`, `steps`, `denoise_s`), its `stages_s` and `hidden_s`, and the
    shapes it captured."""

    device: str
    model: str
    variant: str
    buckets: list[tuple[Batch, dict]]
    stages: dict[str, float]
    hidden: dict[str, float]
    wall_s: float
    images: int
    megapixels: float
    shapes: int
    refs: int = 0
    source: str = "a render"


def observe(seen: Observed, file=None) -> Costs:
    """Adds a render's figures to the cache's table of its device and model (costs.update): each bucket whose every
    step has one shape (no draft lever), its ms per row-step; the stages per batch and megapixel and what the
    denoising hid of them; the weights' and each shape's graphs' seconds where this render paid them; the rest of its
    wall (its folder, report and contact sheet)."""
    batches = sum(row["batches"] for _, row in seen.buckets)

    def merge(table: Costs) -> None:
        for batch, row in seen.buckets:
            kinds = set(batch.key.plan)
            if len(kinds) != 1 or not row["steps"] or not row["batches"] or not row["denoise_s"]:
                continue
            (kind,) = kinds
            if kind.cache:
                continue
            rows = row["rows"] // row["batches"]
            shape = StepShape(batch.key.width, batch.key.height, rows, batch.key.sides[0] if kind.control else 0,
                              seen.refs, seen.variant)
            table.add_step(shape, 1000 * row["denoise_s"] / row["steps"] / rows, seen.source)
        s = seen.stages
        if batches:
            table.encode_ms = 1000 * s.get("encode", 0.0) / batches
        if seen.megapixels:
            table.decode_ms = 1000 * s.get("decode", 0.0) / seen.megapixels
            table.save_ms = 1000 * s.get("save", 0.0) / seen.megapixels
        for name in ("encode", "decode", "save"):
            if s.get(name):
                table.hidden[name] = min(1.0, max(0.0, seen.hidden.get(name, 0.0) / s[name]))
        if seen.device == CPU:  # the inputs and the decode run in place on the CPU (BatchRunner.start_decode): the
            table.hidden.update(encode=0.0, decode=0.0)  # wall holds them whole, whatever the streams' timers said
        # the captures the wall paid: those beside a loop before their batch are hidden (GraphRunner.ahead)
        capture = max(0.0, s.get("capture", 0.0) - seen.hidden.get("capture", 0.0))
        inside = s.get("load", 0.0) + capture + s.get("denoise", 0.0) + sum(
            s.get(name, 0.0) * (1 - table.hidden.get(name, 0.0)) for name in ("encode", "decode", "save"))
        table.render_s = max(0.0, seen.wall_s - inside)
        if s.get("load", 0.0) > 0.5:  # weights loaded by this render (not handed in)
            table.load_s = s["load"]
        if seen.shapes and capture > 0.05:
            table.capture_s[seen.variant] = capture / seen.shapes

    return costs.update(Costs(seen.device, seen.model), merge, file)


def image_seconds(batches: list[Batch], model: str, device: str, kernels: str = "auto", refs: int = 0
                  ) -> dict[int, float]:
    """Each item's share of its batch's seconds (by `id(item)`), the service's unit of work: on the device's table,
    or where it has none on the shipped one, extrapolated by FLOPs (the server calibrates each worker against it)."""
    table, _ = tables(device, model)
    variant = variant_for(kernels, device)
    if table is None or table.step(StepShape(64, 64, 2, 0, 0, variant)) is None:
        table, variant = costs_h200.table(), AUTO_GPU
    shares = {}
    for b in batches:
        seconds = batch_cost(table, b, variant, refs).seconds
        shares.update({id(item): seconds / len(b.items) for item in b.items})
    return shares


def observe_loops(device: str, model: str, loops: list[tuple[StepShape, float, float]], file=None) -> Costs:
    """`bcg capture --warm`'s figures into the cache's table: per shape (its step, ms per step of its short loop,
    its capture seconds). A short loop's figure does not replace a render's (Costs.add_step keeps what a render
    measured; a render's replaces a loop's)."""
    def merge(table: Costs) -> None:
        for shape, ms, _ in loops:
            if shape not in table.steps or table.steps[shape].loop:
                table.steps[shape] = costs.Measured(ms / shape.rows, 1, True, "bcg capture --warm")
        by_variant: dict[str, list[float]] = {}
        for shape, _, capture_s in loops:
            by_variant.setdefault(shape.variant, []).append(capture_s)
        table.capture_s.update({v: sum(c) / len(c) for v, c in by_variant.items()})

    return costs.update(Costs(device, model), merge, file)
