"""plan -> engine -> outputs. The orchestrator, in three phases: prepare, run, finish. Never prints.

`RenderSession` holds one render; its phases are methods, so a subclass hooks in at exactly those
points (a multi-GPU worker claims its batches in `work`, the contact sheet is written in `finish`).
`Renderer` is the policy and I/O around a `BatchRunner`: out of memory, the writer thread, the manifest.
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from storyboard_cli.batch import BatchRunner, Decoded, batch_shapes, bucket_label
from storyboard_cli.engine.base import Engine
from storyboard_cli.engine.build import build_engine, check_engine, device_name, dtype_name, resolve_device
from storyboard_cli.errors import Interrupted, RenderFailure
from storyboard_cli.job import Job
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.outputs import (Manifest, OutputLock, Writer, atomic_write, check_output_dir, manifest_record,
                                    pending_items, png_bytes, previous_failures, remove_stale_temps)
from storyboard_cli.plan import Batch, make_batches
from storyboard_cli.report import Timings, build_report, write_report

log = logging.getLogger(__name__)
# What one bad batch may raise (an unreadable control image, a decode error) and the job goes on.
# Anything else (TypeError, AttributeError, ...) is a bug of ours: it aborts, with its traceback.
BATCH_ERRORS = (OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class RenderOptions:
    out_dir: Path | None = None
    force: bool = False
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: fp16 on cuda, fp32 on cpu
    engine: str = "auto"  # auto | graph | eager
    retry_failed: bool = False
    compile: str = "auto"  # auto | on | off: compiled kernels inside the graphs


@dataclass
class Event:
    kind: str  # "start" | "batch" | "image" | "failed" | "note"
    done: int = 0
    total: int = 0
    shot: str = ""
    message: str = ""


@dataclass
class RenderResult:
    status: str  # "done" | "failed" (some images) | "interrupted"
    out_dir: Path
    rendered: int
    skipped: int
    failed: list[dict]
    wall_s: float
    device: str
    engine: str
    report: dict
    report_paths: tuple[Path, Path] | None
    notes: list[str] = field(default_factory=list)


class _StopFlag:
    """First Ctrl-C: finish the image being written, then stop. Second: stop at once."""

    def __init__(self):
        self.requested = False

    def handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@contextmanager
def _interruptible():
    flag = _StopFlag()
    try:
        old = signal.signal(signal.SIGINT, flag.handler)
    except ValueError:  # not the main thread: no signal handling
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


class Renderer:
    """Runs batches through a BatchRunner and writes what comes out, with the out-of-memory policy:
    free the engine's memory, split the batch into smaller buckets (down to 1, then the eager
    fallback), and remember the size that failed so later batches are split before they run."""

    def __init__(self, runner: BatchRunner, job: Job, out_dir: Path, manifest: Manifest, total: int,
                 on_event: Callable[[Event], None]):
        self.runner, self.job, self.out_dir, self.manifest = runner, job, out_dir, manifest
        self.total, self.on_event = total, on_event
        self.failed: list[dict] = []
        self.notes: list[str] = []
        self.rendered = 0
        self.oom_at = 1 << 30  # the smallest batch size that ran out of memory
        self.writer = Writer()

    def fail(self, items, reason: str) -> None:
        for item in items:
            for path in item.outputs:
                self.failed.append({"path": path, "shot": item.shot, "reason": reason})
            self.on_event(Event("failed", self.rendered, self.total, item.shot, f"{item.outputs[0]}: {reason}"))

    def deliver(self, decoded: list[Decoded], label: str) -> None:
        """Hands the PNGs to the writer thread (it overlaps them with the next batch's denoising);
        an image with NaN/inf is recorded as failed, never saved."""
        for d in decoded:
            if d.pixels is None:
                self.fail([d.item], d.failure)
            else:
                self.writer.submit(self._save, d, label)

    def _save(self, d: Decoded, label: str) -> None:
        """Runs on the writer thread: atomic PNG writes, then their manifest lines."""
        t0 = time.perf_counter()
        model, controlnet = self.job.model, self.job.controlnet
        data = png_bytes(d.pixels, d.item, model, controlnet)
        fingerprint = d.item.fingerprint(model, controlnet)
        for path in d.item.outputs:
            try:
                atomic_write(self.out_dir / path, data)
            except OSError as e:
                raise RenderFailure(f"cannot write {self.out_dir / path}: {e.strerror or e}") from e
            self.manifest.append(manifest_record(d.item, path, fingerprint, finished=True))
            self.rendered += 1
            self.runner.timings.bucket(label).images += 1
            self.on_event(Event("image", self.rendered, self.total, d.item.shot, path))
        self.runner.timings.stages["save"] += time.perf_counter() - t0

    def process(self, batch: Batch, buckets: tuple[int, ...], fallback: bool = False) -> None:
        """One batch, end to end, under the out-of-memory policy."""
        smaller = tuple(b for b in buckets if b < min(batch.size, self.oom_at))
        if batch.size >= self.oom_at and smaller:
            self._split(batch, smaller, fallback)
        elif not self._attempt(batch, fallback):
            self._out_of_memory(batch, buckets, fallback)

    def _attempt(self, batch: Batch, fallback: bool) -> bool:
        """Runs and delivers the batch; False if it ran out of memory. A failure of this batch alone is
        recorded against its images and the job goes on."""
        try:
            self.deliver(self.runner.decode(self.runner.run_batch(batch, fallback)), bucket_label(batch))
        except torch.cuda.OutOfMemoryError:
            return False  # handled by the caller, outside this block: the error's frames hold memory
        except BATCH_ERRORS as e:
            log.exception("batch %s failed", batch.key.label)
            text = str(e).strip()
            self.fail(batch.items, f"{e.__class__.__name__}: {text.splitlines()[0][:200] if text else ''}")
        return True

    def _out_of_memory(self, batch: Batch, buckets: tuple[int, ...], fallback: bool) -> None:
        self.oom_at = min(self.oom_at, batch.size)
        self.runner.release()
        smaller = tuple(b for b in buckets if b < batch.size)
        where = f"out of GPU memory at {batch.size} x {batch.key.label}"
        if batch.size > 1 and smaller:
            self.notes.append(f"{where}: retried in buckets of at most {max(smaller)}")
            self._split(batch, smaller, fallback)
        elif not fallback:
            self.notes.append(f"{where}: retried eager")
            self.process(batch, (1,), fallback=True)
        else:
            self.fail(batch.items, "out of GPU memory even for one image")

    def _split(self, batch: Batch, buckets: tuple[int, ...], fallback: bool) -> None:
        for sub in make_batches(list(batch.items), buckets):
            self.process(sub, buckets, fallback)


class RenderSession:
    """One render of one job into one folder: `execute` runs prepare -> run -> finish."""

    def __init__(self, job: Job, opts: RenderOptions, on_event: Callable[[Event], None] | None = None,
                 models: SdxlModels | None = None, engine: Engine | None = None):
        self.t_start = time.perf_counter()
        self.job, self.opts, self.models, self.engine = job, opts, models, engine
        self.on_event = on_event or (lambda e: None)
        self.device, self.dtype = (models.device, models.dtype) if models else resolve_device(opts.device, opts.dtype)
        if engine is None:
            check_engine(opts.engine, opts.compile, self.device)
        self.out_dir = Path(opts.out_dir) if opts.out_dir else job.output_dir
        check_output_dir(self.out_dir)
        self.timings = Timings(sync=torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.notes: list[str] = []
        self.skipped = self.total = 0
        self.batches: list[Batch] = []
        self.renderer: Renderer | None = None

    def execute(self) -> RenderResult:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with OutputLock(self.out_dir), _interruptible() as stop:
            status = "error"
            try:
                self.prepare()
                status = self.run(stop)
            except (Interrupted, KeyboardInterrupt) as e:
                status = "interrupted"  # finished images are written out; a second Ctrl-C drops the queued ones
                self._close_writer(cancel=isinstance(e, KeyboardInterrupt))
            except BaseException:
                self._close_writer(cancel=True)
                raise
            finally:
                result = self.finish(status)
        return result

    def prepare(self) -> None:
        """Reconciles the folder and its manifest, finds the images left to render and plans them; loads
        the models and prepares the engine only when there is something to render."""
        remove_stale_temps(self.out_dir)
        manifest = Manifest(self.out_dir)
        only = previous_failures(self.out_dir) if self.opts.retry_failed else None
        if only is not None and not only:
            self.notes.append("--retry-failed: the last report lists no failed images")
        pending, self.skipped, found = pending_items(self.job, self.out_dir, self.opts.force, only)
        manifest.reconcile(found)
        self.total = sum(len(i.outputs) for i in pending)
        self.on_event(Event("start", 0, self.total, "", f"{self.total} to render, {self.skipped} already done"))
        if not pending:
            return
        self.batches = make_batches(pending, self.job.buckets)
        shapes = batch_shapes(self.batches)
        with self.timings.stage("load"):
            if self.models is None:
                controlnet = self.job.controlnet if any(i.control_image for i in pending) else None
                self.models = load_sdxl(self.job.model, controlnet, self.device, self.dtype)
        with self.timings.stage("capture"):
            if self.engine is None:
                self.engine = build_engine(self.models, self.opts.engine, shapes, self.notes, self.opts.compile)
            self.engine.prepare(shapes)
        runner = BatchRunner(self.models, self.engine, self.timings)
        self.renderer = Renderer(runner, self.job, self.out_dir, manifest, self.total, self.on_event)

    def work(self) -> Iterable[Batch]:
        return self.batches  # the batches this session renders, in order

    def run(self, stop: _StopFlag) -> str:
        """Batches -> images on disk. Returns the status so far ("done"); Ctrl-C raises Interrupted."""
        r = self.renderer
        if r is None:
            return "done"
        for batch in self.work():
            self.on_event(Event("batch", r.rendered, self.total, batch.items[0].shot, batch.key.label))
            r.process(batch, self.job.buckets)
            if stop.requested:
                raise Interrupted("stopped by Ctrl-C")
        r.writer.close()
        return "done"

    def finish(self, status: str) -> RenderResult:
        """The report (a run that rendered nothing keeps the last one, and its failure list for
        --retry-failed) and the result."""
        r = self.renderer
        failed, rendered = (r.failed, r.rendered) if r else ([], 0)
        self.notes.extend(r.notes if r else [])
        if status == "done" and failed:
            status = "failed"
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        wall = time.perf_counter() - self.t_start
        engine = self.engine.name if r else "none"
        report = build_report(job=str(self.job.path), out_dir=self.out_dir, device=device_name(self.device),
                              dtype=dtype_name(self.dtype), engine=engine, model=self.job.model,
                              timings=self.timings, wall_s=wall, rendered=rendered, skipped=self.skipped,
                              failed=failed, peak_mem_mb=peak, graphs=self.engine.describe() if r else [],
                              status=status, notes=self.notes)
        keep_last = (r is None or (status == "error" and not rendered)) and (self.out_dir / "report.json").exists()
        paths = None if keep_last else write_report(self.out_dir, report)
        return RenderResult(status, self.out_dir, rendered, skipped=self.skipped, failed=failed, wall_s=wall,
                            device=device_name(self.device), engine=engine, report=report, report_paths=paths,
                            notes=self.notes)

    def _close_writer(self, cancel: bool) -> None:
        try:
            if self.renderer:
                self.renderer.writer.close(cancel=cancel)
        except KeyboardInterrupt:
            pass


def render(job: Job, opts: RenderOptions = RenderOptions(), on_event: Callable[[Event], None] | None = None,
           models: SdxlModels | None = None, engine: Engine | None = None) -> RenderResult:
    """Renders every image of `job` that is not already done.

    `models` and `engine` may be passed in to reuse loaded weights and captured graphs (bench, tests)."""
    return RenderSession(job, opts, on_event, models, engine).execute()
