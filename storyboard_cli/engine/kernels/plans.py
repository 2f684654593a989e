"""The libraries' per-shape setup of a step at new rows, made ahead in small pieces.

A compiled artifact runs every row count, but the libraries it calls plan per shape: cuDNN builds a convolution's
plan and an attention's graph the first time it meets a shape, rows included, on the host (an 8 x 1024² UNet's first
call at new rows spent 258-285 ms in cuDNN's attention and 70-170 ms in its convolutions: docs/PERFORMANCE.md,
eighteenth session). A graph captured at new rows pays that setup inside its capture, one piece of host time that
outlasts the replays queued ahead of it when it runs beside a loop.

`Recorder` notes the library calls one step makes (a warm-up's, at its rows: the operator, and each argument's shape,
strides and dtype, the values of the rest) through a dispatch mode; the artifact's fallback calls pass through the
dispatcher. `LibraryCall.at(rows)` is the same call at other rows (its batch-carrying operands' first dimension
scaled, their strides kept), and running it makes that shape's plan on uninitialised operands: a few milliseconds of
GPU work, one call per piece of work beside a loop. A call whose operands do not scale that way is not made ahead; the
capture then makes its plan as before.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

# operator name -> the positions of its operands whose first dimension is the step's rows; the rest (weights, bias,
# options) are the same at any rows
BATCHED: dict[str, tuple[int, ...]] = {
    "aten._convolution.default": (0,),
    "aten.convolution.default": (0,),
    "aten.cudnn_convolution.default": (0,),
    "aten._scaled_dot_product_cudnn_attention.default": (0, 1, 2),
    "aten._cudnn_attention_forward.default": (0, 1, 2),
}


@dataclass(frozen=True)
class Operand:
    """A tensor argument's layout: what a library's plan is keyed on (its values are not)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    batched: bool  # its first dimension is the step's rows

    @staticmethod
    def of(t: torch.Tensor, batched: bool) -> Operand:
        return Operand(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), batched)

    def outermost(self) -> bool:
        """Whether its first dimension is its outermost (its stride spans every other dimension's extent): then at
        other rows only that dimension's size changes."""
        if not self.shape or self.shape[0] == 0:
            return False
        inner = 1 + sum((n - 1) * s for n, s in zip(self.shape[1:], self.stride[1:]))
        return self.stride[0] >= inner

    def at(self, rows: int, was: int) -> Operand:
        if not self.batched:
            return self
        return Operand((self.shape[0] // was * rows, *self.shape[1:]), self.stride, self.dtype, self.device, True)

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class LibraryCall:
    """One library call of a step: its operator's name, and its arguments (Operand or a plain value)."""

    op: str
    args: tuple
    kwargs: tuple  # (name, value) pairs
    rows: int  # the step's rows when it was recorded

    def scalable(self) -> bool:
        batched = [a for a in self.args if isinstance(a, Operand) and a.batched]
        return bool(batched) and all(a.outermost() and a.shape[0] % self.rows == 0 for a in batched)

    def at(self, rows: int) -> LibraryCall:
        args = tuple(a.at(rows, self.rows) if isinstance(a, Operand) else a for a in self.args)
        return LibraryCall(self.op, args, self.kwargs, rows)

    def run(self) -> None:
        """The call on uninitialised operands of its layouts: the library plans for this shape (its result is
        dropped)."""
        op = _operator(self.op)
        args = [a.make() if isinstance(a, Operand) else a for a in self.args]
        op(*args, **dict(self.kwargs))


def _operator(name: str):
    _, rest = name.split(".", 1)  # "aten.<name>.<overload>"
    packet, overload = rest.rsplit(".", 1)
    return getattr(getattr(torch.ops.aten, packet), overload)


def _plain(value: Any) -> Any:
    """An argument's hashable form: lists as tuples; None where it cannot be told apart by value (a tensor that is
    not an operand, a generator): the call is then not recorded."""
    if isinstance(value, (list, tuple)):
        items = tuple(_plain(v) for v in value)
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format)):
        return value
    return None


class Recorder(TorchDispatchMode):
    """While active, notes the library calls (`BATCHED`'s operators) the step makes, each layout once, in order."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows
        self.calls: dict[LibraryCall, None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in BATCHED:
            self._note(name, BATCHED[name], args, kwargs)
        return func(*args, **kwargs)

    def _note(self, name: str, batched: tuple[int, ...], args, kwargs) -> None:
        out = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                out.append(Operand.of(a, i in batched))
            else:
                plain = _plain(a)
                if plain is None and a is not None:
                    return
                out.append(plain)
        kw = []
        for k, v in sorted(kwargs.items()):
            if isinstance(v, torch.Tensor):
                return  # a tensor passed by name: not a layout this module knows how to scale
            plain = _plain(v)
            if plain is None and v is not None:
                return
            kw.append((k, plain))
        call = LibraryCall(name, tuple(out), tuple(kw), self.rows)
        if call.scalable():
            self.calls.setdefault(call)

    def recorded(self) -> list[LibraryCall]:
        return list(self.calls)


# the calls whose plans this process has made (made ahead, or run by a warm-up or a capture at their rows): cuDNN's
# caches are the process's (per thread: a render's captures and its pieces beside a loop run on one thread)
MADE: set[LibraryCall] = set()


class Plans:
    """The library calls of each warm-up a runner ran, by what it ran (a graph's `Warmed`, its rows aside), and the
    pieces that make them at a graph's rows ahead of its capture (GraphRunner.ahead). `enabled`: on a GPU (a test
    turns it on for the CPU's convolutions)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.records: dict[object, list[LibraryCall]] = {}

    @contextmanager
    def recording(self, identity: object, rows: int):
        """Records the step run inside it, where `identity` has no record yet (yields the Recorder); else yields None
        and records nothing. A step that raises leaves no record."""
        if not self.enabled or identity in self.records:
            yield None
            return
        with Recorder(rows) as recorder:
            yield recorder
        self.records[identity] = recorder.recorded()
        MADE.update(self.records[identity])

    def made(self, identity: object, rows: int) -> None:
        """`identity`'s calls at `rows` have their plans: a capture or a step ran there."""
        MADE.update(c.at(rows) for c in self.records.get(identity, ()))

    def to_make(self, identity: object, rows: int) -> list[LibraryCall]:
        """`identity`'s calls at `rows` whose plans this process has not made."""
        return [c for c in (c.at(rows) for c in self.records.get(identity, ())) if c not in MADE]


def make(call: LibraryCall) -> None:
    """One call made ahead (a piece beside a loop); a failure leaves its plan to the capture, as without it."""
    MADE.add(call)
    try:
        call.run()
    except Exception as e:  # noqa: BLE001 - the capture makes the plan, or meets the error, as it would have
        log.debug("making %s's plan ahead failed: %s", call.op, e)
