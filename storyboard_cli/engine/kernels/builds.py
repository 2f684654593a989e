"""Compiled kernels built in child processes: in the background while a render runs on the plain graphs
(`--compile auto`), or side by side for `bcg capture --warm` and `--compile on`, which wait for them.

- One child per artifact (module x image size). As many run at once as the machine's cores, memory
  and free GPU memory allow; each is niced, so the render keeps the CPU it needs to feed the GPU.
- A child makes its module from the config alone, without values (they are not compiled in): it reads
  no weights, runs nothing on the GPU but the compile's own checks, and holds one module's memory.
- A child takes the artifact's lock file first: two renders never build the same artifact (the
  second sees the lock and waits for the first's result instead).
- Children run in their own session: Ctrl-C, a SIGTERM of the render or its end does not stop them,
  and what they finish lands in the cache for the next render.
- A child moves its artifact into place only after loading it once itself (a broken library kills the
  child, never a render), and leaves its timings and peak memory next to it (`.build.json`).
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from storyboard_cli.engine.kernels.artifacts import Target, build
from storyboard_cli.engine.kernels.export import tagged
from storyboard_cli.engine.device import DTYPES, dtype_flag, indexed

CORES_PER_BUILD = 2  # a build is mostly one Python thread (tracing, lowering, scheduling) plus compile workers
HOST_BYTES_PER_BUILD = 12 << 30  # upper bound of a child's memory, compile workers included (docs/PERFORMANCE.md)
GPU_HEADROOM = 0.3  # of the GPU's memory a build never takes: the render's graphs and activations
# Seconds one build takes when a job's builds run side by side, for the progress lines' time left where the cache has
# no record of a build of its kind (`estimate_s`): the bench job's six on the device image's 16 cores, an H100
# (docs/PERFORMANCE.md, 2026-12-06: fp16 UNets ready after 183-198 s, ControlNets 112-132 s; FP8 UNets 349-363 s,
# ControlNets 212-215 s); a UNet with an IP-Adapter or regions as its precision's UNet, another precision as fp16
ESTIMATE_S = {("unet", "fp16"): 200.0, ("controlnet", "fp16"): 130.0, ("unet", "fp8"): 365.0,
              ("controlnet", "fp8"): 215.0}
RECORDS = 5  # an estimate from records: the median of the latest this many of its kind


@dataclass
class CompileEvent:
    module: str  # what is compiled: "unet 1024x1024"; for a "stage", what the cold start waits for now
    state: str  # "compiling" | "done" | "failed" | "stage" (a stage of a cold start begins: `stage`)
    elapsed_s: float
    estimate_s: float  # a stage's: 0 where unknown
    message: str = ""


def stage(what: str, estimate_s: float = 0.0) -> CompileEvent:
    """A stage of a cold start begins (`bcg capture --warm`, `--compile on`): the weights, the FP8 constants, the load
    checks, each shape's capture and timings. The progress printer says what it waits for and the time left."""
    return CompileEvent(what, "stage", 0.0, estimate_s)


def kind(label: str) -> str:
    """A target's label without its size ("unet 1024x1024 fp8" -> "unet fp8"): builds of one kind take about as long
    at any size (the bench job's three sizes within 8%)."""
    words = label.split()
    return " ".join(words[:1] + words[2:])


def estimate_s(target: Target, folder: Path) -> float:
    """About how many seconds `target`'s build takes: the median of the latest RECORDS build records of its kind at any
    size in `folder` (the cache's `.build.json`: this machine's builds, or those of a cache copied in), their stages
    summed; without one, ESTIMATE_S."""
    want, found = kind(target.label), []
    for f in folder.glob(f"{target.module}-*.build.json"):
        try:
            r = json.loads(f.read_text())
            if kind(r["target"]) == want:
                stages = sum(r[k] for k in ("make_module_s", "export_s", "compile_s", "load_s"))
                found.append((f.stat().st_mtime, stages))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record being written, or of another format: not evidence
    if found:
        return float(statistics.median(s for _, s in sorted(found)[-RECORDS:]))
    return ESTIMATE_S.get((target.module, target.precision), ESTIMATE_S[(target.module, "fp16")])


@dataclass
class Build:
    target: Target
    path: Path
    model: Any  # the module whose config the child builds from
    estimate_s: float = 0.0  # about how long it takes (`estimate_s`), for the progress lines
    state: str = "queued"  # "queued" | "building" | "elsewhere" (another process's child) | "done" | "failed"
    proc: subprocess.Popen | None = None
    started: float = field(default_factory=time.perf_counter)
    message: str = ""

    @property
    def log(self) -> Path:
        return self.path.with_suffix(".log")


def _held(lock: Path) -> bool:
    """Whether some process holds the artifact's lock (a build of it is running)."""
    if not lock.exists():
        return False
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return HOST_BYTES_PER_BUILD


def slots(device: torch.device, gpu_bytes: int) -> int:
    """How many builds may run at once here: cores, host memory and free GPU memory (one module each)."""
    cores = len(os.sched_getaffinity(0))
    n = min(max(1, cores // CORES_PER_BUILD), max(1, _mem_available() // HOST_BYTES_PER_BUILD))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        n = min(n, max(1, int((free - GPU_HEADROOM * total) // max(gpu_bytes, 1))))
    return n


class Builds:
    """The artifacts this process wants built. `want` queues, `poll` starts and reaps (never blocks),
    `wait` blocks until every wanted artifact is done or failed (with progress events)."""

    def __init__(self, device: torch.device, on_event: Callable[[CompileEvent], None] | None = None,
                 retry_failed: bool = False, notes: list[str] | None = None):
        self.device, self.on_event = device, on_event or (lambda e: None)
        self.retry_failed = retry_failed  # `capture --warm`, `--compile on`: a failed build is tried again
        self.builds: dict[Target, Build] = {}
        self.notes = notes if notes is not None else []  # a failed build, in a line (the render's notes)
        self._slots: int | None = None

    def want(self, wanted: list[tuple[Target, Path, Any]]) -> None:
        for target, path, model in wanted:
            if target in self.builds:
                continue
            b = self.builds[target] = Build(target, path, model, estimate_s(target, path.parent))
            failed = path.with_suffix(".failed")
            if failed.is_file() and not self.retry_failed:
                self._finish(b, "failed", f"it failed before ({failed.read_text().strip()}); "
                                          f"`bcg capture JOB --warm` tries again")
            elif _held(path.with_suffix(".lock")):
                b.state = "elsewhere"
        self.poll()

    @property
    def active(self) -> list[Build]:
        return [b for b in self.builds.values() if b.state in ("queued", "building", "elsewhere")]

    def poll(self) -> list[tuple[Target, Path, float]]:
        """Reaps finished children, starts queued builds where a slot is free; returns the artifacts
        that became ready since the last call: (target, path, seconds)."""
        ready = []
        for b in self.active:
            if b.state == "building" and b.proc.poll() is not None:
                self._reap(b)
            elif b.state == "elsewhere" and b.path.is_file() and not _held(b.path.with_suffix(".lock")):
                self._finish(b, "done")
            elif b.state == "elsewhere" and not _held(b.path.with_suffix(".lock")):
                self._finish(b, "failed", "another process was building it and stopped without a result")
            if b.state == "done":
                ready.append((b.target, b.path, time.perf_counter() - b.started))
        queued = [b for b in self.builds.values() if b.state == "queued"]
        running = sum(b.state == "building" for b in self.builds.values())
        if queued and self._slots is None:
            self._slots = slots(self.device, max(_bytes(b.model) for b in queued) + (1 << 30))
        for b in queued[: max(0, (self._slots or 1) - running)]:
            self._start(b)
        for b in self.active:
            if b.state != "queued":
                self.on_event(CompileEvent(b.target.label, "compiling", time.perf_counter() - b.started,
                                           b.estimate_s))
        return ready

    def wait(self, interval: float = 0.5) -> list[tuple[Target, Path, float]]:
        """Blocks until nothing is queued or building; returns every artifact that became ready."""
        ready = self.poll()
        while self.active:
            time.sleep(interval)
            ready += self.poll()
        return ready

    def _start(self, b: Build) -> None:
        b.path.parent.mkdir(parents=True, exist_ok=True)
        config = b.path.with_suffix(".config.json")
        config.write_text(json.dumps(dict(b.model.config), default=str))
        device = indexed(self.device)
        cmd = [sys.executable, "-m", "storyboard_cli.engine.kernels.builds", b.target.module, type(b.model).__name__,
               str(config), dtype_flag(b.model.dtype), str(device), str(b.target.height), str(b.target.width), str(b.path),
               b.target.precision, str(b.target.refs), ",".join(b.target.tags)]
        # every child gets every core for its compile workers: one build's serial stretches (tracing,
        # lowering, the C++ wrapper) leave them to the others' parallel ones. A TORCHINDUCTOR_COMPILE_THREADS the
        # environment sets (a shared machine's limit; a machine whose builds run one at a time, where a second
        # compile worker costs more CPU than it saves) is kept
        env = {"TORCHINDUCTOR_COMPILE_THREADS": str(len(os.sched_getaffinity(0)))} | os.environ
        with open(b.log, "w") as log:  # a file, not a pipe: the child may outlive this process
            b.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        b.state, b.started = "building", time.perf_counter()

    def _reap(self, b: Build) -> None:
        code = b.proc.returncode
        if code == 0 and b.path.is_file():
            self._finish(b, "done")
            return
        if code == 0:  # another process held the artifact's lock: its build is the one to wait for
            b.state = "elsewhere"
            return
        lines = b.log.read_text(errors="replace").strip().splitlines() if b.log.is_file() else []
        reason = (lines or [f"exit {code}"])[-1][:200]
        if code < 0:
            reason = f"the build process was killed by signal {-code}"
        b.path.with_suffix(".failed").write_text(reason + "\n")
        self._finish(b, "failed", reason)

    def _finish(self, b: Build, state: str, message: str = "") -> None:
        b.state, b.message = state, message
        elapsed = time.perf_counter() - b.started
        if state == "failed":
            self.notes.append(f"compiling {b.target.label} failed: {message}")
        self.on_event(CompileEvent(b.target.label, state, elapsed, b.estimate_s, message))


def _bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _max_rss_mb() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round((own + workers) / 1024, 1)  # KiB on Linux


def _main(argv: list[str]) -> None:
    """A build child: MODULE CLASS CONFIG DTYPE DEVICE HEIGHT WIDTH PATH PRECISION REFS TAGS (comma-separated). Exits 0
    without an artifact when another process holds the artifact's lock (or finished it since the parent looked)."""
    module, cls_name, config, dtype, device, height, width, path, precision, refs, tags = argv
    path = Path(path)
    lock = open(path.with_suffix(".lock"), "a+")  # held until this process exits, however it exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    if path.is_file():
        return
    os.nice(10)
    import diffusers


    t0 = time.perf_counter()
    # the module is made in its dtype (no float32 copy first), on the meta device, then memory without values: the
    # values are not compiled in, and no initialisation kernel runs on a GPU a render may be using. The default
    # dtype goes back to float32 before the export: whatever the traced code makes without a dtype must be what the
    # rendering process makes (an fp16 default put the timestep and the UNet's own float32 tensors in fp16)
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device("meta"):
            model = getattr(diffusers, cls_name).from_config(json.loads(Path(config).read_text()))
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device).to(dtype=DTYPES[dtype]).eval().requires_grad_(False)
    if int(refs):  # a UNet with an IP-Adapter: its processors, in their shapes (values are not compiled in)
        from storyboard_cli.models.ip_adapter import install_processors

        install_processors(model, torch.device(device), DTYPES[dtype])
    target = Target(module, int(height), int(width), precision, int(refs), tuple(filter(None, tags.split(","))))
    for row, tag in tagged(target.tags):  # a kind's processors (the regions'), which its inputs reach
        row.export.prepare(model, tag)
    made = time.perf_counter() - t0
    stats = build(target, model, path)
    path.with_suffix(".failed").unlink(missing_ok=True)
    stats = {"target": target.label, "make_module_s": round(made, 1), **stats,
             "max_rss_mb": _max_rss_mb(), "compile_threads": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}
    path.with_suffix(".build.json").write_text(json.dumps(stats) + "\n")


if __name__ == "__main__":
    _main(sys.argv[1:])
