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

A runner's records are also kept across runs (`Plans.where`: a file per warm-up's kernels and machine, beside the
check ledger, engine/graph/ledger.py): a later run makes a new size's calls at its warm-up's rows ahead of that
warm-up, one call a piece, and the warm-up beside a loop (a new size's first step, one piece) keeps the rest of its
host time: the 832x1216 ControlNet graph's took 0.21 s with its record against 1.2-1.4 s without (docs/PERFORMANCE.md,
forty-first session). The file is written where a warm-up recorded other calls than it holds; one that cannot be read
is no record.
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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

    def on(self, device: str) -> Operand:
        """The same layout on `device` where it is on one of that type (a record kept by a process on another GPU)."""
        same = torch.device(self.device).type == torch.device(device).type
        return Operand(self.shape, self.stride, self.dtype, device, self.batched) if same else self


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

    def on(self, device: str) -> LibraryCall:
        return LibraryCall(self.op, tuple(_on(a, device) for a in self.args),
                           tuple((k, _on(v, device)) for k, v in self.kwargs), self.rows)

    def to_json(self) -> dict:
        return {"op": self.op, "args": [_to_json(a) for a in self.args],
                "kwargs": [[k, _to_json(v)] for k, v in self.kwargs], "rows": self.rows}

    @staticmethod
    def from_json(d: dict) -> LibraryCall:
        return LibraryCall(str(d["op"]), tuple(_from_json(a) for a in d["args"]),
                           tuple((str(k), _from_json(v)) for k, v in d["kwargs"]), int(d["rows"]))


def _on(value: Any, device: str) -> Any:
    if isinstance(value, Operand):
        return value.on(device)
    if isinstance(value, torch.device) and value.type == torch.device(device).type:
        return torch.device(device)
    if isinstance(value, tuple):
        return tuple(_on(v, device) for v in value)
    return value


# the plain values' types in a record's file, by tag (a float that JSON has no literal for as its repr)
_TORCH = {"dtype": torch.dtype, "memory_format": torch.memory_format}


def _to_json(value: Any) -> Any:
    if isinstance(value, Operand):
        return {"operand": [list(value.shape), list(value.stride), _torch_name(value.dtype), value.device,
                            value.batched]}
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v) for v in value]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for tag, kind in _TORCH.items():
        if isinstance(value, kind):
            return {tag: _torch_name(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value  # None, bool, int, float, str


def _from_json(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    (tag, v), = value.items()
    if tag == "operand":
        shape, stride, dtype, device, batched = v
        return Operand(tuple(map(int, shape)), tuple(map(int, stride)), _torch_value(dtype, torch.dtype), str(device),
                       bool(batched))
    if tag == "tuple":
        return tuple(_from_json(i) for i in v)
    if tag == "device":
        return torch.device(v)
    if tag == "float":
        return float(v)
    return _torch_value(v, _TORCH[tag])


def _torch_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _torch_value(name: str, kind: type) -> Any:
    value = getattr(torch, name)
    if not isinstance(value, kind):
        raise ValueError(f"{name} is not a {kind.__name__}")
    return value


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
    turns it on for the CPU's convolutions). `where`: an identity's file of the calls kept across runs (None: not kept,
    or its kernels have nothing to name them by); `device`: the device a kept record's calls are made on."""

    def __init__(self, enabled: bool, where: Callable[[object], Path | None] | None = None, device: str = "cpu"):
        self.enabled, self.where, self.device = enabled, where, device
        self.records: dict[object, list[LibraryCall]] = {}  # recorded by this process
        self._kept: dict[object, list[LibraryCall]] = {}  # read from `where`, once per identity

    @contextmanager
    def recording(self, identity: object, rows: int):
        """Records the step run inside it, where `identity` has no record yet in this process (yields the Recorder);
        else yields None and records nothing. A step that raises leaves no record. A record that differs from the
        kept one, at its rows, is kept in its place."""
        if not self.enabled or identity in self.records:
            yield None
            return
        with Recorder(rows) as recorder:
            yield recorder
        calls = self.records[identity] = recorder.recorded()
        MADE.update(calls)
        if calls and calls != [c.at(rows) for c in self.kept(identity)]:  # at other rows, the same calls: kept as is
            self._keep(identity, calls)

    def calls(self, identity: object) -> list[LibraryCall]:
        """`identity`'s calls: this process's record, else the one kept by an earlier run."""
        return self.records[identity] if identity in self.records else self.kept(identity)

    def made(self, identity: object, rows: int) -> None:
        """`identity`'s calls at `rows` have their plans: a capture or a step ran there."""
        MADE.update(c.at(rows) for c in self.calls(identity))

    def to_make(self, identity: object, rows: int) -> list[LibraryCall]:
        """`identity`'s calls at `rows` whose plans this process has not made."""
        return [c for c in (c.at(rows) for c in self.calls(identity)) if c not in MADE]

    def kept(self, identity: object) -> list[LibraryCall]:
        """The calls an earlier run recorded for `identity` (`where`), on this runner's device; none where there is
        no such file or it cannot be read."""
        if identity not in self._kept:
            self._kept[identity] = self._read(identity)
        return self._kept[identity]

    def _file(self, identity: object) -> Path | None:
        if not self.enabled or self.where is None:
            return None
        try:
            return self.where(identity)
        except Exception as e:  # noqa: BLE001 - a record is an optimisation: its name failing costs only the record
            log.debug("no plans record for %s: %s", identity, e)
            return None

    def _read(self, identity: object) -> list[LibraryCall]:
        path = self._file(identity)
        if path is None or not path.is_file():
            return []
        try:
            return [LibraryCall.from_json(d).on(self.device) for d in json.loads(path.read_text())["calls"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.debug("plans record %s unreadable (%s): its calls are made by the warm-up", path.name, e)
            return []

    def _keep(self, identity: object, calls: list[LibraryCall]) -> None:
        """Writes `calls` as `identity`'s kept record (atomically); a cache that cannot be written keeps none."""
        path = self._file(identity)
        if path is None:
            return
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"calls": [c.to_json() for c in calls]}) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.debug("plans record %s not written: %s", path.name, e)
            return
        self._kept[identity] = calls


def make(call: LibraryCall) -> None:
    """One call made ahead (a piece beside a loop); a failure leaves its plan to the capture, as without it."""
    MADE.add(call)
    try:
        call.run()
    except Exception as e:  # noqa: BLE001 - the capture makes the plan, or meets the error, as it would have
        log.debug("making %s's plan ahead failed: %s", call.op, e)
