"""The server is the one writer of its job folders, whatever the number of workers rendering a job: workers write
their PNGs (atomically, on the shared filesystem, or by upload); the server checks each and records its manifest
line in the transaction that completes the batch, and rebuilds the job's report (merged from the leases'
figures) and contact sheet as batches land. Torch-free.

- `store_upload`: a PNG a worker without the server's filesystem sends, where a worker on it would have written it.
- `check`: a completion's manifest lines, each for an output of the lease (or a hires candidate's first pass), its
  file in the job's folder (a regular file, not a link) and its bytes hashing to the line's sha256. Read off the
  event loop, before the store's lock is taken.
- `record`: inside `Store.complete`'s transaction: one line per output of each done image, appended to the
  folder's manifest.jsonl (the one format `bcg render` writes); an output without a checked line refuses the
  completion, nothing recorded.
- `Refresher`: a thread that rebuilds a job's report.json/.md and index.html at most every REFRESH_S while it
  renders, and once more when it ends (a sheet is a scan of the folder: rebuilt per batch, a long job would
  spend more time on its sheet than on its images).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from storyboard_cli.errors import BadInput, Status, one_line
from storyboard_cli.folder.layout import REPORT_JSON, base_name
from storyboard_cli.folder.outputs import Manifest, atomic_write
from storyboard_cli.folder.report import Report, Timings, WorkerShare, write_report
from storyboard_cli.folder.sink import ContactSheet
from storyboard_cli.serve import wire
from storyboard_cli.serve.intake import served_job
from storyboard_cli.serve.schedule import ImageState, JobState

log = logging.getLogger(__name__)
LEASES = "leases"  # <root>/jobs/<id>/leases/<lease>.json: each completed lease's report of the job
REFRESH_S = 2.0
STATUS = {JobState.SUCCEEDED: Status.DONE, JobState.FAILED: Status.FAILED, JobState.CANCELED: Status.INTERRUPTED}

Held = dict[str, tuple[Path, Path, set[str]]]  # Store.lease_outputs: job -> (job file, output folder, outputs)
# a job no lease has reported on yet (canceled while queued): what the queue knows, on nothing rendered
NOTHING_RENDERED = Report.build(job="", out_dir=Path(), device="none", dtype="none", engine="none", model="",
                                timings=Timings(), wall_s=0.0, rendered=0, skipped=0, failed=[], peak_mem_mb=None,
                                graphs=[], status=Status.DONE, notes=[])


def check(held: Held, manifest: dict[str, list[wire.ManifestLine]]) -> dict[str, dict[str, dict]]:
    """The completion's lines by job and path (as the manifest holds them), each checked against the file it names.
    Raises BadInput."""
    checked: dict[str, dict[str, dict]] = {}
    for job_id, lines in manifest.items():
        if job_id not in held:
            raise BadInput(f"the lease holds no image of job {job_id}")
        _, out_dir, outputs = held[job_id]
        allowed = written(outputs)
        for line in (sent.model_dump() for sent in lines):
            path = line["path"]
            if path not in allowed:
                raise BadInput(f"manifest line for {str(path)[:80]!r}: not an output of this lease")
            digest = line.get("sha256")
            if not isinstance(digest, str) or _sha256(out_dir / path) != digest:
                raise BadInput(f"{path}: the file in the job's folder is missing or is not the one its line names")
            checked.setdefault(job_id, {})[path] = line
    return checked


def _sha256(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        return h.hexdigest()


def written(outputs: set[str]) -> set[str]:
    """What a lease of these outputs may write: each, and a hires candidate's first pass (`base_name`), which the
    lease renders first where the folder lacks it and records as `bcg render` does."""
    return outputs | {base_name(path) for path in outputs}


def record(held: Held, checked: dict[str, dict[str, dict]], done: dict[str, set[str]]) -> None:
    """The manifest lines of the done images' outputs (each after its first pass's, where the lease rendered one),
    appended to their jobs' manifests (the store's transaction is open: raising refuses the completion)."""
    for job_id, outputs in done.items():
        lines = checked.get(job_id, {})
        missing = sorted(outputs - set(lines))
        if missing:
            raise BadInput(f"{missing[0]}: reported done without its manifest line")
        manifest = Manifest(held[job_id][1])
        for path in sorted(outputs):
            if base_name(path) in lines:
                manifest.append(lines[base_name(path)])
            manifest.append(lines[path])


def store_upload(out_dir: Path, outputs: set[str], path: str, data: bytes) -> None:
    """A PNG of a lease from a worker without the server's filesystem, written atomically where a worker on
    it would have written it. Raises BadInput for anything but what the lease may write (`written`)."""
    if path not in written(outputs):
        raise BadInput(f"{path[:80]!r} is not an output of this lease")
    atomic_write(out_dir / path, data)


def keep_reports(held: Held, lease_id: str, worker: str | None, reports: dict[str, wire.LeaseReport]) -> None:
    """Each job's report of a completed lease, beside the job file (what the job's report is merged from)."""
    for job_id, report in reports.items():
        if job_id in held:
            folder = held[job_id][0].parent / LEASES
            kept = {"worker": worker, "report": report.model_dump(exclude_unset=True)}
            atomic_write(folder / f"{lease_id}.json", json.dumps(kept).encode())


def merged_report(job: dict, job_file: Path, now: float) -> Report:
    """The job's report: its leases' reports merged as a multi-GPU render's workers' are (`Report.merge`: stage
    seconds and buckets summed, a row per worker, its leases summed; `host` the id the server issued it), with what
    the queue knows of the job: its images done, cached and failed, its state, its wall time from submission to its
    end (or now)."""
    leases = _stored(job["id"], job_file)
    workers = list(dict.fromkeys(worker for worker, _ in leases))
    reports = [replace(r, share=WorkerShare(workers.index(worker), worker, busy_s=r.wall_s, arrived_s=0.0))
               for worker, r in leases]
    images = job["images"]
    done = [i for i in images if i["state"] == ImageState.DONE]
    failures = [{"path": p, "shot": i["shot"], "reason": i["reason"] or "failed"}
                for i in images if i["state"] == ImageState.FAILED for p in i["outputs"]]
    merged = Report.merge(reports) if reports else NOTHING_RENDERED
    return replace(merged, job=str(job_file), output_dir=job["out_dir"], status=STATUS.get(job["state"], job["state"]),
                   run={"id": job["id"], "started": _iso(job["submitted"]), "finished": _iso(job["finished"])},
                   wall_s=round((job["finished"] or now) - job["submitted"], 3), images_skipped=0,
                   images_failed=len(failures), failures=failures,
                   images_cached=sum(len(i["outputs"]) for i in done if i["cached"]),
                   render_s=None, render_images_per_s=None,  # a served job's wall time is the queue's
                   workers=merged.workers or []).recounted(sum(len(i["outputs"]) for i in done if not i["cached"]))


def _stored(job_id: str, job_file: Path) -> list[tuple[str, Report]]:
    """The job's completed leases' reports (`keep_reports`) and their workers, each checked as a completion's is
    (wire.LeaseReport): one the server cannot read (damaged, or kept by another bcg version) is skipped with a log
    line, so it never stops the job's report and sheet from being written."""
    leases = []
    for f in sorted((job_file.parent / LEASES).glob("*.json")):
        try:
            entry = json.loads(f.read_text(encoding="utf-8"))
            report = wire.report_of(wire.LeaseReport.model_validate(entry["report"]))
            leases.append((entry.get("worker") or "?", report))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # ValidationError is a ValueError
            log.warning("job %s: the report of lease %s is skipped, the server cannot read it: %s", job_id, f.stem,
                        _why(e))
    return leases


def _why(e: Exception) -> str:
    """An error reading a stored report, one line: a validation error names its first field."""
    if isinstance(e, ValidationError):
        first = e.errors(include_url=False)[0]
        return one_line(f"{'.'.join(map(str, first['loc'])) or 'report'}: {first['msg']}", 200)
    return one_line(e, 200)


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def stale_views(ended: list[tuple[str, float, Path]]) -> list[str]:
    """Of the ended jobs (id, when it ended, its folder), those whose report was not written after their end: the
    last server stopped (or was killed) between a job's end and its folder's last rebuild, which `Refresher` does off
    the request path. The server's start rebuilds each."""
    stale = []
    for job_id, finished, out_dir in ended:
        try:
            if (out_dir / REPORT_JSON).stat().st_mtime < finished:
                stale.append(job_id)
        except OSError:  # no report (or no folder yet): written now
            stale.append(job_id)
    if stale:
        log.warning("%d ended job(s) whose report and sheet were not rebuilt after their end: rebuilding them",
                    len(stale))
    return stale


class Refresher:
    """Rebuilds a job's report and contact sheet off the request path: `touch(job)` after a batch lands (at
    most every REFRESH_S per job), `touch(job, now=True)` when it ends."""

    def __init__(self, job_of: Callable[[str], dict | None], clock: Callable[[], float] = time.time,
                 every_s: float = REFRESH_S):
        self.job_of, self.clock, self.every_s = job_of, clock, every_s
        self.due: dict[str, float] = {}  # job -> when to rebuild it
        self.building: set[str] = set()  # taken off `due`: a touch while it is rebuilt is due again
        self.last: dict[str, float] = {}
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="bcg-folders", daemon=True)
        self.thread.start()

    def touch(self, job_id: str, now: bool = False) -> None:
        with self.wake:
            at = time.monotonic() if now else max(time.monotonic(), self.last.get(job_id, 0.0) + self.every_s)
            self.due[job_id] = min(self.due.get(job_id, at), at)
            self.wake.notify()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Waits until every touched job has been rebuilt (tests, and the server's drain)."""
        deadline = time.monotonic() + timeout_s
        with self.wake:
            for job_id in self.due:
                self.due[job_id] = time.monotonic()
            self.wake.notify()
            while (self.due or self.building) and time.monotonic() < deadline:
                self.wake.wait(0.05)

    def close(self) -> None:
        self.flush()
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(5)

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not [j for j, at in self.due.items() if at <= time.monotonic()]:
                    soonest = min(self.due.values(), default=None)
                    self.wake.wait(None if soonest is None else max(soonest - time.monotonic(), 0.01))
                if self.stopping:
                    return
                ready = [j for j, at in self.due.items() if at <= time.monotonic()]
                for job_id in ready:  # a touch from now on (the job's last batch landing) rebuilds it again
                    del self.due[job_id]
                self.building.update(ready)
            for job_id in ready:
                try:
                    self.rebuild(job_id)
                except OSError as e:  # its folder full, read-only, not permitted: rebuilt at its next batch
                    log.warning("job %s: report or sheet not rebuilt: %s", job_id, e)
                except Exception:  # noqa: BLE001 - a view of the folder: the images and the queue are what count
                    log.warning("job %s: report or sheet not rebuilt", job_id, exc_info=True)
                with self.wake:
                    self.last[job_id] = time.monotonic()
                    self.building.discard(job_id)
                    self.wake.notify_all()

    def rebuild(self, job_id: str) -> None:
        job = self.job_of(job_id)
        if job is None:
            return
        job_file, out_dir = Path(job["path"]), Path(job["out_dir"])
        report = merged_report(job, job_file, self.clock())
        out_dir.mkdir(parents=True, exist_ok=True)
        write_report(out_dir, report)
        notes: list[str] = []
        ContactSheet(out_dir, served_job(job_file), notes).update(report.failures,
                                                                   running=job["state"] in (JobState.QUEUED, JobState.RUNNING))
