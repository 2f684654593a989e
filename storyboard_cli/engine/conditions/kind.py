"""What a conditioning kind is on the engine side: a row of the table (`Kind`, engine/conditions/__init__.py `KINDS`),
the value it hands the step for one batch (`Condition`), and a batch's values of every kind (`Conditions`), which is
all the step, the static buffers, the graph runner and the batch runner see of any kind.

The step reads a kind only through `Condition`: its conditional rows (`half`), its tensors at a step (`at`), what it
adds to the UNet call (`attention`: the attention processors' keyword arguments; `residuals`: added to the UNet's
blocks, a ControlNet's), and hooks around the sampler's update: `after_step` (the latents after the update, e.g.
an inpainting mask's per-row blend), `start` (each row's first step; a row keeps its latents until then) and `begin`
(a batch's first latents, once before the loop: a source's, noised). A graph
holds a kind's static buffers (`Static`, allocated once at the largest shape) through a `Condition` of views into
them (`Static.view`), which `pairs` fills from a batch's value: every kind's (dst, src) pairs are loaded with one
grouped copy (engine/graph/buffers.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import torch

from storyboard_cli.errors import first_line

if TYPE_CHECKING:
    from storyboard_cli.steps import StepKind

DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, zlib.error)  # what PIL raises for a file it cannot decode
Pair = tuple[torch.Tensor, torch.Tensor]  # (a static buffer, what a batch loads into it)


@dataclass(frozen=True)
class Step:
    """What a kind may read while the step calls the UNet: the module calls (engine/eager.py StepCalls, where a kind's
    own modules are: `calls.net(i)`), the step's kind, and the UNet's inputs (CFG-doubled rows [2B], or the conditional
    rows [B] alone)."""

    calls: Any
    kind: StepKind
    latents: torch.Tensor  # [R, 4, h, w] in the model dtype
    t: torch.Tensor  # [R]
    embeds: torch.Tensor  # [R, 77, C]
    pooled: torch.Tensor  # [R, P]
    time_ids: torch.Tensor  # [R, 6]


class Condition(Protocol):
    """One kind's tensors for one batch, CFG-doubled like the embeds (negative rows first), or a graph's views of the
    kind's static buffers (the same type). A frozen value: a change is a new one."""

    kind: str  # its row's name (KINDS)

    @property
    def bits(self) -> int:
        """What it adds to a graph's identity (Shape.control: the ControlNets' bits); 0: one shape for every batch."""
        ...

    def half(self, b: int) -> Condition:
        """The conditional rows alone (a step without guidance); clones where compiled kernels want aligned rows."""
        ...

    def at(self, index: int | torch.Tensor) -> Condition:
        """Its tensors at one step (`index`: an int, or the graph's step counter [1] on the device)."""
        ...

    def first_images(self, n: int, b: int) -> Condition:
        """Its tensors for the first `n` of the batch's `b` images alone (rows CFG-doubled as conditioning.py
        `image_rows` takes them; per image: the first n): what a graph's check on one image runs (engine/graph/check.py
        `first_step_of_part`)."""
        ...

    def attention(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the UNet's attention processors (cross_attention_kwargs), in the order an exported
        UNet takes them (engine/kernels/export.py UNetCall); {} for none."""
        ...

    def residuals(self, step: Step) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """(mid, down) added to the UNet's blocks at this step, or None."""
        ...

    def after_step(self, x: torch.Tensor, x_next: torch.Tensor, denoised: torch.Tensor,
                   index: int | torch.Tensor) -> torch.Tensor:
        """The latents after the sampler's update [B, 4, h, w] float32, as this kind leaves them (x_next itself for
        none). x: the step's input latents; index: as for `at`."""
        ...

    def start(self) -> torch.Tensor | None:
        """Each row's first step [B] (long, on the device): before it a row keeps its latents; None: every row from
        the first step."""
        ...

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's first latents [B, 4, h, w] as this kind leaves them (a source's, noised to the first sigma of the
        schedule's tail); x itself for none. Run once, before the loop."""
        ...

    def idle(self) -> list[Pair]:
        """On a graph's views: what loads a batch without this kind's value into its buffers, where the graph runs the
        kind anyway (a blend left as a no-op); [] for none."""
        ...

    def pairs(self, value: Condition) -> list[Pair]:
        """On a graph's views: (its buffer, `value`'s tensor) for each tensor a batch's `value` loads."""
        ...


class Plain:
    """The no-op half of `Condition` a kind inherits: nothing in the graph's identity, no UNet input of one sort or
    the other, the hooks leave the latents as they are."""

    bits = 0

    def at(self, index: int | torch.Tensor) -> Condition:
        return self

    def attention(self) -> dict[str, torch.Tensor]:
        return {}

    def residuals(self, step: Step) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        return None

    def after_step(self, x, x_next, denoised, index):
        return x_next

    def start(self) -> torch.Tensor | None:
        return None

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def idle(self) -> list[Pair]:
        return []


class Static(Protocol):
    """A kind's static buffers at the largest batch and size a runner needs: graphs hold pointers into them, so they
    are allocated once and never move."""

    def view(self, key: Any) -> Condition | None:
        """The buffers sliced and shaped for one graph (`key`: engine/graph/keys.py ShapeKey); None where the graph
        does not run the kind."""
        ...


class Unreadable(Exception):
    """A file of an item's kind that does not decode (it broke after the job was read): that image fails, named."""

    def __init__(self, what: str, path: Path, shown: str, error: BaseException):
        name = shown or str(path)  # as the job names it (a served job's file is a blob)
        why = (first_line(error, 200) or error.__class__.__name__).replace(str(path), name)
        super().__init__(f"{what} {name} cannot be read: {why}")


class Reader(Protocol):
    """A kind's inputs for the batches of one job, made once per batch runner (its caches live here)."""

    def check(self, item: Any, timings: Any) -> None:
        """Decodes (once: they are cached) the files a WorkItem names for this kind; raises Unreadable.
        `timings`: folder/report.py Timings, for a stage the reader times."""
        ...

    def batch(self, items: Sequence[Any], key: Any) -> Condition | None:
        """The kind's tensors for a batch's rows (job/items.py WorkItems, padding included; `key`: their BucketKey),
        on the device; None where the batch does not use the kind."""
        ...


@dataclass(frozen=True)
class Kind:
    """A conditioning kind's row: its name (the job half's row of the same name, job/conditions/), the names that are
    its alone (no module outside */conditions/ in engine/ and run/ spells them: tests/test_architecture.py), and the
    parts the engine calls."""

    name: str
    fields: tuple[str, ...]
    reader: Callable[[Any], Reader | None]  # (models) -> its per-runner reader; None where the models lack it
    static: Callable[[Any, int, int], Static | None]  # (models, max_batch, max_pixels) -> its static buffers
    # (models, batch, width, height, bits) -> a value of the right shapes for timing (values do not change kernel
    # times; `bits`: Shape.control), or None
    synthetic: Callable[[Any, int, int, int, int], Condition | None]
    # (models) -> the width of what an exported UNet takes from the kind (engine/kernels/export.py Target.refs); 0
    artifact_width: Callable[[Any], int] = lambda models: 0
    # a kind whose inputs change an exported UNet's signature beyond that (the regions'): its part of the artifacts
    export: Export | None = None


@dataclass(frozen=True)
class Export:
    """A kind's part of the UNet artifacts: `artifact` (models) -> the tag naming the inputs these models want ("" for
    none; it starts with `tag`; Target.tags: the artifact's key, label and file name); `prepare` (unet, tag) puts the
    kind's attention processors into a UNet a build made from its config; `inputs` (unet, tag, rows, height, width)
    gives its example inputs, in its `attention()` order, with the strides its static buffers' views have (an
    artifact reads its inputs with the strides it was built for)."""

    tag: str
    artifact: Callable[[Any], str]
    prepare: Callable[[Any, str], None]
    inputs: Callable[[Any, str, int, int, int], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Conditions:
    """A batch's values of every kind it uses, in the table's order (or a graph's views of them): what the step, the
    buffers and the engines hand around, naming no kind."""

    values: tuple[Condition, ...] = ()

    @classmethod
    def of(cls, *values: Condition | None) -> Conditions:
        return cls(tuple(v for v in values if v is not None))

    def __iter__(self) -> Iterator[Condition]:
        return iter(self.values)

    def __bool__(self) -> bool:
        return bool(self.values)

    def get(self, kind: str) -> Condition | None:
        return next((v for v in self.values if v.kind == kind), None)

    def like(self, other: Conditions) -> Conditions:
        """The values of the kinds `other` has (a graph's views: a step after the ControlNet's end has none)."""
        return Conditions(tuple(v for v in self.values if other.get(v.kind) is not None))

    @property
    def bits(self) -> int:
        """Shape.control: what the kinds add to a graph's identity."""
        return sum(v.bits for v in self.values)

    def half(self, b: int) -> Conditions:
        return Conditions(tuple(v.half(b) for v in self.values))

    def at(self, index: int | torch.Tensor) -> Conditions:
        return Conditions(tuple(v.at(index) for v in self.values))

    def first_images(self, n: int, b: int) -> Conditions:
        return Conditions(tuple(v.first_images(n, b) for v in self.values))

    def attention(self) -> dict[str, torch.Tensor] | None:
        """Every kind's attention keyword arguments, or None for none (the UNet's own processors then)."""
        out = {k: t for v in self.values for k, t in v.attention().items()}
        return out or None

    def residuals(self, step: Step) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """Every kind's (mid, down), summed in the table's order; (None, None) for none."""
        mid = down = None
        for v in self.values:
            r = v.residuals(step)
            if r is not None:
                mid, down = r if mid is None else (mid + r[0], [a + b for a, b in zip(down, r[1])])
        return mid, down

    def after_step(self, x: torch.Tensor, x_next: torch.Tensor, denoised: torch.Tensor,
                   index: int | torch.Tensor) -> torch.Tensor:
        """The hooks after the sampler's update, in the table's order, then each row held until its first step."""
        for v in self.values:
            x_next = v.after_step(x, x_next, denoised, index)
        for v in self.values:
            start = v.start()
            if start is not None:
                step = index if isinstance(index, torch.Tensor) else torch.tensor(index, device=x.device)
                x_next = torch.where((step < start).view(-1, 1, 1, 1), x, x_next)
        return x_next

    def pairs(self, values: Conditions) -> list[Pair]:
        """On a graph's views: the (dst, src) pairs that load `values` (a kind the views lack is not loaded; a kind
        `values` lack, its `idle` pairs)."""
        out: list[Pair] = []
        for view in self.values:
            value = values.get(view.kind)
            out += view.pairs(value) if value is not None else view.idle()
        return out

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's first latents, as its kinds leave them (Condition.begin), in the table's order."""
        for v in self.values:
            x = v.begin(x)
        return x
