"""What a denoising step, a decode and a cold start cost on a machine: the table time estimates read (`bcg plan`, the
server's `eta_s`). Milliseconds per UNet row-step per shape (size, rows, ControlNets, the IP-Adapter's UNet, kernel
variant), per (device, model); the decode, save and inputs per batch; weights and graphs per process. Measured by
renders and `bcg capture --warm` into the cache ($BCG_CACHE/costs.json, beside the compiled kernels), shipped for
the H200 and `sdxl-random` (costs_h200.py); a shape the table lacks is extrapolated by FLOPs from the nearest one it
has, and says so. No torch: `bcg plan` reads it without loading a model."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

from storyboard_cli.models.tiny import cache_root
from storyboard_cli.steps import CONTROLNET_FLOPS

COSTS_FILE = "costs.json"  # in $BCG_CACHE, beside compiled/
FORMAT = 1
CPU = "cpu"  # the device name of a machine without a GPU
EAGER = "eager"  # the variant of the eager engine (no graphs: the CPU's default)
# the IP-Adapter's UNet against the plain one at the same rows: 4 x 1024² plain graphs, 148.9 / 143.8 ms
# (docs/PERFORMANCE.md, "References (IP-Adapter)", one probe); its extra FLOPs are not counted
REFERENCE_COST = 1.035
OBSERVATIONS = 20  # a measured entry is the mean of at most this many observations: the latest weigh the same


@dataclass(frozen=True, order=True)
class StepShape:
    """One denoising step's shape: `rows` UNet rows (2 per image under guidance, 1 for the conditional rows alone),
    `nets` ControlNets running at that step, `refs` 1 where the UNet is the IP-Adapter's, the kernels' `variant`
    (engine/variants.py's row names, or "eager")."""

    width: int
    height: int
    rows: int
    nets: int = 0
    refs: int = 0
    variant: str = "compiled"

    @property
    def key(self) -> str:
        """"1024x1024 16 rows 1 net fp8": its key in costs.json."""
        refs = " ip-adapter" if self.refs else ""
        return f"{self.width}x{self.height} {self.rows} rows {self.nets} net{refs} {self.variant}"

    @classmethod
    def parse(cls, key: str) -> StepShape:
        size, rows, _, nets, *rest = key.split()
        width, height = size.split("x")
        return cls(int(width), int(height), int(rows), int(nets), int("ip-adapter" in rest), rest[-1])

    def flops(self) -> float:
        """Relative FLOPs of the step: rows x pixels x (the UNet + each ControlNet's share)."""
        return self.rows * self.width * self.height * (1 + CONTROLNET_FLOPS * self.nets)


@dataclass(frozen=True)
class Measured:
    """A step's cost: `ms` per row-step, the mean of `n` observations. `loop`: timed in a short loop outside a
    render (`bcg capture --warm`, a bench curve): a render also pays each shape's first-replay check
    (`Costs.check_s`), which a render's own figures hold."""

    ms: float
    n: int = 1
    loop: bool = False
    source: str = ""

    def to_json(self) -> dict:
        return {"ms_per_row_step": round(self.ms, 4), "n": self.n, "loop": self.loop, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> Measured:
        return cls(float(d["ms_per_row_step"]), int(d.get("n", 1)), bool(d.get("loop", False)),
                   str(d.get("source", "")))


@dataclass(frozen=True)
class Lookup:
    """A step's ms and how it was found: `measured` (this shape), or extrapolated by FLOPs from `source`."""

    ms: float
    measured: bool
    source: StepShape
    loop: bool


@dataclass
class Costs:
    """One (device, model)'s table. Seconds outside the steps: `encode_ms` per batch (prompts and inputs), `decode_ms`
    and `save_ms` per megapixel of image, and what fraction of each the denoising hid (`hidden`: they run beside the
    next batch); per process `load_s` (the weights) and per shape and variant `capture_s` (its graphs) and `check_s`
    (its first replay against eager, where the steps were timed outside a render)."""

    device: str
    model: str
    steps: dict[StepShape, Measured] = field(default_factory=dict)
    encode_ms: float | None = None
    decode_ms: float | None = None
    save_ms: float | None = None
    hidden: dict[str, float] = field(default_factory=dict)
    load_s: float | None = None
    capture_s: dict[str, float] = field(default_factory=dict)
    check_s: dict[str, float] = field(default_factory=dict)
    render_s: float = 0.0  # per render, outside its batches: the folder read, the report and the contact sheet
    sources: dict[str, str] = field(default_factory=dict)  # where the figures outside the steps came from

    def step(self, shape: StepShape) -> Lookup | None:
        """The step's ms: measured, or extrapolated by FLOPs from the nearest measured shape (the same variant, nets and
        adapter first, then the nearest rows and size); None when the table has no step at all."""
        if shape in self.steps:
            m = self.steps[shape]
            return Lookup(m.ms * shape.rows, True, shape, m.loop)
        if not self.steps:
            return None
        near = min(self.steps, key=lambda s: _distance(s, shape))
        m = self.steps[near]
        ms = m.ms * near.rows * shape.flops() / near.flops() * self.variant_ratio(near.variant, shape.variant)
        ms *= (REFERENCE_COST if shape.refs else 1.0) / (REFERENCE_COST if near.refs else 1.0)
        return Lookup(ms, False, near, m.loop)

    def variant_ratio(self, measured: str, wanted: str) -> float:
        """How much slower `wanted` runs than `measured`, by the shapes this table has in both (1.0 without any)."""
        if measured == wanted:
            return 1.0
        pairs = [(m.ms, self.steps[replace(s, variant=wanted)].ms) for s, m in self.steps.items()
                 if s.variant == measured and replace(s, variant=wanted) in self.steps]
        return sum(w for _, w in pairs) / sum(m for m, _ in pairs) if pairs else 1.0

    def outside_s(self, images: int, megapixels: float) -> float:
        """A batch's seconds outside its steps that the denoising did not hide: its inputs, decode and PNGs."""
        def exposed(name: str, seconds: float) -> float:
            return seconds * (1 - self.hidden.get(name, 0.0))

        return (exposed("encode", (self.encode_ms or 0.0) / 1000) + exposed("decode", (self.decode_ms or 0.0) *
                megapixels / 1000) + exposed("save", (self.save_ms or 0.0) * megapixels / 1000))

    def prepare_s(self, variant: str, loop: bool) -> float:
        """A shape's graphs before its first batch: capture, and its first-replay check where the step's figure was
        timed outside a render (a render's figures hold it)."""
        return self.capture_s.get(variant, 0.0) + (self.check_s.get(variant, 0.0) if loop else 0.0)

    # what a render measured (job/estimate.py `observe`) joins the table: each figure the mean of its observations

    def add_step(self, shape: StepShape, ms_per_row_step: float, source: str) -> None:
        old = self.steps.get(shape)
        if old is None or old.loop:  # a render's figure replaces a short loop's: it is what a render pays
            self.steps[shape] = Measured(ms_per_row_step, 1, False, source)
        else:
            n = min(old.n, OBSERVATIONS - 1)
            self.steps[shape] = Measured((old.ms * n + ms_per_row_step) / (n + 1), n + 1, False, source)

    def to_json(self) -> dict:
        return {"device": self.device, "model": self.model,
                "steps": {s.key: m.to_json() for s, m in sorted(self.steps.items())},
                "encode_ms_per_batch": self.encode_ms, "decode_ms_per_megapixel": self.decode_ms,
                "save_ms_per_megapixel": self.save_ms, "hidden": self.hidden, "load_s": self.load_s,
                "capture_s_per_shape": self.capture_s, "check_s_per_shape": self.check_s,
                "render_s": self.render_s, "sources": self.sources}

    @classmethod
    def from_json(cls, d: dict) -> Costs:
        return cls(str(d["device"]), str(d["model"]),
                   {StepShape.parse(k): Measured.from_json(v) for k, v in d.get("steps", {}).items()},
                   d.get("encode_ms_per_batch"), d.get("decode_ms_per_megapixel"), d.get("save_ms_per_megapixel"),
                   dict(d.get("hidden") or {}), d.get("load_s"), dict(d.get("capture_s_per_shape") or {}),
                   dict(d.get("check_s_per_shape") or {}), float(d.get("render_s") or 0.0),
                   dict(d.get("sources") or {}))


def _distance(have: StepShape, want: StepShape) -> tuple:
    """Which measured shape a missing one is extrapolated from: the same variant, nets and adapter before anything
    else, then the nearest rows (small batches are launch-bound: their cost per row is not the FLOPs'), then size."""
    return (have.variant != want.variant, abs(have.nets - want.nets), have.refs != want.refs,
            abs(math.log2(have.rows / want.rows)), abs(math.log(have.width * have.height / (want.width * want.height))))


def path(root: Path | None = None) -> Path:
    """$BCG_CACHE/costs.json: the tables renders and captures measured on this machine."""
    return (root or cache_root()) / COSTS_FILE


def read(file: Path | None = None) -> dict[tuple[str, str], Costs]:
    """The cached tables by (device, model); none when the file is missing or unreadable (it is only a cache)."""
    try:
        data = json.loads((file or path()).read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            return {}
        tables = [Costs.from_json(t) for t in data["tables"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {(t.device, t.model): t for t in tables}


def update(changed: Costs, merge, file: Path | None = None) -> Costs:
    """Reads the cached table of `changed`'s device and model (a new one if none), applies `merge(table)` and writes
    the file back, under a lock (renders on several GPUs of one machine finish together); returns the table."""
    file = file or path()
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tables = read(file)
        table = tables.get((changed.device, changed.model)) or Costs(changed.device, changed.model)
        merge(table)
        tables[table.device, table.model] = table
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "tables": [t.to_json() for t in tables.values()]}, indent=1))
        tmp.replace(file)
    return table


def local_device() -> str:
    """This machine's first GPU by name ("NVIDIA H200"), as torch.cuda names it, read without torch (nvidia-smi);
    "cpu" without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return CPU
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return CPU
    return out[0].strip() if out and out[0].strip() else CPU


def device_of(name: str) -> str:
    """A table's device from a report's device ("cuda (NVIDIA H200)" -> "NVIDIA H200", "cpu" -> "cpu")."""
    return name[name.index("(") + 1: name.rindex(")")] if "(" in name and name.endswith(")") else name
