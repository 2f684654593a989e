"""What a `bcg` process asks of CUDA's driver before CUDA starts (the driver reads its environment once, at its start).
Imports nothing: `bcg`'s entry point calls it before anything asks for a device."""

from __future__ import annotations

import os

# CUDA's launch queues at four times their default size. At the default, a launch of a graph of 1,900 kernels with
# many matmuls (a step's graph has about 1,900) waited with no replay queued ahead of it; at 4x with two
# (benchmarks/probes/queue_probe.py on an H200, docs/PERFORMANCE.md, thirty-fifth session). A loop runs the next
# batch's host work (its kernels' loads, warm-ups, captures, prompts) between its replays, and a piece of that work
# longer than the GPU time queued ahead of it leaves the GPU idle.
LAUNCH_QUEUES, LAUNCH_QUEUES_ENV = "4x", "CUDA_SCALE_LAUNCH_QUEUES"


def launch_queues() -> str:
    """The launch queues' scale for this process: `LAUNCH_QUEUES`, unless the user set CUDA_SCALE_LAUNCH_QUEUES, which
    then stands as it is. Returns what is in force; the processes this one starts inherit it."""
    if not os.environ.get(LAUNCH_QUEUES_ENV):
        os.environ[LAUNCH_QUEUES_ENV] = LAUNCH_QUEUES
    return os.environ[LAUNCH_QUEUES_ENV]
