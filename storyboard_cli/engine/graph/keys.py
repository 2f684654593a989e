"""What identifies a captured graph and what it cost: `ShapeKey` (everything that changes a tensor shape or the
captured kernels), `Warmed` (which kernels a warm-up or capture has run, so a later capture may skip its warm-up)
and `GraphStats` (a graph's state, capture seconds, pool and replay times). engine/graph/runner.py captures and
replays."""

from __future__ import annotations

from dataclasses import dataclass, field

from storyboard_cli.engine.base import Shape, shape_label
from storyboard_cli.engine.variants import EAGER, PLAIN
from storyboard_cli.steps import FULL, StepKind


@dataclass(frozen=True, order=True)
class ShapeKey:
    """A graph's identity: everything that changes a tensor shape or the captured kernels."""

    batch: int
    height: int
    width: int
    control: int  # Shape.control: the ControlNets' bits
    dtype: str
    variant: str = PLAIN  # a row of engine/variants.py: "fp8" or "compiled" (their kernels), "plain" (the modules)
    step: StepKind = FULL  # draft mode's step kinds: conditional rows only, DeepCache full / shallow

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.height, self.width, self.control)

    @property
    def label(self) -> str:
        variant = "" if self.variant == PLAIN else f" {self.variant}"
        step = f" {self.step.label}" if self.step.label else ""
        return f"{shape_label(self.batch, self.width, self.height, self.control)} {self.dtype}{variant}{step}"


@dataclass(frozen=True)
class Warmed:
    """What a warm-up (or a capture after one) has run: the modules' kernels at these rows and latent size.
    `whole`: the whole UNet (a DeepCache shallow step runs part of it); `control`: the ControlNet too."""

    variant: str
    rows: int
    height: int
    width: int
    whole: bool
    control: int  # the ControlNets it ran (Shape.control's bits)

    @classmethod
    def of(cls, key: ShapeKey) -> Warmed:
        rows = 2 * key.batch if key.step.guided else key.batch
        return cls(key.variant, rows, key.height, key.width, key.step.cache != "read", key.control)

    def covers(self, other: Warmed) -> bool:
        """Whether this run's kernels include every kernel `other` runs (same modules, shapes and code). A compiled
        variant's kernels are one artifact for every row count (the rows are its one dynamic dimension): any rows
        cover any other. A library's per-shape setup (cuDNN's plans) at new rows is then made in the capture; every
        compiled and FP8 capture of the bench job without a warm-up at new rows succeeded and checked as before (the
        2026-12-02 scout in docs/PERFORMANCE.md), and a capture that fails is tried again after one."""
        same = (self.variant, self.height, self.width) == (other.variant, other.height, other.width)
        rows = self.rows == other.rows or self.variant != PLAIN
        return same and rows and self.whole >= other.whole and not other.control & ~self.control


@dataclass
class GraphStats:
    key: ShapeKey
    state: str = "pending"  # "graph" | "released" | what it fell back to: "eager" or a lower variant ("plain", ...)
    reason: str = ""
    checked: bool = False  # the first replay matched the eager step
    capture_s: float = 0.0
    warmup: bool = False  # its capture ran a warm-up step first (no graph before it had run its kernels)
    warmup_rows: int = 0  # the rows it ran at: a compiled graph's the fewest its artifact takes (`_fewest_rows`)
    warmup_s: float = 0.0  # of capture_s: the warm-up step (host time to the GPU's end)
    end_s: float = 0.0  # of capture_s: torch's end of capture (the driver ends it and instantiates the graph)
    compile_s: float = 0.0  # the background build of this size's kernels, when this run made them
    load_s: float = 0.0  # loading its kernels from the cache before its capture (deferred: GraphRunner._bind)
    pool_mb: float = 0.0
    planned: int = 0  # library calls made ahead for it beside a loop, at its warm-up's rows and its own (plans.py)
    beside: bool = False  # captured between the replays of the batch before its own (GraphRunner.ahead)
    beside_of: str = ""  # the label of the graph whose loop it was captured beside (spare: not the one before)
    replays: int = 0
    events: list = field(default_factory=list)  # (start, end, steps) CUDA events, read lazily
    # (entry, loop) CUDA events of each batch that began on this graph: from `sample`'s entry to its loop's first
    # replay, what ran before the loop (the inputs' copies, the first step and its check, the host's work between)
    leads: list = field(default_factory=list)
    # (end of a replay, start of the next) CUDA events in its batches' loops (`Pace`): the GPU idles between them
    # where the host had queued nothing more (a piece of work beside the loop that outlasted the replays queued)
    gaps: list = field(default_factory=list)

    @property
    def ran(self) -> str | None:
        """The variant its batches ran: its own where it is a graph (or was, until released), eager where it fell
        back there; None where it fell back to another variant's graph (a row of its own) or never ran."""
        if self.state in ("graph", "released"):
            return self.key.variant
        return EAGER if self.state == EAGER else None

    @property
    def replay_ms(self) -> float:
        done = [(s.elapsed_time(e), n) for s, e, n in self.events if e.query()]
        steps = sum(n for _, n in done)
        return sum(ms for ms, _ in done) / steps if steps else 0.0

    @property
    def lead_ms(self) -> float:
        """Milliseconds from its batches' entries to their loops, summed (`leads`)."""
        return sum(s.elapsed_time(e) for s, e in self.leads if e.query())

    @property
    def idle_ms(self) -> float:
        """Milliseconds the GPU idled between the replays of its batches' loops, summed (`gaps`; a replay queued
        behind the one before it starts a few microseconds after its end, counted too)."""
        return sum(s.elapsed_time(e) for s, e in self.gaps if e.query())
