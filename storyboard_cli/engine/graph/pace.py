"""A batch's loop and the host work beside it: when the loop runs its next piece of `between` work (the next batches'
captures, prompts and inputs, engine/graph/runner.py `ahead`) so that the GPU keeps replays queued ahead of it, and
how long the GPU waited for the host between two replays (GraphStats.idle_ms)."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from storyboard_cli.engine.base import run_between

# replays a batch's loop keeps queued ahead of the GPU before it runs a piece of `between` work (`Pace`): a piece
# that takes longer than the steps queued ahead of it (a warm-up or capture beside the loop takes 0.06-1.0 s of host
# time, a 1-image step 32 ms) leaves the GPU idle. How many replays CUDA's launch queue holds depends on the graph's
# kernels: at its default scale a launch of a graph of 1,900 kernels with many matmuls waited with none queued
# ahead, at the 4x `bcg` sets (cuda_env.py) with two (benchmarks/probes/queue_probe.py, H200); a launch that finds
# the queue full waits, and then the GPU has all the host can give it. The pieces left at the loop's end run after
# its last replay.
AHEAD_REPLAYS = 4
# a launch that took longer than this waited for room in the launch queue: one that did not took 0.3-3.0 ms of host
# time, one that waited 29-280 ms, about a step (the probe, graphs of 1,900 kernels)
BLOCKED_S = 0.010


class Pace:
    """When a loop runs its next piece of `between` work: once `ahead` of its replays are queued and not yet run (their
    end events not reached), or as many as the launch queue held when a launch last waited for room there (`full`:
    a heavy graph's queue holds fewer than `ahead`), or its last launch waited so. After a piece, the loop queues
    replays again until one of those holds, so each piece starts with the GPU's queue as full as the host can make
    it; short pieces run one after another while it stays so (a loop of 8 x 1024² steps, whose queue held three,
    ran one 3 ms piece a replay before `full`: docs/PERFORMANCE.md, forty-first session). `in_flight`: the replays
    queued and not yet run (a test replaces it, and `clock`, which times a launch); on the CPU, where a replay has run
    when its launch returns, every replay counts as queued."""

    def __init__(self, cuda: bool, ahead: int = AHEAD_REPLAYS):
        self.ahead, self.cuda = ahead, cuda
        self.events: list[torch.cuda.Event] = []  # the end of each replay queued, oldest first
        # (end of a replay, start of the next): where the GPU waited for the host (GraphStats.gaps)
        self.gaps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.last: torch.cuda.Event | None = None  # the end of the last replay launched
        self.launched, self.blocked = 0, False
        # the most replays in flight after a launch that waited (one waiting for the host's turn, the GIL, counts
        # fewer): the launch queue's room for this graph's replays
        self.full = 0
        self.in_flight: Callable[[], int] = self._in_flight
        self.clock: Callable[[], float] = time.perf_counter

    def replay(self, graph, inputs: Callable[[], object] | None = None) -> None:
        """Launches one replay of `graph`, after `inputs` (its step's copies into the static buffers), and notes its
        end, whether its launch waited and the gap on the GPU since the replay before."""
        if self.cuda and self.last is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.gaps.append((self.last, start))
        if inputs is not None:
            inputs()
        t = self.clock()
        graph.replay()
        self.blocked = self.clock() - t > BLOCKED_S
        self.launched += 1
        if self.cuda:
            self.last = torch.cuda.Event(enable_timing=True)
            self.last.record()
            self.events.append(self.last)
        if self.blocked:
            self.full = max(self.full, self.in_flight())

    def _in_flight(self) -> int:
        if not self.cuda:
            return self.launched
        while self.events and self.events[0].query():
            self.events.pop(0)
        return len(self.events)

    def room(self) -> bool:
        """Whether the next piece may run now: the GPU has the steps queued that it should have, or that the launch
        queue takes."""
        return self.blocked or self.in_flight() >= min(self.ahead, self.full or self.ahead)

    def run(self, between: Iterator[Callable[[], object]] | None) -> Iterator[Callable[[], object]] | None:
        """Runs `between`'s pieces while `room` holds; returns what is left (None: used up)."""
        while between is not None and self.room():
            between = run_between(between)
            self.blocked = False  # a piece's own launches are not the loop's
        return between
