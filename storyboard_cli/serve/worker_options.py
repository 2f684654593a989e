"""`WorkerOptions`: what `bcg worker` was started with, as its loop, its places and its lease renders read
them. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkerOptions:
    server: str
    name: str = ""
    device: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    compile: str = "auto"
    kernels: str = "auto"  # the kernels' row by name (bcg render --kernels: auto, compiled, fp8, plain)
    token: str | None = None
    poll_s: float = 0.5
    max_leases: int | None = None  # stop after this many (tests); None: until stopped
    upload: bool = False  # send the PNGs back even when the server's job folders are visible here
    root: Path = Path("bcg-worker")  # copies of job folders, when the server's are not visible here
    max_inputs_gb: float = 20.0  # the most disk the input files downloaded into root may take
    warm: Path | None = None  # a job whose model and shapes are made ready before the first lease
    stall_s: float = 600.0  # a lease render with no sign of progress this long: the worker exits (0: never)
