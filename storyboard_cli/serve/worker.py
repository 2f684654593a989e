"""A worker: leases batches from the server, renders them with the model (and its engine) kept hot across
jobs, writes them into the job's folder exactly as `bcg render` does, reports back. The only serve module
that renders; it drives the engine through `RenderSession` (run/render.py), never directly.

Each lease is one `LeaseSession`: a RenderSession on the job's folder (its lock, reconcile, OutputSink,
OOM policy, report, contact sheet) whose pending images are cut to the leased ones. Images whose twin
(same fingerprint) was rendered before are read from that PNG and written through the same sink, with
this job's metadata.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from storyboard_cli.errors import Status, StoryboardError, one_line
from storyboard_cli.folder.outputs import Manifest, atomic_write
from storyboard_cli.job.file import Job, load_job
from storyboard_cli.run.render import RenderOptions, RenderSession
from storyboard_cli.serve.client import LeaseClient
from storyboard_cli.serve.intake import JOBS, OUT
from storyboard_cli.serve.uploads import REPORTS

log = logging.getLogger(__name__)
CACHED_BUCKET = "cached"  # the report's bucket row for copied twins
TWINS = "twins"  # under an uploading worker's root: twins' PNGs downloaded from the server


@dataclass(frozen=True)
class WorkerOptions:
    server: str
    name: str = ""
    device: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    compile: str = "auto"
    token: str | None = None
    poll_s: float = 0.5
    max_leases: int | None = None  # stop after this many (tests); None: until stopped
    upload: bool = False  # send the PNGs back even when the server's job folders are visible here
    root: Path = Path("bcg-worker")  # copies of job folders, when the server's are not visible here


@dataclass
class Hot:
    """The loaded models and engine, kept between leases while the model stays the same."""

    spec: tuple | None = None
    models: object = None
    engine: object = None

    def for_job(self, job: Job) -> None:
        spec = (job.model, job.controlnet)
        lacking = job.controlnet is not None and self.models is not None and self.models.controlnet is None
        if spec != self.spec or lacking:  # another model, or a ControlNet the first job did not need
            self.spec, self.models, self.engine = spec, None, None


@dataclass
class Outcome:
    done: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    stopped: bool = False
    work: dict = field(default_factory=dict)  # what the server's histograms and counters record


class LeaseSession(RenderSession):
    def __init__(self, job: Job, opts: RenderOptions, lease: dict, hot: Hot):
        super().__init__(job, opts, None, hot.models, hot.engine)
        self.mine = {p for image in lease["images"] for p in image["outputs"]}
        self.twins = {image["outputs"][0]: image["twin"] for image in lease["images"] if image["twin"]}
        self.copied: set[str] = set()
        self.timed: list[dict] = []  # per rendered batch: shape, images, seconds

    def find_pending(self):
        pending, manifest = super().find_pending()
        pending.items = [replace(i, outputs=tuple(p for p in i.outputs if p in self.mine))
                         for i in pending.items if self.mine.intersection(i.outputs)]
        return pending, manifest

    def work(self):
        for batch in self.batches:
            rest = []
            for item in batch.items:
                pixels = _pixels(self.twins.get(item.outputs[0]))
                if pixels is None:
                    rest.append(item)
                else:
                    self.sink.submit(item, pixels, CACHED_BUCKET)
                    self.copied.update(item.outputs)
            if rest:
                t0 = time.perf_counter()
                yield replace(batch, items=tuple(rest))  # rendered before the loop asks for the next one
                self.timed.append({"shape": f"{batch.key.width}x{batch.key.height}", "images": len(rest),
                                   "seconds": round(time.perf_counter() - t0, 4)})


def _pixels(path: str | None) -> np.ndarray | None:
    """The twin's pixels (uint8 [H, W, 3]); None when there is none or it is gone."""
    if path is None:
        return None
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except OSError:
        return None


@dataclass(frozen=True)
class Place:
    """Where a lease renders: the server's job folder (a shared filesystem), or this worker's copy of it,
    whose outputs are uploaded."""

    job_file: Path
    out_dir: Path
    upload: bool


def place(lease: dict, opts: WorkerOptions) -> Place:
    """The server's job folder when this worker sees the very job file the server saved (and --upload is
    off); else a copy under the worker's --root."""
    server_file = Path(lease["path"])
    if not opts.upload and _reads(server_file) == lease["job_text"]:
        return Place(server_file, Path(lease["out_dir"]), False)
    folder = opts.root.resolve() / JOBS / lease["job"]
    job_file = folder / lease["job_file"]
    if _reads(job_file) != lease["job_text"]:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(job_file, lease["job_text"].encode())
    return Place(job_file, folder / OUT, True)


def _reads(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def fetch_twins(lease: dict, client: LeaseClient, folder: Path) -> None:
    """An uploading worker cannot read the server's copy of a twin: it downloads it (or renders the image
    when that fails)."""
    for image in lease["images"]:
        if image["twin_url"]:
            data = client.download(image["twin_url"])
            local = folder / f"{image['id']}.png"
            if data is not None:
                atomic_write(local, data)
            image["twin"] = str(local) if data is not None else None


def render_lease(lease: dict, hot: Hot, opts: WorkerOptions, where: Place | None = None) -> Outcome:
    """Renders one lease into its job's folder (or this worker's copy); which of its images landed, failed
    or are left."""
    images, out = lease["images"], Outcome()
    where = where or Place(Path(lease["path"]), Path(lease["out_dir"]), False)
    try:
        job = load_job(where.job_file)
        hot.for_job(job)
        ropts = RenderOptions(out_dir=where.out_dir, device=opts.device, dtype=opts.dtype,
                              engine=opts.engine, compile=opts.compile)
        session = LeaseSession(job, ropts, lease, hot)
        result = session.execute()
    except StoryboardError as e:
        out.failed = {image["id"]: one_line(e) for image in images}
        return out
    out.work = {"batches": session.timed, "out_of_memory": session.policy.out_of_memory if session.policy else 0,
                "model_loads": int(hot.models is None and session.models is not None)}
    if session.models is not None:
        hot.models, hot.engine = session.models, session.engine
    failed = {f["path"]: f["reason"] for f in result.failed}
    for image in images:
        paths = image["outputs"]
        reason = next((failed[p] for p in paths if p in failed), None)
        if reason is not None:
            out.failed[image["id"]] = reason
        elif all((result.out_dir / p).is_file() for p in paths):
            out.done.append(image["id"])
            if session.copied.issuperset(paths):
                out.cached.append(image["id"])
    out.stopped = result.status == Status.INTERRUPTED
    return out


def gpu_stats(hot: Hot) -> dict | None:
    """The worker's GPU memory (torch.cuda) and utilisation (NVML, when nvidia-ml-py is installed), once a
    model is loaded on one; None on a CPU or before the first load."""
    models = hot.models
    if models is None or models.device.type != "cuda":
        return None
    import torch

    d = models.device
    stats = {"memory_allocated_bytes": torch.cuda.memory_allocated(d),
             "memory_reserved_bytes": torch.cuda.memory_reserved(d),
             "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(d),
             "total_memory_bytes": torch.cuda.get_device_properties(d).total_memory}
    try:
        stats["utilization"] = torch.cuda.utilization(d) / 100
    except Exception:  # noqa: BLE001 - NVML missing or refused: the figure is left out, not guessed
        pass
    return stats


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
                if not self.client.heartbeat(self.lease["lease"], self.worker, gpu_stats(self.hot)):
                    self.lost = True
            except httpx.HTTPError as e:
                log.warning("heartbeat failed: %s", e)


class _Stop:
    """SIGINT or SIGTERM between leases: stop before taking the next one."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True


def run_worker(opts: WorkerOptions) -> int:
    """The worker loop: lease, render, complete, until stopped (SIGINT/SIGTERM: the running batch finishes,
    the rest of the lease goes back to the queue). Returns how many leases it rendered."""
    name = opts.name or f"{socket.gethostname()}-{id(opts):x}"
    client, hot, stop = LeaseClient(opts.server, opts.token), Hot(), _Stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    rendered, backoff = 0, opts.poll_s
    try:
        while not stop.requested and (opts.max_leases is None or rendered < opts.max_leases):
            try:
                lease = client.lease(name, gpu_stats(hot))
            except httpx.HTTPError as e:  # the server is restarting, or gone for a while
                log.info("no lease from %s: %s", opts.server, e)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = opts.poll_s
            if lease is None:
                time.sleep(opts.poll_s)
                continue
            where = place(lease, opts)
            with Heartbeat(client, lease, name, hot):
                if where.upload:
                    fetch_twins(lease, client, opts.root.resolve() / TWINS)
                outcome = render_lease(lease, hot, opts, where)
                manifest = upload(client, lease, outcome, where.out_dir) if where.upload else []
            rendered += 1
            if manifest is not None:
                _report(client, lease, outcome, manifest)
            stop.requested = stop.requested or outcome.stopped
    finally:
        client.close()
    return rendered


def upload(client: LeaseClient, lease: dict, outcome: Outcome, out_dir: Path) -> list[dict] | None:
    """Sends the lease's finished PNGs and the report to the server; returns their manifest lines (None when
    the lease was lost meanwhile: the images are someone else's now)."""
    records = Manifest(out_dir).records
    paths = [p for image in lease["images"] if image["id"] in outcome.done for p in image["outputs"]]
    for path in paths + [p for p in REPORTS if (out_dir / p).is_file()]:
        try:
            if not client.upload(lease["lease"], path, (out_dir / path).read_bytes()):
                log.warning("lease %s was lost while uploading: its images went back to the queue", lease["lease"])
                return None
        except (httpx.HTTPError, OSError) as e:  # the lease expires and is rendered again (here: from the copy)
            log.warning("uploading %s of lease %s: %s", path, lease["lease"], e)
            return None
    return [records[p] for p in paths if p in records]


def _report(client: LeaseClient, lease: dict, outcome: Outcome, manifest: list[dict], tries: int = 5) -> None:
    for attempt in range(tries):
        try:
            if not client.complete(lease["lease"], outcome.done, outcome.cached, outcome.failed, outcome.work,
                                   manifest):
                log.warning("lease %s was lost before it completed: the server ignored its results", lease["lease"])
            return
        except httpx.HTTPError as e:
            log.warning("completing lease %s: %s", lease["lease"], e)
            time.sleep(min(2 ** attempt, 10))
