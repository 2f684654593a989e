"""A lease rendered: each job of a lease is one `LeaseSession`, a RenderSession (run/render.py) whose pending
images are the leased ones, with no folder lock, no reconcile and no sheet, whose manifest lines are kept for
the completion (`Recorder`) and whose report is sent, not written. The lease's first job renders; the others
ride in its batches, each image delivered to its own job's sink (`Router`). Images whose twin (same
fingerprint) was rendered before are read from that PNG and written through their sink, with their job's
metadata. The models, engine, BatchRunner and validated jobs stay loaded across leases (`Hot`). Where each job
renders (`place`): the server's job folder, or this worker's copy of it under --root.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from storyboard_cli.errors import (DeviceUnusable, DiskFull, OutputUnwritable, OwnDiskUnusable, Status,
                                   StoryboardError, first_line, folder_error)
from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.folder.outputs import Pending, atomic_write, with_bases
from storyboard_cli.folder.report import Report
from storyboard_cli.folder.sink import OutputSink
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.file import Job, load_job
from storyboard_cli.job.inputs import Inputs
from storyboard_cli.job.plan import first_pass, make_batches, work_items
from storyboard_cli.job.preflight import unwritable
from storyboard_cli.run.oom import device_failure
from storyboard_cli.run.render import RenderOptions, RenderResult, RenderSession
from storyboard_cli.serve import wire
from storyboard_cli.serve.inputs_cache import InputFiles
from storyboard_cli.serve.intake import JOBS, OUT
from storyboard_cli.serve.wire import Lease, LeasedImage, LeasedJob
from storyboard_cli.serve.worker_options import WorkerOptions

log = logging.getLogger(__name__)
CACHED_BUCKET = "cached"  # the report's bucket row for copied twins
JOBS_KEPT = 16  # jobs a worker keeps loaded (their batches come in turn while they render)


@dataclass
class Hot:
    """The loaded models and engine, kept between leases while the model stays the same."""

    spec: tuple | None = None
    models: object = None
    engine: object = None
    warm: set[str] = field(default_factory=set)  # the mixes rendered with these models: the server leases them first
    runner: object = None  # the BatchRunner kept across leases: its caches, and the LoRA set applied, stay
    jobs: dict = field(default_factory=dict)  # (job id, its text, its inputs, its file) -> the Job, loaded once

    def job(self, job_id: str, leased: LeasedJob, where: Place) -> Job:
        """The leased job, validated once per worker (its control images decoded, its LoRA files read), not once
        per lease: a job's later batches find it here."""
        key = (job_id, leased.job_text, tuple(sorted(leased.inputs.items())), where.job_file)
        if key not in self.jobs:
            while len(self.jobs) >= JOBS_KEPT:
                self.jobs.pop(next(iter(self.jobs)))
            self.jobs[key] = load_job(where.job_file, inputs=where.inputs)
        return self.jobs[key]

    def drop_inputs(self, digests: set[str]) -> None:
        """Forgets the loaded jobs that name any of these input files (removed from this worker's store: their
        next lease loads the job again, and its files come again)."""
        for key in [k for k in self.jobs if any(digest in digests for _, digest in k[2])]:
            del self.jobs[key]

    @property
    def ready(self) -> bool:
        """The model loaded and its engine prepared: graphs captured (or kernels loaded) for the shapes of the
        batches rendered so far; what the server's /readyz waits for."""
        return self.engine is not None

    def forget(self) -> None:
        """Drops the models and engine (their device failed): the next lease loads them again."""
        self.spec, self.models, self.engine, self.runner = None, None, None, None
        self.warm.clear()

    def for_job(self, job: Job) -> None:
        """Drops the models unless they serve `job`; `spec` stays what the kept models were loaded for."""
        spec = (job.model, *(tuple(spec for _, spec in kind.models(job)) for kind in KINDS))
        m = self.models
        lacking = m is not None and any(kind.needs(job) and not kind.loaded(m, job) for kind in KINDS)
        if not self.covers(spec, job) or lacking:  # other models, or a kind's (a ControlNet) the first job did not need
            self.forget()
            self.spec = spec

    def covers(self, spec: tuple, job: Job) -> bool:
        """Whether the models loaded for `self.spec` are `job`'s (of `spec`): the same model and, kind by kind, the
        same models, or models the job does not need of a kind whose unused models stay (`Kind.kept_unused`: a
        ControlNet job's worker renders a job without one on its models, loading nothing)."""
        if self.spec is None or spec[0] != self.spec[0]:
            return False
        return all(mine == theirs or (kind.kept_unused and not kind.needs(job))
                   for kind, mine, theirs in zip(KINDS, self.spec[1:], spec[1:]))


@dataclass
class Outcome:
    """What a lease's render did, for its completion (`completion`: the wire body the worker sends)."""

    done: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    stopped: bool = False
    batches: list[wire.Batch] = field(default_factory=list)  # what the server's histograms record
    out_of_memory: int = 0
    model_loads: int = 0
    records: dict[str, list[dict]] = field(default_factory=dict)  # job id -> manifest lines of its images written
    reports: dict[str, Report] = field(default_factory=dict)  # job id -> this lease's report of it
    disk_full: str | None = None  # the job folders refused a write (its error, one line): the images not done go back
    unsent: dict[str, list[dict]] = field(default_factory=dict)  # job id -> lines of PNGs written that never landed

    def completion(self, worker: str) -> wire.Completion:
        """POST /v1/leases/{lease_id}/complete's body, from `worker` (this worker's id, the lease's holder)."""
        return wire.Completion(worker=worker, done=self.done, cached=self.cached,
                               failed={str(image): reason[:wire.MAX_TEXT] for image, reason in self.failed.items()},
                               batches=self.batches, out_of_memory=self.out_of_memory, model_loads=self.model_loads,
                               manifest={job_id: [wire.ManifestLine(**line) for line in lines]
                                         for job_id, lines in self.records.items()},
                               reports={job_id: wire.lease_report(r) for job_id, r in self.reports.items()},
                               # sent only when set: a server from before the field takes the body as it was
                               **({"disk_full": self.disk_full[:wire.MAX_TEXT]} if self.disk_full else {}))

    def landed(self, lease: Lease, on_server: Callable[[str, str], bool], full: str) -> None:
        """The server's job folders refused this lease's PNGs (`full`, one line: the disk full, or the folder
        read-only or not permitted): the images whose outputs are all on the server (`on_server(job id, path)`) stay
        done, with the manifest lines of what is there; the others are named neither done nor failed, so the
        completion sends them back to the queue with their attempts, and the server leases no batch until it can
        write there again."""
        images = {image.id: image for image in lease.images}
        kept = {i for i in self.done if all(on_server(images[i].job, p) for p in images[i].outputs)}
        self.done, self.cached = [i for i in self.done if i in kept], [i for i in self.cached if i in kept]
        self.unsent = {job: [r for r in lines if not on_server(job, r["path"])] for job, lines in self.records.items()}
        self.records = {job: [r for r in lines if on_server(job, r["path"])] for job, lines in self.records.items()}
        self.disk_full = full
        log.warning("lease %s: the server's job folders took no more PNGs (%s): %d of its %d images landed, the "
                    "others go back to the queue", lease.lease, full, len(kept), len(lease.images))


class Recorder:
    """Where a lease's manifest lines go: kept for the completion, in which the server records them (the
    job folder's manifest has one writer, the server)."""

    path = Path(MANIFEST)  # named in a write error

    def __init__(self):
        self.records: dict[str, dict] = {}

    def append(self, record: dict) -> None:
        self.records[record["path"]] = record

    def compact(self) -> None:
        pass


class NoSheet:
    """A lease's contact sheet: none (the server rebuilds the job's as batches land)."""

    path = None

    def update(self, failures, running: bool = False, final: bool = True) -> None:
        pass

    def thumb(self, shot: str, path: str, pixels) -> None:
        """No thumbnails either: they are the sheet's, made on the server."""


class LeaseSession(RenderSession):
    """One job's part of a lease: a RenderSession whose pending images are the leased ones. It writes their
    PNGs and nothing else of the folder: no lock (other workers render other batches of the job at once), no
    reconcile, no sheet; its manifest lines (`recorder`) and report (`report`) go back with the completion.
    The head session (the lease's first job) renders; the riders (other jobs' images in the same batches)
    only open their sink, and the head's policy delivers their images to them."""

    def __init__(self, job: Job, opts: RenderOptions, images: list[LeasedImage], hot: Hot,
                 on_event: Callable[[object], None] | None = None):
        super().__init__(job, opts, on_event, hot.models, hot.engine)
        self.on_build = on_event  # the kernel builds it waits for (--compile on) show progress too
        self.hot = hot
        self.images = images
        self.mine = {p for image in images for p in image.outputs}
        self.twins = {image.outputs[0]: image.twin for image in images if image.twin}
        self.copied: set[str] = set()
        self.timed: list[wire.Batch] = []  # per rendered batch: shape, images, bucket, seconds
        self.riders: list[LeaseSession] = []
        self.sheet = NoSheet()
        self.recorder = Recorder()
        self.report: Report | None = None

    def lock(self):
        return nullcontext()  # the server writes the folder's manifest; PNGs land atomically

    def find_pending(self):
        items = [replace(i, outputs=tuple(p for p in i.outputs if p in self.mine))
                 for i in work_items(self.job) if self.mine.intersection(i.outputs)]
        return Pending(items=with_bases(items, self.out_dir, self.job.model)), self.recorder

    def batch_runner(self):
        """The worker's runner, kept across leases while its models stay (a new one for new models)."""
        runner = self.hot.runner
        if runner is None or runner.models is not self.models or runner.engine is not self.engine:
            runner = self.hot.runner = super().batch_runner()
        else:
            runner.adopt(self.timings, self.job.loras.values())
        return runner

    def release(self, runner) -> None:
        pass  # the LoRA set stays applied for the next lease (a LoRA swap only when the set changes)

    def publish(self, report: Report, keep_last: bool) -> tuple[Report, None]:
        self.report = report  # sent with the completion; the server merges the job's
        return report, None

    def ride(self) -> None:
        """A rider's part of `prepare`: its pending images and its sink (no models)."""
        manifest = self.prepare_folder()
        if self.pending.items:
            self.sink = self.open_sink(manifest)

    def prepare(self, stop=None) -> None:
        super().prepare(stop)
        if self.policy is not None and self.riders:
            self.policy.sink = Router(self.sink, {id(i): r.sink for r in self.riders for i in r.pending.items})

    def work(self):
        mine = [(i, self) for batch in self.batches for i in batch.items]
        rest = [item for item, owner in mine + [(i, r) for r in self.riders for i in r.pending.items]
                if not owner.copy_twin(item)]
        for batch in make_batches(first_pass(rest), self.job.buckets):  # a rider's hires passes go back unrendered
            t0 = time.perf_counter()
            yield batch  # rendered before the loop asks for the next one
            self.timed.append(wire.Batch(shape=f"{batch.key.width}x{batch.key.height}", images=len(batch.items),
                                         bucket=batch.size, seconds=round(time.perf_counter() - t0, 4)))

    def copy_twin(self, item) -> bool:
        """Writes the item from its twin's PNG (its pixel data kept, the metadata its own), if there is one
        that can be read."""
        png = _read(self.twins.get(item.outputs[0]))
        if png is None:
            return False
        self.sink.copy(item, png, CACHED_BUCKET)
        self.copied.update(item.outputs)
        return True


class Router:
    """The sink a mixed batch is delivered to: each image goes to its own job's sink (the head's when it is
    the head's)."""

    def __init__(self, head: OutputSink, riders: dict[int, OutputSink]):
        self.head, self.riders = head, riders

    def _sink(self, item) -> OutputSink:
        return self.riders.get(id(item), self.head)

    def submit(self, item, pixels, bucket: str) -> None:
        self._sink(item).submit(item, pixels, bucket)

    def fail(self, items, reason: str) -> None:
        for item in items:
            self._sink(item).fail([item], reason)


def render_together(head: LeaseSession, riders: list[LeaseSession]) -> dict[LeaseSession, RenderResult]:
    """The head's render with the riders' images in its batches: each rider's sink open for the whole render,
    its report finished after."""
    with ExitStack() as held:
        for rider in riders:
            held.enter_context(rider.lock())
            rider.ride()
        head.riders = [r for r in riders if r.sink is not None]
        try:
            results = {head: head.execute()}
        except BaseException:
            for rider in head.riders:
                rider._close_writer(cancel=True, after_error=True)
            raise
        status = Status.INTERRUPTED if results[head].status == Status.INTERRUPTED else Status.DONE
        for rider in riders:
            if rider.sink is not None:
                rider.sink.close()
            results[rider] = rider.finish(status)
    return results


def _read(path: str | None) -> bytes | None:
    """The twin's PNG bytes; None when there is none or it is gone."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


@dataclass(frozen=True)
class Place:
    """Where a lease renders: the server's job folder (a shared filesystem), or this worker's copy of it,
    whose outputs are uploaded."""

    job_file: Path
    out_dir: Path
    upload: bool
    inputs: Inputs | None = None  # how the job's files are read: by sha256, never by a path the job gives


def place(job_id: str, job: LeasedJob, opts: WorkerOptions, files: InputFiles | None = None) -> Place:
    """Where one job of a lease renders: the server's job folder when this worker sees the very job file the
    server saved (and --upload is off); else a copy under the worker's --root. Its files are read by sha256
    (`files`: from the server's blob store or this worker's)."""
    files = files or InputFiles(None, opts.root.resolve())
    inputs = files.for_job(job)
    server_file = Path(job.path)
    if not opts.upload and _reads(server_file) == job.job_text:
        return Place(server_file, Path(job.out_dir), False, inputs)
    folder = opts.root.resolve() / JOBS / job_id
    job_file = folder / job.job_file
    if _reads(job_file) != job.job_text:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(job_file, job.job_text.encode())
        except OSError as e:  # this worker's own folder: its machine's fault
            raise OwnDiskUnusable(f"this worker's --root cannot be written: {folder_error(folder, e)}") from None
    return Place(job_file, folder / OUT, True, inputs)


def _reads(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def render_lease(lease: Lease, hot: Hot, opts: WorkerOptions, places: dict[str, Place] | None = None,
                 on_event: Callable[[object], None] | None = None) -> Outcome:
    """Renders one lease into its jobs' folders (or this worker's copies); which of its images landed,
    failed or are left. An image fails for its own job's error (its message, one line); DeviceUnusable (this
    machine's device, not the job) is raised: the worker gives the whole lease back. `on_event`: the render's
    progress (run/render.py Event, and the kernel builds' CompileEvent), the worker's sign that it is not stuck."""
    out = Outcome()
    if places is None:  # the server's folders, seen here
        files = InputFiles(None, opts.root.resolve())
        places = {j: Place(Path(v.path), Path(v.out_dir), False, files.for_job(v)) for j, v in lease.jobs.items()}
    sessions: dict[str, LeaseSession] = {}
    for job_id in sorted(lease.jobs, key=lambda j: j != lease.job):  # the head first: it picks the models
        images = [i for i in lease.images if i.job == job_id]
        shut = None if places[job_id].upload else unwritable(places[job_id].out_dir)
        if shut is not None:  # the server's job folder, read-only here: its images go back with their attempts
            out.disk_full = f"cannot write into the job's folder: {shut}"
            log.warning("lease %s: %s: its images of job %s go back to the queue", lease.lease, out.disk_full,
                        job_id)
            continue
        try:
            job = hot.job(job_id, lease.jobs[job_id], places[job_id])
            if job_id == lease.job:
                hot.for_job(job)
            ropts = RenderOptions(out_dir=places[job_id].out_dir, device=opts.device, dtype=opts.dtype,
                                  engine=opts.engine, compile=opts.compile, kernels=opts.kernels)
            sessions[job_id] = LeaseSession(job, ropts, images, hot, on_event)
        except DeviceUnusable:
            raise
        except StoryboardError as e:
            out.failed.update({image.id: first_line(e) for image in images})
    head = sessions.pop(lease.job, None)
    if head is None:  # the riders' images go back to the queue
        return out
    try:
        results = render_together(head, list(sessions.values()))
    except DeviceUnusable:
        raise
    except StoryboardError as e:
        if isinstance(e, OutputUnwritable) and e.path is not None:
            if opts.root.resolve() in Path(e.path).resolve().parents:  # its own copies: its machine's fault
                state = "is full" if isinstance(e, DiskFull) else "cannot be written"
                raise OwnDiskUnusable(f"this worker's --root {state}: {first_line(e)}") from None
            # the server's job folders, shared: what landed is done, the rest goes back to the queue
            for session in (head, *sessions.values()):
                _collect(out, session, {})
            out.batches = head.timed
            out.landed(lease, lambda job, path: True, first_line(e))
            return out
        out.failed.update({image.id: first_line(e) for image in lease.images})
        return out
    except RuntimeError as e:  # a CUDA error loading the models or capturing the graphs: the device's, not the job's
        raise device_failure(e) or e
    out.batches = head.timed
    out.out_of_memory = head.policy.out_of_memory if head.policy else 0
    out.model_loads = int(hot.models is None and head.models is not None)
    if head.models is not None:
        hot.models, hot.engine = head.models, head.engine
    for session, result in results.items():
        _collect(out, session, {f["path"]: f["reason"] for f in result.failed})
        if session.report is not None:
            out.reports[session.images[0].job] = session.report
    out.stopped = results[head].status == Status.INTERRUPTED
    return out


def _collect(out: Outcome, session: LeaseSession, failed: dict[str, str]) -> None:
    """A job's images in the outcome: failed (`failed`: output path -> reason), done (every output written: its
    manifest line recorded), or neither (left: they go back to the queue)."""
    written = session.recorder.records
    for image in session.images:
        paths = image.outputs
        reason = next((failed[p] for p in paths if p in failed), None)
        if reason is not None:
            out.failed[image.id] = reason
        elif all(p in written for p in paths):
            out.done.append(image.id)
            if session.copied.issuperset(paths):
                out.cached.append(image.id)
    out.records[session.images[0].job] = list(written.values())
