"""A worker: leases batches from the server, renders them with the model (and its engine) kept hot across
jobs, writes their PNGs into the job's folder exactly as `bcg render` writes them (atomically), and reports
back each image's manifest line and its own figures. The server is the one writer of the folder's manifest,
report and contact sheet, so any number of workers render batches of one job at once. The only serve module
that renders; it drives the engine through `RenderSession` (run/render.py), never directly.

Each job of a lease is one `LeaseSession`: a RenderSession whose pending images are the leased ones, with no
folder lock, no reconcile and no sheet, whose manifest lines are kept for the completion (`Recorder`) and
whose report is sent, not written. The lease's first job renders; the others ride in its batches, each image
delivered to its own job's sink. Images whose twin (same fingerprint) was rendered before are read from that
PNG and written through their sink, with their job's metadata. A worker that does not see the server's job
folders renders into copies of them under its --root and uploads the PNGs.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from storyboard_cli.errors import Status, StoryboardError, folder_error, one_line
from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.folder.outputs import Pending, atomic_write
from storyboard_cli.folder.sink import OutputSink
from storyboard_cli.job.digests import file_sha256
from storyboard_cli.job.file import Job, load_job
from storyboard_cli.job.inputs import InputProblem, Inputs
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.run.render import RenderOptions, RenderResult, RenderSession, warm
from storyboard_cli.serve.client import LeaseClient, QueueBusy, Unregistered
from storyboard_cli.serve.blobs import BlobStore
from storyboard_cli.serve.intake import JOBS, OUT, root_of
from storyboard_cli.serve.wire import NAME_PATTERN

log = logging.getLogger(__name__)
CACHED_BUCKET = "cached"  # the report's bucket row for copied twins
TWINS = "twins"  # under an uploading worker's root: twins' PNGs downloaded from the server
JOBS_KEPT = 16  # jobs a worker keeps loaded (their batches come in turn while they render)


@dataclass(frozen=True)
class WorkerOptions:
    server: str
    name: str = ""
    device: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    compile: str = "auto"
    fp8: bool = False  # the UNet's FP8 kernels (bcg render --fp8)
    token: str | None = None
    poll_s: float = 0.5
    max_leases: int | None = None  # stop after this many (tests); None: until stopped
    upload: bool = False  # send the PNGs back even when the server's job folders are visible here
    root: Path = Path("bcg-worker")  # copies of job folders, when the server's are not visible here
    warm: Path | None = None  # a job whose model and shapes are made ready before the first lease


@dataclass
class Hot:
    """The loaded models and engine, kept between leases while the model stays the same."""

    spec: tuple | None = None
    models: object = None
    engine: object = None
    warm: set[str] = field(default_factory=set)  # the mixes rendered with these models: the server leases them first
    runner: object = None  # the BatchRunner kept across leases: its caches, and the LoRA set applied, stay
    jobs: dict = field(default_factory=dict)  # (job id, its text, its inputs, its file) -> the Job, loaded once

    def job(self, job_id: str, leased: dict, where: Place) -> Job:
        """The leased job, validated once per worker (its control images decoded, its LoRA files read), not once
        per lease: a job's later batches find it here."""
        key = (job_id, leased.get("job_text"), tuple(sorted((leased.get("inputs") or {}).items())), where.job_file)
        if key not in self.jobs:
            while len(self.jobs) >= JOBS_KEPT:
                self.jobs.pop(next(iter(self.jobs)))
            self.jobs[key] = load_job(where.job_file, inputs=where.inputs)
        return self.jobs[key]

    @property
    def ready(self) -> bool:
        """The model loaded and its engine prepared: graphs captured (or kernels loaded) for the shapes of the
        batches rendered so far; what the server's /readyz waits for."""
        return self.engine is not None

    def for_job(self, job: Job) -> None:
        spec = (job.model, job.controlnet)
        lacking = job.controlnet is not None and self.models is not None and self.models.controlnet is None
        if spec != self.spec or lacking:  # another model, or a ControlNet the first job did not need
            self.spec, self.models, self.engine, self.runner = spec, None, None, None
            self.warm.clear()


@dataclass
class Outcome:
    done: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    stopped: bool = False
    work: dict = field(default_factory=dict)  # what the server's histograms and counters record
    records: dict[str, list[dict]] = field(default_factory=dict)  # job id -> manifest lines of its images written
    reports: dict[str, dict] = field(default_factory=dict)  # job id -> this lease's report of it


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


class LeaseSession(RenderSession):
    """One job's part of a lease: a RenderSession whose pending images are the leased ones. It writes their
    PNGs and nothing else of the folder: no lock (other workers render other batches of the job at once), no
    reconcile, no sheet; its manifest lines (`recorder`) and report (`report`) go back with the completion.
    The head session (the lease's first job) renders; the riders (other jobs' images in the same batches)
    only open their sink, and the head's policy delivers their images to them."""

    def __init__(self, job: Job, opts: RenderOptions, images: list[dict], hot: Hot):
        super().__init__(job, opts, None, hot.models, hot.engine)
        self.hot = hot
        self.images = images
        self.mine = {p for image in images for p in image["outputs"]}
        self.twins = {image["outputs"][0]: image["twin"] for image in images if image["twin"]}
        self.copied: set[str] = set()
        self.timed: list[dict] = []  # per rendered batch: shape, images, bucket, seconds
        self.riders: list[LeaseSession] = []
        self.sheet = NoSheet()
        self.recorder = Recorder()
        self.report: dict | None = None

    def lock(self):
        return nullcontext()  # the server writes the folder's manifest; PNGs land atomically

    def find_pending(self):
        items = [replace(i, outputs=tuple(p for p in i.outputs if p in self.mine))
                 for i in work_items(self.job) if self.mine.intersection(i.outputs)]
        return Pending(items=items), self.recorder

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

    def publish(self, report: dict, keep_last: bool):
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
        for batch in make_batches(rest, self.job.buckets):
            t0 = time.perf_counter()
            yield batch  # rendered before the loop asks for the next one
            self.timed.append({"shape": f"{batch.key.width}x{batch.key.height}", "images": len(batch.items),
                               "bucket": batch.size, "seconds": round(time.perf_counter() - t0, 4)})

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


class InputFiles:
    """Where this worker reads the files a leased job names, by their sha256: the server's blob store when this
    machine sees it (a shared filesystem; each blob's bytes checked once per process), else its own store under
    --root, each blob downloaded once (GET /v1/blobs/{sha256}) and checked as it arrives. `shared` False
    (--upload): the server's filesystem is not used even where it is visible."""

    def __init__(self, client: LeaseClient | None, root: Path, shared: bool = True):
        self.client, self.cache, self.checked, self.shared = client, BlobStore(root), set(), shared

    def for_job(self, job: dict) -> Inputs:
        server = BlobStore(root_of(Path(job["path"]))) if self.shared else None
        return Inputs(dict(job.get("inputs") or {}), blob=lambda digest, suffix: self.file(digest, suffix, server))

    def file(self, digest: str, suffix: str, server: BlobStore | None) -> Path:
        if server is not None and (digest in self.checked or (server.has(digest) and
                                                              _sha256(server.path(digest)) == digest)):
            self.checked.add(digest)
            try:
                return server.path(digest, suffix)
            except OSError:  # the server's store is read-only here: its named link is made in ours
                self.cache.adopt(server.path(digest))
        elif not self.cache.has(digest):
            self._download(digest)
        return self.cache.path(digest, suffix)

    def _download(self, digest: str) -> None:
        if self.client is None:
            raise InputProblem(f"sha256 {digest[:12]}... is not in the server's store as this machine sees it")
        writer = self.cache.writer(digest, None)
        try:
            with self.client.http.stream("GET", f"/v1/blobs/{digest}") as r:
                if r.status_code != 200:
                    raise InputProblem(f"sha256 {digest[:12]}...: the server answered HTTP {r.status_code}")
                for chunk in r.iter_bytes(1 << 20):
                    writer.write(chunk)
            writer.close()  # checks the digest
        except httpx.HTTPError as e:
            writer.abort()
            raise InputProblem(f"sha256 {digest[:12]}... not downloaded: {e}") from None
        except BaseException:
            writer.abort()
            raise


def _sha256(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None


def place(job_id: str, job: dict, opts: WorkerOptions, files: InputFiles | None = None) -> Place:
    """Where one job of a lease renders: the server's job folder when this worker sees the very job file the
    server saved (and --upload is off); else a copy under the worker's --root. Its files are read by sha256
    (`files`: from the server's blob store or this worker's)."""
    files = files or InputFiles(None, opts.root.resolve())
    inputs = files.for_job(job)
    server_file = Path(job["path"])
    if not opts.upload and _reads(server_file) == job["job_text"]:
        return Place(server_file, Path(job["out_dir"]), False, inputs)
    folder = opts.root.resolve() / JOBS / job_id
    job_file = folder / job["job_file"]
    if _reads(job_file) != job["job_text"]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(job_file, job["job_text"].encode())
        except OSError as e:
            raise folder_error(folder, e) from None
    return Place(job_file, folder / OUT, True, inputs)


def _reads(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def fetch_twins(lease: dict, places: dict[str, Place], client: LeaseClient, folder: Path) -> None:
    """An uploading worker cannot read the server's copy of a twin: it downloads it (or renders the image
    when that fails)."""
    for image in lease["images"]:
        if image["twin_url"] and places[image["job"]].upload:
            local = folder / f"{image['id']}.png"
            try:
                data = client.download(image["twin_url"])
                if data is not None:
                    atomic_write(local, data)
            except (httpx.HTTPError, OSError) as e:
                log.warning("twin %s not downloaded (%s): the image is rendered", image["twin_url"], e)
                data = None
            image["twin"] = str(local) if data is not None else None


def render_lease(lease: dict, hot: Hot, opts: WorkerOptions, places: dict[str, Place] | None = None) -> Outcome:
    """Renders one lease into its jobs' folders (or this worker's copies); which of its images landed,
    failed or are left."""
    out = Outcome()
    if places is None:  # the server's folders, seen here
        files = InputFiles(None, opts.root.resolve())
        places = {j: Place(Path(v["path"]), Path(v["out_dir"]), False, files.for_job(v)) for j, v in lease["jobs"].items()}
    sessions: dict[str, LeaseSession] = {}
    for job_id in sorted(lease["jobs"], key=lambda j: j != lease["job"]):  # the head first: it picks the models
        images = [i for i in lease["images"] if i["job"] == job_id]
        try:
            job = hot.job(job_id, lease["jobs"][job_id], places[job_id])
            if job_id == lease["job"]:
                hot.for_job(job)
            ropts = RenderOptions(out_dir=places[job_id].out_dir, device=opts.device, dtype=opts.dtype,
                                  engine=opts.engine, compile=opts.compile, fp8=opts.fp8)
            sessions[job_id] = LeaseSession(job, ropts, images, hot)
        except StoryboardError as e:
            out.failed.update({image["id"]: one_line(e) for image in images})
    head = sessions.pop(lease["job"], None)
    if head is None:  # the riders' images go back to the queue
        return out
    try:
        results = render_together(head, list(sessions.values()))
    except StoryboardError as e:
        out.failed.update({image["id"]: one_line(e) for image in lease["images"]})
        return out
    out.work = {"batches": head.timed, "out_of_memory": head.policy.out_of_memory if head.policy else 0,
                "model_loads": int(hot.models is None and head.models is not None)}
    if head.models is not None:
        hot.models, hot.engine = head.models, head.engine
    for session, result in results.items():
        failed = {f["path"]: f["reason"] for f in result.failed}
        written = session.recorder.records
        for image in session.images:
            paths = image["outputs"]
            reason = next((failed[p] for p in paths if p in failed), None)
            if reason is not None:
                out.failed[image["id"]] = reason
            elif all(p in written for p in paths):
                out.done.append(image["id"])
                if session.copied.issuperset(paths):
                    out.cached.append(image["id"])
        job_id = session.images[0]["job"]
        out.records[job_id] = list(written.values())
        if session.report is not None:
            out.reports[job_id] = session.report
    out.stopped = results[head].status == Status.INTERRUPTED
    return out


def gpu_stats(hot: Hot) -> dict | None:
    """The worker's GPU memory (torch.cuda) and, where nvidia-ml-py is installed, NVML's utilisation, power
    and energy (serve/nvml.py), once a model is loaded on one; None on a CPU or before the first load."""
    models = hot.models
    if models is None or models.device.type != "cuda":
        return None
    import torch

    from storyboard_cli.serve import nvml

    d = models.device
    props = torch.cuda.get_device_properties(d)
    return {"memory_allocated_bytes": torch.cuda.memory_allocated(d),
            "memory_reserved_bytes": torch.cuda.memory_reserved(d),
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(d),
            "total_memory_bytes": props.total_memory, **nvml.figures(f"GPU-{props.uuid}")}


class Heartbeat:
    """Renews a lease every third of its time to live while the lease renders (a thread: the render holds
    the main thread, and its signals)."""

    def __init__(self, client: LeaseClient, lease: dict, worker: str, hot: Hot):
        self.client, self.lease, self.done = client, lease, threading.Event()
        self.worker, self.hot = worker, hot
        self.lost = False
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def _beat(self) -> None:
        while not self.done.wait(self.lease["ttl"] / 3):
            try:
                if not self.client.heartbeat(self.lease["lease"], self.worker, gpu_stats(self.hot), self.hot.ready):
                    self.lost = True
            except (httpx.HTTPError, Unregistered) as e:  # Unregistered: the next lease request registers again
                log.warning("heartbeat failed: %s", e)


class _Stop:
    """SIGINT or SIGTERM between leases: stop before taking the next one."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True


def run_worker(opts: WorkerOptions) -> int:
    """The worker loop: register, lease, render, complete, until stopped (SIGINT/SIGTERM: the running batch
    finishes, the rest of the lease goes back to the queue). It registers again whenever the server no longer
    knows its id (a restart on a fresh root, or a registration that expired while it was stopped). Returns how
    many leases it rendered."""
    started = time.monotonic()
    name = opts.name or default_name()
    client, hot, stop = LeaseClient(opts.server, opts.token), Hot(), _Stop()
    files = InputFiles(client, opts.root.resolve(), shared=not opts.upload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    rendered, backoff = 0, opts.poll_s
    if opts.warm is not None:  # ready (/readyz) before any job arrives, and its first job starts at once
        job = load_job(opts.warm)
        hot.for_job(job)
        hot.models, hot.engine = warm(job, RenderOptions(device=opts.device, dtype=opts.dtype, engine=opts.engine,
                                                         compile=opts.compile, fp8=opts.fp8))
        log.info("warm: %s loaded, its shapes captured", job.model)
    worker = None  # the id the server issued
    try:
        while not stop.requested and (opts.max_leases is None or rendered < opts.max_leases):
            try:
                if worker is None:
                    worker = client.register(name)
                    log.info("registered with %s as %s (%s)", opts.server, worker, name)
                lease = client.lease(worker, gpu_stats(hot), hot.ready, hot.warm, time.monotonic() - started)
            except httpx.HTTPError as e:  # the server is restarting, or gone for a while
                log.info("no lease from %s: %s", opts.server, e)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            except QueueBusy as e:  # --max-workers are registered: one must leave (or expire) first
                log.warning("%s", e)
                _pause(e.retry_after, stop)
                continue
            except Unregistered as e:
                log.info("%s: registering again", e)
                worker = None
                continue
            backoff = opts.poll_s
            if lease is None:
                time.sleep(opts.poll_s)
                continue
            places = {job_id: place(job_id, job, opts, files) for job_id, job in lease["jobs"].items()}
            t0 = time.perf_counter()
            with Heartbeat(client, lease, worker, hot):
                fetch_twins(lease, places, client, opts.root.resolve() / TWINS)
                outcome = render_lease(lease, hot, opts, places)
                uploaded = upload(client, lease, outcome, places)
            t1 = time.perf_counter()
            rendered += 1
            hot.warm.update(i["mix"] for i in lease["images"] if i.get("mix") and i["id"] in outcome.done)
            if uploaded:
                _report(client, lease, outcome)
            batches = sum(b["seconds"] for b in outcome.work.get("batches", ()))
            log.info("lease %s: %d images in %.2f s (batches %.2f s, the rest: folder, PNGs, report, sheet), "
                     "completed in %.2f s", lease["lease"], len(lease["images"]), t1 - t0, batches,
                     time.perf_counter() - t1)
            stop.requested = stop.requested or outcome.stopped
    finally:
        client.close()
    return rendered


def default_name() -> str:
    """The host and process: unique on a machine (a host name that is not a valid worker name: `worker`)."""
    host = socket.gethostname()[:48]
    return f"{host if re.fullmatch(NAME_PATTERN, host) else 'worker'}-{os.getpid()}"


def _pause(seconds: float, stop: _Stop) -> None:
    """Sleeps `seconds`, or until SIGINT/SIGTERM."""
    deadline = time.monotonic() + seconds
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))


def upload(client: LeaseClient, lease: dict, outcome: Outcome, places: dict[str, Place]) -> bool:
    """Sends the finished PNGs of each job rendered in a copy to the server; False when the lease was lost
    meanwhile (the images are someone else's now)."""
    for job_id, where in places.items():
        if not where.upload:
            continue
        for path in [r["path"] for r in outcome.records.get(job_id, ())]:
            try:
                if not client.upload(lease["lease"], job_id, path, (where.out_dir / path).read_bytes()):
                    log.warning("lease %s was lost while uploading: its images went back to the queue", lease["lease"])
                    return False
            except (httpx.HTTPError, OSError) as e:  # the lease expires and is rendered again (from the copy)
                log.warning("uploading %s of lease %s: %s", path, lease["lease"], e)
                return False
    return True


def _report(client: LeaseClient, lease: dict, outcome: Outcome, tries: int = 5) -> None:
    for attempt in range(tries):
        try:
            if not client.complete(lease["lease"], outcome.done, outcome.cached, outcome.failed, outcome.work,
                                   outcome.records, outcome.reports):
                log.warning("lease %s was lost before it completed: the server ignored its results", lease["lease"])
            return
        except httpx.HTTPError as e:
            log.warning("completing lease %s: %s", lease["lease"], e)
            time.sleep(min(2 ** attempt, 10))
