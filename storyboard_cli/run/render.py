"""plan -> engine -> outputs. The orchestrator, in three phases: prepare, run, finish. Never prints.

`RenderSession` holds one render; its phases are methods, so a subclass hooks in at exactly those
points (a multi-GPU worker claims its batches in `work`, the contact sheet is written in `finish`).
`OutOfMemoryPolicy` (oom.py) runs each batch; `OutputSink` (folder/sink.py) writes.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from storyboard_cli.engine.base import Engine, Shape
from storyboard_cli.engine.build import build_engine, check_engine, device_name, dtype_name, resolve_device
from storyboard_cli.engine.device import probe
from storyboard_cli.engine.variants import AUTO
from storyboard_cli.costs import EAGER, device_of
from storyboard_cli.errors import JobError, Status, StoryboardError, folder_error, one_line
from storyboard_cli.folder.layout import REPLACED, REPORT_JSON
from storyboard_cli.folder.lock import OutputLock
from storyboard_cli.folder.outputs import Manifest, Pending, pending_items, previous_failures, remove_stale_temps, select_shots
from storyboard_cli.folder.report import Report, Timings, job_conditions, write_report
from storyboard_cli.folder.shards import merge_shards
from storyboard_cli.folder.sink import ContactSheet, OutputSink
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.estimate import Observed, adapted, observe
from storyboard_cli.job.file import Job
from storyboard_cli.job.plan import (Batch, WorkItem, base_item, check_models, deepcache_note, first_pass,
                                    make_batches, planned_passes, render_batches, second_pass, shot_levers,
                                    work_items)
from storyboard_cli.job.preflight import check_destination, job_spec
from storyboard_cli.job.prompts import long_prompts
from storyboard_cli.models.loader import SdxlModels, load_sdxl
from storyboard_cli.run.batch import BatchRunner, batch_kinds, batch_shapes, bucket_label
from storyboard_cli.run.oom import OutOfMemoryPolicy
from storyboard_cli.run.signals import StopFlag, Stopped, stop_signals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderOptions:
    out_dir: Path | None = None
    force: bool = False
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: fp16 on cuda, fp32 on cpu
    engine: str = "auto"  # auto | graph | eager
    retry_failed: bool = False
    compile: str = "auto"  # auto | on | off: compiled kernels inside the graphs
    shots: tuple[str, ...] = ()  # only these shots (ids or glob patterns); () for all
    kernels: str = AUTO  # the kernels' row by name (engine/variants.py: auto, compiled, fp8, plain)


@dataclass
class Event:
    kind: str  # "start" | "batch" | "progress" (a batch delivered) | "image" | "failed" | "stopping"
    done: int = 0
    total: int = 0
    shot: str = ""
    message: str = ""


@dataclass
class RenderResult:
    status: str  # a Status: done, failed (some images), interrupted; error is never returned (it raises)
    out_dir: Path
    rendered: int
    skipped: int
    failed: list[dict]
    wall_s: float
    device: str
    engine: str
    report: Report
    report_paths: tuple[Path, Path] | None
    notes: list[str] = field(default_factory=list)
    signal: int | None = None  # what stopped an interrupted render
    sheet: Path | None = None  # index.html, when it could be written


def settle_folder(job: Job, out_dir: Path, force: bool = False, only: set[str] | None = None,
                  shots: set[str] | None = None) -> tuple[Pending, Manifest, list[str]]:
    """The folder made whole after whatever ended the last writer: its stale temp files removed, the shards of
    a multi-GPU run merged (dist.py), and the manifest reconciled with the files (a line for each image a
    killed writer renamed into place but did not record). Returns what is left to render, the manifest and the
    images it recorded for such a writer."""
    remove_stale_temps(out_dir)
    merge_shards(out_dir)
    manifest = Manifest(out_dir)
    pending = pending_items(job, out_dir, force, only, shots, manifest.records)
    recovered = manifest.reconcile(pending.found)
    return pending, manifest, recovered


def check_options(opts: RenderOptions) -> None:
    """The engine options against each other and the device, and the device tried once, before a model is loaded (a
    worker: before it registers, so a worker that cannot render here stops at once instead of taking leases)."""
    device = resolve_device(opts.device, opts.dtype)[0]
    check_engine(opts.engine, opts.compile, device, opts.kernels)
    probe(device)


def model_specs(job: Job, items: list) -> tuple:
    """What `load_models` loads for these items: (model, ControlNets, IP-Adapter, image encoder, regions); the
    ControlNets only when an item has a control image, the adapter only when one has a reference, the regions'
    attention only when one has regions."""
    def opened(spec):
        if isinstance(spec, int):  # a kind's number (the region slots), not a model
            return spec
        return tuple(opened(s) for s in spec) if isinstance(spec, tuple) else job_spec(spec, job.folder)

    return opened(job.model), *(opened(spec) for kind in KINDS for spec in kind.used_models(job, items))


def load_models(job: Job, items: list, device: torch.device, dtype: torch.dtype) -> SdxlModels:
    """The job's model, with its ControlNets and IP-Adapter where `items` use them (`model_specs`)."""
    model, nets, *kinds = model_specs(job, items)  # the kinds' arguments after the ControlNets, in KINDS order
    return load_sdxl(model, nets, device, dtype, *kinds)


def warm(job: Job, opts: RenderOptions) -> tuple[SdxlModels, Engine]:
    """A job's model loaded and every shape of its batches captured (compiled kernels loaded or built as
    `opts.compile` says), nothing rendered: what a long-lived worker does before its first job."""
    device, dtype = resolve_device(opts.device, opts.dtype)
    kernels = check_engine(opts.engine, opts.compile, device, opts.kernels)
    check_models(job)
    items = work_items(job)
    batches = render_batches(job, items)  # the hires passes' shapes too
    shapes = batch_shapes(batches)
    models = load_models(job, items, device, dtype)
    engine = build_engine(models, opts.engine, shapes, [], opts.compile, kernels=kernels)
    engine.prepare(shapes, batch_kinds(batches))
    return models, engine


class RenderSession:
    """One render of one job into one folder: `execute` runs prepare -> run -> finish."""

    on_build: Callable[[object], None] | None = None  # the events of the kernel builds the engine waits for

    def __init__(self, job: Job, opts: RenderOptions, on_event: Callable[[Event], None] | None = None,
                 models: SdxlModels | None = None, engine: Engine | None = None):
        self.t_start, self.started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.job, self.opts, self.models, self.engine = job, opts, models, engine
        self.on_event = on_event or (lambda e: None)
        self.device, self.dtype = (models.device, models.dtype) if models else resolve_device(opts.device, opts.dtype)
        # even when nothing turns out to be pending; the kernels' row by name, as the engine is built with
        self.kernels = check_engine(opts.engine, opts.compile, self.device, opts.kernels)
        self.out_dir = Path(opts.out_dir) if opts.out_dir else job.output_dir
        check_destination(self.out_dir)
        if models is None:
            check_models(job)
        self.shots = select_shots(job, opts.shots)
        self.timings = Timings(sync=torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.notes: list[str] = []
        self.pending = Pending()
        self.batches: list[Batch] = []
        self.sheet = ContactSheet(self.out_dir, job, self.notes)
        self.sink: OutputSink | None = None
        self.policy: OutOfMemoryPolicy | None = None

    def execute(self) -> RenderResult:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.lock(), stop_signals(self._stopping) as stop:
            status, error = Status.ERROR, None
            try:
                self.prepare(stop)
                status = self.run(stop)
            except BaseException as raised:
                e = stop.cause(raised)
                if not isinstance(e, (Stopped, KeyboardInterrupt)):
                    error = str(e) if isinstance(e, StoryboardError) else f"{e.__class__.__name__}: {e}"
                    self._close_writer(cancel=True, after_error=True)
                    raise
                if e is not raised:
                    log.debug("the stop came up as %s", one_line(raised))
                status = Status.INTERRUPTED  # decoded images are written out; a second Ctrl-C drops the queued ones
                self._close_writer(cancel=isinstance(e, KeyboardInterrupt))
            finally:
                stop.finishing = True
                result = self.finish(status, stop.signum if status == Status.INTERRUPTED else None, error)
        return result

    def _stopping(self, message: str) -> None:
        self.on_event(Event("stopping", message=message))

    # hooks: a multi-GPU worker takes the lock on one rank only, shares what is pending, publishes a
    # merged report

    def lock(self):
        """The folder lock, held for the whole render."""
        return OutputLock(self.out_dir)

    def find_pending(self) -> tuple[Pending, Manifest]:
        """Reconciles the folder and its manifest; returns what is left to render (and what was kept or
        is to be set aside) and the manifest the new lines go to."""
        only = previous_failures(self.out_dir) if self.opts.retry_failed else None
        if only is not None and not only:
            self.notes.append("--retry-failed: the last report lists no failed images")
        return settle_folder(self.job, self.out_dir, self.opts.force, only, self.shots)[:2]

    def publish(self, report: Report, keep_last: bool) -> tuple[Report, tuple[Path, Path] | None]:
        """Writes the report (unless the last one is kept); returns the report and its paths."""
        return report, None if keep_last else write_report(self.out_dir, report)

    def batch_runner(self) -> BatchRunner:
        """The runner of this render's batches, its job's LoRA files read and registered."""
        return BatchRunner(self.models, self.engine, self.timings, loras=self.job.loras.values())

    def release(self, runner: BatchRunner) -> None:
        """After the render: the models' own weights back (after LoRAs), for whoever holds them next."""
        runner.close()

    def owns_done_bases(self) -> bool:
        """Whether this session renders the hires passes whose bases were on disk before it started (a multi-GPU
        render: one worker does)."""
        return True

    def capture_ahead(self, shapes: list[Shape]) -> list[Shape]:
        """The shapes the engine captures before the first batch; the others are captured on first use."""
        return shapes

    # phases

    def prepare(self, stop: StopFlag | None = None) -> None:
        """Reconciles the folder and its manifest and finds the images left to render; then (only when
        there is something to render) plans them, loads the models and prepares the engine."""
        stop = stop or StopFlag()
        manifest = self.prepare_folder()
        if not self.pending.items:
            return
        self.batches = make_batches(first_pass(self.pending.items), self.job.buckets)
        shapes = batch_shapes(self.batches)
        later = batch_shapes(make_batches(planned_passes(self.job, self.pending.items), self.job.buckets))
        with self.timings.stage("load"):
            if self.models is None:
                self.models = load_models(self.job, self.pending.items, self.device, self.dtype)
        stop.check()
        with self.timings.stage("capture"):
            if self.engine is None:
                self.engine = build_engine(self.models, self.opts.engine, shapes + later, self.notes,
                                           self.opts.compile, self.on_build, self.kernels)
        with self.timings.stage("load"):  # the LoRAs are read and registered before anything is captured
            runner = self.batch_runner()
        self.notes.extend(f"{why}: the shots that use LoRA '{name}' fail" for name, why in runner.unusable.items())
        with self.timings.stage("capture"):
            # each batch's graphs that need no warm-up are captured beside the loop before it (BatchRunner.run_batch);
            # the shapes not captured ahead are the engine's too (their kernels wanted, its buffers fit them)
            ahead = self.capture_ahead(shapes)
            self.engine.prepare(ahead, batch_kinds(self.batches), [s for s in shapes if s not in ahead] + later,
                                beside=True)
        stop.check()
        self.sink = self.open_sink(manifest)
        self.policy = OutOfMemoryPolicy(runner, self.sink)

    def prepare_folder(self) -> Manifest:
        """The folder half of `prepare`: reconciled, what is pending found, the sheet marked running;
        returns the manifest the new lines go to."""
        try:
            self.pending, manifest = self.find_pending()
        except OSError as e:
            raise folder_error(self.out_dir, e) from None
        self.notes.extend(self.pending.edited_notes(self.out_dir / REPLACED / self.run_id))
        self.notes.extend(f"prompt cut: {w}" for w in long_prompts(self.job))  # the report lists them too
        self.notes.extend(filter(None, [deepcache_note(self.job)]))
        self.sheet.update([], running=True)
        total = self.pending.outputs
        self.on_event(Event("start", 0, total, "", f"{total} to render, {self.pending.skipped} already done"))
        return manifest

    def open_sink(self, manifest: Manifest) -> OutputSink:
        total = self.pending.outputs
        emit = lambda kind, done, shot, message: self.on_event(Event(kind, done, total, shot, message))  # noqa: E731
        return OutputSink(self.job, self.out_dir, manifest, self.pending, self.run_id, self.sheet, self.timings, emit)

    def work(self) -> Iterable[Batch]:
        return self.batches  # the batches this session renders, in order

    def run(self, stop: StopFlag | None = None) -> str:
        """Batches -> images on disk, then the hires passes of the bases this session rendered (or found done).
        Returns "done"; a stop request raises Stopped at a batch boundary (what was denoised before it is still
        decoded and written)."""
        r, stop = self.policy, stop or StopFlag()
        if r is None:
            return Status.DONE
        total, shown = self.pending.outputs, 0

        def progress(batch: Batch) -> None:  # a line per delivery: none while the first batch's decode is in flight
            nonlocal shown
            if self.sink.delivered > shown:
                shown = self.sink.delivered
                self.on_event(Event("progress", shown, total, batch.items[-1].shot, batch.key.label))

        def loop(batches: Iterable[Batch]) -> set[str]:
            done, last = set(), None
            # the batches after each one, where the order is known ahead (a torchrun worker claims them one at a time)
            listed = batches if isinstance(batches, list) else None
            try:
                for i, batch in enumerate(batches):
                    stop.check()
                    self.on_event(Event("batch", self.sink.delivered, total, batch.items[0].shot, batch.key.label))
                    upcoming = listed[i + 1:] if listed is not None else ()
                    # delivers the batch before (this one's decode is in flight)
                    r.process(batch, self.job.buckets, upcoming=upcoming)
                    done.update(p for i in batch.items for p in i.outputs)
                    progress(batch)
                    last = batch
                stop.check()
            except Stopped:
                r.flush()
                raise
            r.flush()
            if last is not None:
                progress(last)
            return done

        rendered = loop(self.work())
        passes = self.second_passes(rendered)
        if passes:
            loop(make_batches(passes, self.job.buckets))
        t0 = time.perf_counter()
        self.sink.close()
        self.timings.expose("save", time.perf_counter() - t0)  # the writes still queued when the last image was decoded
        return Status.DONE

    def second_passes(self, rendered: set[str]) -> list[WorkItem]:
        """The hires passes this session renders next (`rendered`: the outputs of the batches it ran): each
        one's base upscaled and denoised again (job/plan.py `second_pass`), once its file has landed. One whose
        base could not be rendered or read fails with the reason."""
        pending_bases = {p for i in first_pass(self.pending.items) for p in i.outputs}
        hires = [i for i in self.pending.items if i.hires is not None]
        mine = [i for i in hires if base_item(i).outputs[0] in rendered
                or (base_item(i).outputs[0] not in pending_bases and self.owns_done_bases())]
        if not mine:
            return []
        self.sink.drain()
        passes = []
        for item in mine:
            try:
                passes.append(second_pass(self.job, item, self.out_dir))
            except JobError as e:
                self.sink.fail([item], f"its first pass: {e.message}")
        return passes

    def finish(self, status: str, signum: int | None = None, error: str | None = None) -> RenderResult:
        """The manifest compacted, the report (a run that rendered nothing keeps the last one, and its
        failure list for --retry-failed), the contact sheet, and the result."""
        s = self.sink
        failed, rendered = (s.failed, s.rendered) if s else ([], 0)
        self.notes.extend(self.policy.notes if self.policy else [])
        if status == Status.DONE and failed:
            status = Status.FAILED
        if s:
            try:
                s.manifest.compact()
            except OSError as e:
                self.notes.append(f"manifest not compacted: {e}")
        wall = time.perf_counter() - self.t_start
        report = self._report(status, rendered, failed, wall, signum, error)
        keep_last = ((s is None and status == Status.DONE) or (status == Status.ERROR and not rendered)) \
            and (self.out_dir / REPORT_JSON).exists()
        paths = None
        try:
            report, paths = self.publish(report, keep_last)
        except OSError as e:
            if status != Status.ERROR:  # else the error being raised says more than this one
                raise folder_error(self.out_dir, e) from None
        self.sheet.update(report.failures)  # every worker's, after a multi-GPU run
        if self.policy and rendered and report.workers is None:  # one process's figures, not a merge of several
            self.record_costs(report)
        if self.policy:
            self.release(self.policy.runner)
        return RenderResult(report.status, self.out_dir, report.images_rendered, skipped=self.pending.skipped,
                            failed=report.failures, wall_s=wall, device=device_name(self.device),
                            engine=report.engine, report=report, report_paths=paths, notes=report.notes,
                            signal=signum, sheet=self.sheet.path)

    def record_costs(self, report: Report) -> None:
        """This render's timings into the cache's cost table (job/estimate.py `observe`): the next `bcg plan` on this
        machine is calibrated on it. Its variant: the one most of its graphs ran (GraphStats.ran; the eager engine's
        "eager"), the one an estimate of the same kernels looks up."""
        ran = [g["variant"] for g in report.graphs if g.get("variant")]
        variant = max(set(ran), key=ran.count) if ran else EAGER
        shapes = {bucket_label(b): b for b in self.batches}
        buckets = [(shapes[row["bucket"]], row) for row in report.buckets if row["bucket"] in shapes]
        items = [i for b in self.batches for i in b.items]
        try:
            observe(Observed(device_of(report.device), self.job.model, variant, buckets, report.stages_s,
                             report.hidden_s or {}, time.perf_counter() - self.t_start, len(items),
                             sum(i.width * i.height for i in items) / 1e6,
                             len(set(batch_shapes(self.batches))), adapted(self.job)))
        except OSError as e:  # a cache that cannot be written costs the next estimate its calibration, nothing else
            log.debug("cost table not written: %s", e)

    def _report(self, status: str, rendered: int, failed: list[dict], wall: float, signum: int | None,
                error: str | None) -> Report:
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        ran = self.policy is not None
        return Report.build(job=str(self.job.path), out_dir=self.out_dir, device=device_name(self.device),
                            dtype=dtype_name(self.dtype), engine=self.engine.name if ran else "none",
                            model=self.job.model, timings=self.timings, wall_s=wall, rendered=rendered,
                            skipped=self.pending.skipped, failed=failed, peak_mem_mb=peak,
                            graphs=self.engine.describe() if ran else [], status=status, notes=self.notes,
                            run={"id": self.run_id, "started": self.started,
                                 "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                            stopped_by=signum, error=error,
                            lora_swaps=self.policy.runner.lora_swaps() if ran else None,
                            shots=shot_levers(self.job), conditions=job_conditions(self.job))

    def _close_writer(self, cancel: bool, after_error: bool = False) -> None:
        try:
            if self.sink:
                self.sink.close(cancel=cancel)
        except KeyboardInterrupt:
            pass
        except (StoryboardError, OSError) as e:
            if not after_error:
                raise
            # the first error is the one reported: a full disk fails every queued image alike
            log.debug("writer: %s", e)


def render(job: Job, opts: RenderOptions = RenderOptions(), on_event: Callable[[Event], None] | None = None,
           models: SdxlModels | None = None, engine: Engine | None = None) -> RenderResult:
    """Renders every image of `job` that is not already done.

    `models` and `engine` may be passed in to reuse loaded weights and captured graphs (bench, tests)."""
    return RenderSession(job, opts, on_event, models, engine).execute()
