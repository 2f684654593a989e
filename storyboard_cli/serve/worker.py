"""A worker: leases batches from the server, renders them with the model (and its engine) kept hot across
jobs, writes their PNGs into the job's folder exactly as `bcg render` writes them (atomically), and reports
back each image's manifest line and its own figures. The server is the one writer of the folder's manifest,
report and contact sheet, so any number of workers render batches of one job at once. Of the serve modules,
only this loop and the lease render it calls (lease_session.py) import torch; that render drives the engine
through `RenderSession` (run/render.py), never directly. A worker that does not see the server's job folders
renders into copies of them under its --root (inputs_cache.py reads their files by sha256) and uploads the
PNGs.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from storyboard_cli.errors import DeviceUnusable, OwnDiskUnusable, first_line
from storyboard_cli.folder.outputs import atomic_write
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, check_options, warm
from storyboard_cli.serve import wire
from storyboard_cli.serve.client import QueueBusy, ServerError
from storyboard_cli.serve.inputs_cache import InputFiles
from storyboard_cli.serve.lease_client import LeaseClient, ServerFull, Unregistered
from storyboard_cli.serve.lease_session import Hot, Outcome, Place, place, render_lease
from storyboard_cli.serve.wire import NAME_PATTERN, Lease, LeasedImage
from storyboard_cli.serve.worker_options import WorkerOptions

log = logging.getLogger(__name__)
TWINS = "twins"  # under an uploading worker's root: twins' PNGs downloaded from the server
STALLED = 75  # the exit status of a worker whose render stopped progressing (sysexits' EX_TEMPFAIL: start it again)
MAX_BACKOFF_S = 10.0  # the longest wait between two calls to a server that cannot be reached (registered: lease_s / 3)


def fetch_twins(lease: Lease, places: dict[str, Place], client: LeaseClient, folder: Path) -> Lease:
    """The lease as this worker renders it: an uploading worker cannot read the server's copy of a twin, so
    its images' `twin` is the copy it downloads (None when that fails: the image is rendered)."""
    return lease.model_copy(update={"images": [_fetch_twin(image, client, folder)
                                               if image.twin_url and places[image.job].upload else image
                                               for image in lease.images]})


def _fetch_twin(image: LeasedImage, client: LeaseClient, folder: Path) -> LeasedImage:
    local = folder / f"{image.id}.png"
    try:
        data = client.download(image.twin_url)
        if data is not None:
            atomic_write(local, data)
    except (httpx.HTTPError, OSError) as e:
        log.warning("twin %s not downloaded (%s): the image is rendered", image.twin_url, e)
        data = None
    return image.model_copy(update={"twin": str(local) if data is not None else None})


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


class Pulse:
    """The lease render's last sign of progress: a batch begun or delivered, a kernel build it waits for still
    running (`__call__`, the render's events). `watch()` while the render runs: the heartbeat reads `quiet_s`."""

    def __init__(self):
        self.at, self.last, self.watching = time.monotonic(), "the lease began", False

    def __call__(self, event) -> None:
        self.at, self.last = time.monotonic(), _sign(event)

    @contextmanager
    def watch(self):
        self("the render began")
        self.watching = True
        try:
            yield self
        finally:
            self.watching = False

    def quiet_s(self) -> float:
        """Seconds since the last sign of progress while the render runs; 0 outside it."""
        return time.monotonic() - self.at if self.watching else 0.0


def _sign(event) -> str:
    if isinstance(event, str):
        return event
    kind = getattr(event, "kind", None)
    if kind is not None:  # run/render.py Event
        return f"{kind} ({event.done} of {event.total} images delivered)" if event.total else kind
    return f"{getattr(event, 'module', 'a kernel build')}: {getattr(event, 'state', '')}"  # a CompileEvent


class Heartbeat:
    """Renews a lease every third of its time to live while the lease renders (a thread: the render holds
    the main thread, and its signals). A render that shows no progress (`Pulse`) for --stall-s is stuck: its
    device hung (a kernel that never ends, a driver or a mount that stopped answering), which no exception
    reports and the main thread cannot leave. The heartbeat then says so, stops renewing and calls `on_stall`
    (`bcg worker`'s: the process ends, STALLED): the lease expires, its images go back to the queue with an
    attempt spent (an image that stalls every worker fails, as a lost one does), and a supervisor (bcg serve's
    local workers, systemd, Kubernetes, the Slurm script) starts the worker again on a fresh device context."""

    def __init__(self, client: LeaseClient, lease: Lease, worker: str, hot: Hot, pulse: Pulse | None = None,
                 stall_s: float = 0.0, on_stall: Callable[[], None] = lambda: None):
        self.client, self.lease, self.done = client, lease, threading.Event()
        self.worker, self.hot = worker, hot
        self.pulse, self.stall_s, self.on_stall = pulse or Pulse(), stall_s, on_stall
        self.lost = False
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def _beat(self) -> None:
        failing = False  # while heartbeats fail: one line per outage, not per beat
        while not self.done.wait(self.lease.ttl / 3):
            if self.stall_s and self.pulse.quiet_s() > self.stall_s:
                self._stalled()
                return
            try:
                beat = wire.WorkerReport(worker=self.worker, gpu=gpu_stats(self.hot), ready=self.hot.ready)
                if not self.client.heartbeat(self.lease.lease, beat):
                    self.lost = True
            except (httpx.HTTPError, Unregistered) as e:  # Unregistered: the next lease request registers again
                if not failing:
                    log.warning("heartbeat of lease %s failed: %s (the batch renders on; said again only once it "
                                "answers)", self.lease.lease, first_line(e, 200) or e.__class__.__name__)
                failing = True
                continue
            if failing:
                log.warning("heartbeat of lease %s answered again", self.lease.lease)
                failing = False

    def _stalled(self) -> None:
        log.error("lease %s: no progress for %.0f s (the last: %s; --stall-s %g): the device or a file it reads "
                  "stopped answering. This worker exits (status %d) without renewing the lease: its images go "
                  "back to the queue when it expires, and its supervisor starts it again", self.lease.lease,
                  self.pulse.quiet_s(), self.pulse.last, self.stall_s, STALLED)
        self.on_stall()  # the main thread is stuck in the device: no exception reaches it


class _Stop:
    """SIGINT or SIGTERM between leases: stop before taking the next one."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True


def run_worker(opts: WorkerOptions, on_stall: Callable[[], None] = lambda: None) -> int:
    """The worker loop: register, lease, render, complete, until stopped (SIGINT/SIGTERM: the running batch
    finishes, the rest of the lease goes back to the queue). It registers again whenever the server no longer
    knows its id (a restart on a fresh root, or a registration that expired while it was stopped). Returns how
    many leases it rendered. `on_stall`: called from the heartbeat's thread when a lease's render shows no
    progress for --stall-s (`Heartbeat`); `bcg worker` ends the process there."""
    started = time.monotonic()
    name = opts.name or default_name()
    render_opts = RenderOptions(device=opts.device, dtype=opts.dtype, engine=opts.engine, compile=opts.compile,
                                kernels=opts.kernels)
    check_options(render_opts)  # before registering: a worker that cannot render here takes no lease
    client, hot, stop = LeaseClient(opts.server, opts.token), Hot(), _Stop()
    files = InputFiles(client, opts.root.resolve(), shared=not opts.upload, max_bytes=int(opts.max_inputs_gb * 2**30))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    rendered, backoff, unreachable, retry = 0, opts.poll_s, False, _Retry(MAX_BACKOFF_S, stop)
    full = False  # the server's disk full (its queue cannot be written): said once, until it answers again
    if opts.warm is not None:  # ready (/readyz) before any job arrives, and its first job starts at once
        job = load_job(opts.warm)
        hot.for_job(job)
        hot.models, hot.engine = warm(job, render_opts)
        log.info("warm: %s loaded, its shapes captured", job.model)
    worker = None  # the id the server issued
    try:
        while not stop.requested and (opts.max_leases is None or rendered < opts.max_leases):
            try:
                if worker is None:
                    registered = client.register(name)
                    worker = registered.worker
                    # a server that starts again counts its workers as seen then, for lease_s (Store.restarted): a
                    # worker that asks again within that keeps its id, its calibration and its lease
                    retry = _Retry(max(min(MAX_BACKOFF_S, registered.lease_s / 3), opts.poll_s), stop)
                    log.info("registered with %s as %s (%s)", opts.server, worker, name)
                lease = client.lease(wire.WorkerReport(worker=worker, gpu=gpu_stats(hot), ready=hot.ready,
                                                       warm=sorted(hot.warm)[-wire.MAX_WARM:],
                                                       uptime_s=round(time.monotonic() - started, 3)))
            except (httpx.HTTPError, ServerFull) as e:  # restarting, gone for a while, or its disk full: wait for it
                if isinstance(e, ServerFull):  # it answers, but cannot lease
                    if not full:  # once per outage, not once per retry
                        log.warning("%s: asking again every %.0f s at most", first_line(e, 300), retry.backoff_s)
                    full = True
                else:
                    if not unreachable:
                        log.warning("cannot reach %s (%s): retrying every %.0f s at most until it answers",
                                    opts.server, first_line(e, 200) or e.__class__.__name__, retry.backoff_s)
                    unreachable = True
                time.sleep(min(backoff, retry.backoff_s))
                backoff = min(backoff * 2, retry.backoff_s)
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
            if unreachable or full:
                log.warning("%s answers again", opts.server)
                unreachable = full = False
            if lease is None:
                time.sleep(opts.poll_s)
                continue
            t0, places, pulse = time.perf_counter(), {}, Pulse()
            try:
                with Heartbeat(client, lease, worker, hot, pulse, opts.stall_s, on_stall):
                    hot.drop_inputs(files.lease_starts({d for job in lease.jobs.values() for d in job.inputs.values()}))
                    places = {job_id: place(job_id, job, opts, files) for job_id, job in lease.jobs.items()}
                    lease = fetch_twins(lease, places, client, opts.root.resolve() / TWINS)
                    with pulse.watch():  # the downloads before and the uploads after wait for the server, not stuck
                        outcome = render_lease(lease, hot, opts, places, pulse)
                    uploaded = upload(client, lease, worker, outcome, places, retry)
            except DeviceUnusable as e:  # this machine's fault, not the images': they go back with their attempts
                if not isinstance(e, OwnDiskUnusable):
                    hot.forget()  # models on a failed device: loaded again (or the next lease fails the same way)
                _give_back(client, lease, worker, str(e), retry)
                tidy(lease, places, None, files, hot)
                continue
            t1 = time.perf_counter()
            rendered += 1
            hot.warm.update(i.mix for i in lease.images if i.mix and i.id in outcome.done)
            if uploaded:
                _report(client, lease, worker, outcome, retry)
            tidy(lease, places, outcome, files, hot)
            batches = sum(b.seconds for b in outcome.batches)
            log.info("lease %s: %d images in %.2f s (batches %.2f s, the rest: folder, PNGs, report, sheet), "
                     "completed in %.2f s", lease.lease, len(lease.images), t1 - t0, batches,
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


def tidy(lease: Lease, places: dict[str, Place], outcome: Outcome | None, files: InputFiles, hot: Hot) -> None:
    """What a finished lease leaves on this worker's disk, removed: the PNGs it wrote into its copies of job folders
    (sent to the server, or not taken: a lease of those images again renders them anew), the twins it downloaded,
    and input files past --max-inputs-gb (the least recently used first; the jobs kept loaded that name one are
    loaded again at their next lease, their files downloaded again). A copy that is the server's own folder
    (--upload with the server's root as --root) keeps its files."""
    for job_id, where in places.items():
        if not where.upload or outcome is None or _same_folder(where.out_dir, Path(lease.jobs[job_id].out_dir)):
            continue
        for record in (*outcome.records.get(job_id, ()), *outcome.unsent.get(job_id, ())):
            _remove(where.out_dir / record["path"])
    for image in lease.images:
        if image.twin and Path(image.twin).parent == files.cache.dir.parent / TWINS:
            _remove(Path(image.twin))
    removed, freed = files.trim({digest for job in lease.jobs.values() for digest in job.inputs.values()})
    if removed:
        hot.drop_inputs(set(removed))
        log.info("%d input files (%.1f MB) removed: --max-inputs-gb", len(removed), freed / 2**20)


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:  # left for the next lease of the image to replace
        log.warning("%s not removed: %s", path, e)


def upload(client: LeaseClient, lease: Lease, worker: str, outcome: Outcome, places: dict[str, Place],
           retry: _Retry) -> bool:
    """Sends the finished PNGs of each job rendered in a copy to the server (each tried again until the server
    answers: `_answered`); False when the lease was lost meanwhile (the images are someone else's now). The
    server's disk full: the outcome keeps what was sent (`Outcome.landed`), its other images go back to the queue
    with the completion."""
    sent: set[tuple[str, str]] = set()
    for job_id, where in places.items():
        if not where.upload:
            continue
        for path in [r["path"] for r in outcome.records.get(job_id, ())]:
            try:
                data = (where.out_dir / path).read_bytes()
                if not _answered(lambda: client.upload(lease.lease, worker, job_id, path, data), retry,
                                 f"uploading {path} of lease {lease.lease}"):
                    log.warning("lease %s was lost while uploading: its images went back to the queue", lease.lease)
                    return False
            except ServerFull as e:
                outcome.landed(lease, lambda job, p: not places[job].upload or (job, p) in sent, first_line(e))
                return True
            except (httpx.HTTPError, OSError) as e:  # the lease expires and is rendered again (from the copy)
                log.warning("uploading %s of lease %s: %s", path, lease.lease, e)
                return False
            sent.add((job_id, path))
    return True


def _report(client: LeaseClient, lease: Lease, worker: str, outcome: Outcome, retry: _Retry) -> None:
    _last_call(lambda: client.complete(lease.lease, outcome.completion(worker)), lease, "completing", retry)


def _give_back(client: LeaseClient, lease: Lease, worker: str, reason: str, retry: _Retry) -> None:
    log.warning("lease %s given back: %s", lease.lease, reason)
    failure = wire.LeaseFailure(worker=worker, reason=reason[:wire.MAX_TEXT])
    _last_call(lambda: client.give_back(lease.lease, failure), lease, "giving back", retry)


@dataclass(frozen=True)
class _Retry:
    """How a lease's calls wait for a server they cannot reach: `backoff_s`, the longest wait between two tries
    (a third of the server's --lease-s at most); `stop`, the worker's stop request, which ends the wait."""
    backoff_s: float
    stop: _Stop


def _answered(call, retry: _Retry, doing: str, full_too: bool = False):
    """call()'s result, the call tried again while the server cannot be reached (a restart, a network cut: the
    server does not hold its downtime against a lease, Store.restarted, so the rendered batch still lands), and with
    `full_too` while it answers 507 (its disk full to the last byte: the time its queue could not be written is
    held against no lease either). A stop request ends the wait: the last error is raised (the lease then expires
    and its images are queued again)."""
    attempt = 0
    while True:
        try:
            result = call()
        except (httpx.TransportError, ServerFull) as e:
            if retry.stop.requested or isinstance(e, ServerFull) and not full_too:
                raise
            if not attempt:  # once per outage, not once per try
                why = ("the server cannot take it" if isinstance(e, ServerFull) else "the server cannot be reached")
                log.warning("%s: %s (%s): trying again every %.0f s at most until it answers", doing, why,
                            first_line(e, 200) or e.__class__.__name__, retry.backoff_s)
            _pause(min(2 ** attempt * 0.5, retry.backoff_s), retry.stop)
            attempt += 1
            continue
        if attempt:
            log.warning("%s: done once the server answered again", doing)
        return result


def _last_call(call, lease: Lease, doing: str, retry: _Retry) -> None:
    """A lease's completion or give-back; a refusal, or a stop while the server cannot be reached, is one warning
    (the lease then expires and its images are queued again)."""
    try:
        if not _answered(call, retry, f"{doing} lease {lease.lease}", full_too=True):
            log.warning("lease %s was lost before %s it: the server ignored it", lease.lease, doing)
    except ServerError as e:
        log.warning("%s", e)
    except httpx.HTTPError as e:
        log.warning("%s lease %s: %s", doing, lease.lease, first_line(e, 200) or e.__class__.__name__)
