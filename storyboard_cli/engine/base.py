"""The Engine protocol: what render, capture and bench may ask of any engine (eager, graph, compiled).

Callers never probe an engine's type: an engine with nothing to do for a call does nothing.
No torch at import time: the shape label is shared with torch-free code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from storyboard_cli.engine.conditioning import Cond
    from storyboard_cli.engine.conditions.kind import Conditions
    from storyboard_cli.engine.sampling import Schedule
    from storyboard_cli.steps import StepKind, StepPlan


class Shape(NamedTuple):
    """What one denoising loop's tensors look like: a batch (bucket size) of images at one size."""

    batch: int
    height: int
    width: int
    control: int  # the ControlNets the loop runs, bit i for net i (True: the first alone, a job's one ControlNet)

    @property
    def label(self) -> str:
        """The one shape label format: `images x width x height`, `+control` with a ControlNet."""
        return shape_label(self.batch, self.width, self.height, self.control)


def nets_of(control: int) -> tuple[int, ...]:
    """The ControlNets a shape's `control` bits name, in the job's order."""
    return tuple(i for i in range(int(control).bit_length()) if control >> i & 1)


def shape_label(batch: int, width: int, height: int, control: int) -> str:
    """`+control` with the first ControlNet alone (a job's one net), `+control 0+1` with several (by index)."""
    nets = "" if control in (0, 1) else " " + "+".join(map(str, nets_of(control)))
    return f"{batch}x{width}x{height}{' +control' if control else ''}{nets}"


@runtime_checkable
class Engine(Protocol):
    name: str  # "eager" | "graph": what the report calls it

    def sample(self, x: torch.Tensor, sched: Schedule, noise: torch.Tensor | None, cond: Cond,
               conds: Conditions | None, guidance: torch.Tensor, plan: StepPlan | None = None,
               between: Iterator[Callable[[], object]] | None = None) -> torch.Tensor:
        """Initial latents x [B, 4, h, w] -> final latents [B, 4, h, w] float32. `noise`: per-step noise
        [steps, B, 4, h, w] for ancestral samplers, else None; `conds`: the batch's values of its conditioning kinds
        (engine/conditions/), None for none; `guidance` [B]; `plan`: each step's kind
        (draft renders: steps.step_plan), None for every step guided and whole. `between`: host work in small
        pieces, run on this thread one after each step is queued (after any capture and check; what is left after the
        last step): the GPU's time on the steps queued before a piece hides the host's time on it."""
        ...

    def prepare(self, shapes: list[Shape], kinds: dict[Shape, set[StepKind]] | None = None,
                later: list[Shape] = (), beside: bool = False) -> None:
        """Get ready for these shapes ahead of the first batch (a graph engine sizes and captures); `kinds`:
        the step kinds a shape's batches run, where they are not today's full step; `later`: shapes that run after
        them (a render's hires passes), sized for and their kernels wanted now, captured on first use; `beside`: the
        caller hands each batch's `ahead` pieces to the loop before it, so what they can do is left to them."""
        ...

    def ahead(self, shape: Shape, kinds: set[StepKind], spare: bool = False) -> Iterator[Callable[[], object]] | None:
        """Pieces of `between` work for a loop before a batch of `shape` running `kinds`: they get that batch ready
        (a graph engine captures its graphs there); None when there is nothing to do. `spare`: for a loop further
        before it than the last (its pieces are `Spare`), None where what they would make may not be what the batch
        runs by then."""
        ...

    def release(self) -> None:
        """Give back the memory held for speed (after an out-of-memory); later batches still run."""
        ...

    def can_run(self, shape: Shape) -> bool:
        """Whether this engine runs `shape` on its own fast path (not through a fallback)."""
        ...

    def describe(self) -> list[dict]:
        """One row per prepared shape, for the report (empty when there is nothing to say)."""
        ...


class Spare:
    """A piece of `between` work that a loop may leave undone: work for a batch after the next one (capturing its
    graphs beside a long loop rather than the short one before it), which a loop runs only while it has room for
    pieces, never after its last replay (`run_between`'s `everything`), where it would hold up the next batch; a later
    loop offers what it left again. Spare pieces come after the others."""

    def __init__(self, piece: Callable[[], object]):
        self.piece = piece

    def __call__(self) -> object:
        return self.piece()


def run_between(between: Iterator[Callable[[], object]] | None, everything: bool = False) -> Iterator | None:
    """Runs the next piece of an engine's `between` work (every piece left: `everything`, up to the first `Spare` one,
    which with the rest is dropped); returns the iterator, or None once it is used up."""
    if between is None:
        return None
    for piece in between:
        if everything and isinstance(piece, Spare):
            return None
        piece()
        if not everything:
            return between
    return None
