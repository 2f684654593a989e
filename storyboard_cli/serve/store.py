"""The durable queue: jobs, their images and leases, in the queue file (queue_file.py: one SQLite file,
written by one process, the server; workers reach it over HTTP). One `Store`, one connection behind one lock,
its parts in their own modules: the registered workers (queue_workers.py), the counters, histograms and
/metrics reads (queue_stats.py), dispatch paused and workers drained with the global event stream (queue_control.py)
and the queue page's reads (queue_views.py). Torch-free.

Leases: a worker leases one batch of one job for `ttl` seconds and renews it by heartbeat. A lease that
expires goes back to the queue; an image whose lease was lost MAX_ATTEMPTS times fails. A completion for a
lease that is gone (expired, its images leased again) is ignored and counted.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import schedule
from storyboard_cli.serve.estimates import Calibration, Estimates
from storyboard_cli.serve.intake import JOBS, Planned
from storyboard_cli.serve.queue_control import QueueControl
from storyboard_cli.serve.queue_file import APPLICATION_ID, DB, QueueUnusable
from storyboard_cli.serve.queue_stats import (BATCH_FILL, BATCH_SECONDS, BUCKETS_S, CACHED, EXPIRED, FAILED,
                                              FILL_BUCKETS, FIRST_IMAGE, IMAGE_RENDER, JOB_LATENCY, LATE,
                                              MODEL_LOADS, OOMS, QUEUE_WAIT, REJECTED_FULL, REJECTED_INVALID,
                                              QUARANTINES, RENDERED, RETRIES, STRIKES, WORKER_STARTUP, QueueStats,
                                              bounds)
from storyboard_cli.serve.queue_views import RANK_SQL, QueueViews
from storyboard_cli.serve.queue_workers import (MAX_STRIKES, Quarantined, Seen, TooManyWorkers, UnknownWorker,
                                                WorkerRegistry)
from storyboard_cli.serve.schedule import END, MAX_ATTEMPTS, TIERS, ImageState, JobState, Waiting
from storyboard_cli.serve.wire import Lease, LeasedImage, LeasedJob, job_file_url

# what other modules import from here, wherever it is defined
__all__ = ["APPLICATION_ID", "BATCH_FILL", "BATCH_SECONDS", "BUCKETS_S", "CACHED", "DB", "EXPIRED", "FAILED",
           "FILL_BUCKETS", "FIRST_IMAGE", "IMAGE_RENDER", "JOB_LATENCY", "LATE", "MODEL_LOADS", "OOMS", "QUEUE_WAIT",
           "REJECTED_FULL", "REJECTED_INVALID", "RENDERED", "RETRIES", "WORKER_STARTUP", "IdempotencyConflict",
           "JobFinal", "NothingToRetry", "QueueFull", "QueueUnusable", "Seen", "Store", "TooManyWorkers",
           "UnknownWorker", "Work",
           "bounds", "MAX_STRIKES", "NotHolder", "Quarantined", "QUARANTINES", "STRIKES", "Strike"]


def open_seconds(seconds: float) -> float:
    """An open job's eta in tenths of a second, never 0.0 (which would read as done)."""
    return max(round(seconds, 1), 0.1)


@dataclass(frozen=True)
class Work:
    """What a worker measured while rendering a lease: (shape, images, seconds, bucket or None) per batch,
    out-of-memory retries, model loads."""

    batches: tuple[tuple, ...] = ()  # (shape, images, seconds[, bucket])
    out_of_memory: int = 0
    model_loads: int = 0




class QueueFull(Exception):
    """Refused whole: the queue holds too many images. `retry_after` in seconds."""

    def __init__(self, retry_after: int, depth: int):
        super().__init__(f"the queue holds {depth} images; retry in {retry_after} s")
        self.retry_after, self.depth = retry_after, depth



class IdempotencyConflict(BadInput):
    """The same Idempotency-Key came with another body."""


class NotHolder(Exception):
    """A lease renewed, completed or given back by a worker it was not issued to: refused, nothing changes."""

    def __init__(self, lease_id: str, worker: str):
        super().__init__(f"lease {lease_id[:80]} was not issued to worker {worker[:80]}: only its holder may renew, "
                         "complete or give it back")


@dataclass(frozen=True)
class Strike:
    """A lease given back for an error of its worker's machine: the worker's strikes in a row, and whether it is
    quarantined now (at MAX_STRIKES)."""

    strikes: int
    quarantined: bool


class NothingToRetry(Exception):
    """A retry of a job none of whose images failed: nothing changes."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id} has no failed image to retry")


class JobFinal(Exception):
    """The job is already succeeded, failed or canceled: a cancel or a priority change would rewrite its
    outcome, so it is refused and nothing changes. `state`: that final state."""

    def __init__(self, job_id: str, state: str):
        super().__init__(f"job {job_id} is already {state}")
        self.state = state



class Store(WorkerRegistry, QueueStats, QueueControl, QueueViews, Estimates):
    """The queue: jobs, their images, leases and progress events (its workers and figures: the classes it
    inherits, sharing its connection and lock). A job's file and output folder are kept relative to `root`
    (resolved once here): the server may start again from another working directory, or with another spelling
    of its root, and find them."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.calibration = Calibration()
        super().__init__(self.root)
        self._repair_paths()
        self._load_calibration()

    def _stored(self, path: Path) -> str:
        """A path as the jobs table keeps it: relative to the root, absolute when outside it."""
        path = Path(path)
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def _path(self, stored: str) -> Path:
        """A path the jobs table keeps, on this machine (an absolute one as it is)."""
        return self.root / stored

    def _repair_paths(self) -> None:
        """Rows written before paths were kept relative to the root (relative to the working directory of the
        server that wrote them, or absolute) rewritten relative to it, where the job's folder is under this root
        (its file and output folder are <root>/jobs/<id>/...); any other row is left as it was."""
        with self.lock:
            rows = self.db.execute("SELECT id, path, out_dir FROM jobs").fetchall()
        fixes = []
        for job_id, *paths in rows:
            fixed = [self._repaired(job_id, p) for p in paths]
            if fixed != paths:
                fixes.append((*fixed, job_id))
        if fixes:
            with self._tx() as db:
                db.executemany("UPDATE jobs SET path = ?, out_dir = ? WHERE id = ?", fixes)

    def _repaired(self, job_id: str, stored: str) -> str:
        parts = Path(stored).parts
        if len(parts) < 3 or parts[-3:-1] != (JOBS, job_id):
            return stored  # not a job folder this server made (or already relative: jobs/<id>/<name>)
        tail = str(Path(*parts[-3:]))
        return tail if stored != tail and (self.root / JOBS / job_id).is_dir() else stored

    def _event(self, db, job_id: str, kind: str, now: float, **data) -> None:
        """One step of the job's progress stream, written in the transaction that made it (so a reader
        resuming after event n misses none and sees none twice). None after the stream's `end`, which comes
        when the job's last image ended (a canceled job's after its leased batches landed): the job's last
        event says its final state and counts."""
        job = db.execute("SELECT canceled, finished FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if kind != END and job["finished"] is not None:  # its `end` is written
            return
        states = self._states(db, job_id)
        body = {"job": job_id, "state": schedule.job_state(states, bool(job["canceled"])), "at": now,
                "images_by_state": dict(states), **data}
        db.execute("INSERT INTO events (job, kind, data) VALUES (?, ?, ?)", (job_id, kind, json.dumps(body)))

    def _states(self, db, job_id: str) -> Counter:
        return Counter({s: n for s, n in db.execute("SELECT state, COUNT(*) FROM images WHERE job = ? "
                                                      "GROUP BY state", (job_id,))})

    def _open_job(self, db, job_id: str) -> bool:
        """Whether the job exists; raises JobFinal when it is succeeded, failed or canceled."""
        job = db.execute("SELECT canceled FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if job is None:
            return False
        state = schedule.job_state(self._states(db, job_id), bool(job["canceled"]))
        if state not in (JobState.QUEUED, JobState.RUNNING):  # succeeded, failed or canceled
            raise JobFinal(job_id, state)
        return True

    def events(self, job_id: str, after: int) -> tuple[list[tuple[int, str, str]], bool]:
        """The job's events after sequence number `after` (seq, kind, JSON data), and whether its stream
        had already ended at or before `after`."""
        with self.lock:
            rows = self.db.execute("SELECT seq, kind, data FROM events WHERE job = ? AND seq > ? ORDER BY seq",
                                   (job_id, after)).fetchall()
            ended = self.db.execute("SELECT 1 FROM events WHERE job = ? AND kind = ? AND seq <= ?",
                                    (job_id, END, after)).fetchone() is not None
        return [tuple(r) for r in rows], ended

    # submission

    def replay(self, key: str, content_hash: str, same_body: dict[str, str] | None = None) -> str | None:
        """The job first submitted with this Idempotency-Key, if any; raises IdempotencyConflict when it
        came with another body. `same_body`: this body's content hash at each priority, so that the key
        reused for the same job at another priority says so (not "another job")."""
        with self.lock:
            return self._replay(self.db, key, content_hash, same_body)

    def _replay(self, db, key: str, content_hash: str, same_body: dict[str, str] | None = None) -> str | None:
        row = db.execute("SELECT id, content_hash FROM jobs WHERE idem_key = ?", (key,)).fetchone()
        if row and row["content_hash"] != content_hash:
            shown = key if len(key) <= 80 else key[:77] + "..."
            first = next((p for p, h in (same_body or {}).items() if h == row["content_hash"]), None)
            if first is not None:
                raise IdempotencyConflict(f"Idempotency-Key {shown!r} was used for this job ({row['id']}) with "
                                          f"priority {first}: PATCH /v1/jobs/{row['id']} changes its priority")
            raise IdempotencyConflict(f"Idempotency-Key {shown!r} was used for another job ({row['id']})")
        return row["id"] if row else None

    def submit(self, job: Planned, key: str | None, max_queue: int, now: float) -> tuple[str, bool]:
        """Enqueues every image of the job or none. Returns (job id, created); with a key seen before, the
        first job's id (created False). Raises QueueFull, IdempotencyConflict, BadInput."""
        with self._tx() as db:
            first = self._replay(db, key, job.content_hash) if key is not None else None
            if first is not None:
                return first, False
            n, depth = len(job.images), self._depth(db)
            if n > max_queue:
                refused: Exception = BadInput(f"the job has {n} images, more than the queue holds ({max_queue})")
                self._count(db, REJECTED_INVALID)
            elif depth + n > max_queue:
                refused = QueueFull(schedule.retry_after(depth + n - max_queue, self._drain_estimate(db, now)), depth)
                self._count(db, REJECTED_FULL)
            else:
                refused = None
                self._insert(db, job, key, now)
        if refused is not None:  # raised after the commit: the refusal is counted
            raise refused
        return job.id, True

    def refuse_if_full(self, max_queue: int, now: float) -> None:
        """Raises QueueFull (counted) when the queue cannot take a single image more: a submission is refused
        before it is planned (its job file written, its control images decoded), the cheapest answer under load."""
        with self._tx() as db:
            depth = self._depth(db)
            if depth < max_queue:
                return
            self._count(db, REJECTED_FULL)
            refused = QueueFull(schedule.retry_after(depth + 1 - max_queue, self._drain_estimate(db, now)), depth)
        raise refused

    def _insert(self, db, job: Planned, key: str | None, now: float) -> None:
        db.execute("INSERT INTO jobs (id, idem_key, content_hash, name, path, out_dir, priority, submitted, batch)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (job.id, key, job.content_hash, job.name, self._stored(job.path), self._stored(job.out_dir),
                    job.priority, now, job.batch))
        db.executemany("INSERT INTO images (job, ord, shot, k, seed, outputs, key, fingerprint, state, mix, cost, est)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       [(job.id, i.order, i.shot, i.k, i.seed, json.dumps(i.outputs), i.key, i.fingerprint,
                         ImageState.QUEUED, i.mix, i.cost, i.est) for i in job.images])
        self._event(db, job.id, "queued", now, priority=job.priority)

    def _depth(self, db) -> int:
        return db.execute("SELECT COUNT(*) FROM images WHERE state IN (?, ?)", ImageState.OPEN).fetchone()[0]

    # leases

    def lease(self, worker: str, now: float, ttl: float, gpu: dict | None = None, ready: bool = False,
              warm: frozenset[str] = frozenset(), uptime_s: float | None = None, held: bool = False) -> Lease | None:
        """The next batch for `worker`, or None when nothing is free (or `held`: the server's disk full): `job`
        (the head job, the best ranked), `jobs` (each job of the batch: its job file and output folder; the API adds
        their text and inputs), `images` (each with its job, mix and twin). `warm`: the mixes the worker has
        prepared (schedule.pick prefers them). Raises UnknownWorker, Quarantined."""
        with self._tx() as db:
            self._seen(db, worker, gpu, now, ready)
            self._usable(db, worker)  # Quarantined: no lease
            self._expire(db, now)
            self._warm(db, worker, warm)
            if held or self._held_back(db, worker):  # the queue paused, this worker drained (queue_control.py)
                return None
            rows = db.execute("SELECT i.id, i.job, i.key, i.fingerprint, i.ord, i.mix, i.cost, j.priority, "
                              "j.submitted, j.batch, j.front FROM images i JOIN jobs j ON j.id = i.job "
                              "WHERE i.state = ?", (ImageState.QUEUED,))
            waiting = [Waiting(r["id"], r["job"], r["priority"], r["submitted"], r["key"], r["fingerprint"], r["ord"],
                               r["batch"], r["mix"], r["cost"], r["front"]) for r in rows]
            busy = db.execute("SELECT fingerprint FROM images WHERE state = ?", (ImageState.LEASED,)).fetchall()
            picked = schedule.pick(waiting, {r[0] for r in busy}, warm)
            if not picked:
                return None
            lease_id, head = uuid.uuid4().hex, picked[0].job
            if ready and uptime_s is not None and db.execute(
                    "UPDATE workers SET first_ready = ? WHERE id = ? AND first_ready IS NULL", (now, worker)).rowcount:
                self._observe(db, WORKER_STARTUP, "", uptime_s)  # its first lease taken ready
            est = db.execute(f"SELECT COALESCE(SUM(est), 0) FROM images WHERE id IN ({','.join('?' * len(picked))})",
                             [w.image for w in picked]).fetchone()[0]
            db.execute("INSERT INTO leases (id, worker, job, expires, started, est) VALUES (?, ?, ?, ?, ?, ?)",
                       (lease_id, worker, head, now + ttl, now, est))
            ids = [w.image for w in picked]
            for image, attempts, submitted, priority in db.execute(
                    f"SELECT i.id, i.attempts, j.submitted, j.priority FROM images i JOIN jobs j ON j.id = i.job "
                    f"WHERE i.id IN ({','.join('?' * len(ids))})", ids).fetchall():
                if attempts:  # its last lease was lost
                    self._count(db, RETRIES)
                else:
                    self._observe(db, QUEUE_WAIT, priority, now - submitted)
            db.executemany("UPDATE images SET state = ?, lease = ?, attempts = attempts + 1, worker = ?, leased = ? "
                           "WHERE id = ?", [(ImageState.LEASED, lease_id, worker, now, i) for i in ids])
            images, jobs = [], {}
            for w in picked:
                r = db.execute("SELECT outputs, fingerprint FROM images WHERE id = ?", (w.image,)).fetchone()
                images.append(LeasedImage(id=w.image, job=w.job, outputs=json.loads(r["outputs"]), mix=w.mix,
                                          **self._twin(db, r["fingerprint"])))
                if w.job not in jobs:
                    job = db.execute("SELECT path, out_dir FROM jobs WHERE id = ?", (w.job,)).fetchone()
                    jobs[w.job] = LeasedJob(path=str(self._path(job["path"])), out_dir=str(self._path(job["out_dir"])),
                                            job_file=Path(job["path"]).name)
            for job_id in jobs:
                self._event(db, job_id, "running", now, worker=worker, lease=lease_id,
                            images=[w.image for w in picked if w.job == job_id])
            return Lease(lease=lease_id, job=head, jobs=jobs, expires=now + ttl, ttl=ttl, images=images)

    def _twin(self, db, fingerprint: str) -> dict:
        """A PNG already rendered with this fingerprint (any job), which the worker copies instead of
        rendering: `twin`, its path on the server, `twin_of`, [its job, its output path], and `twin_url`, where
        the server serves it."""
        row = db.execute("SELECT j.id, j.out_dir, i.outputs FROM images i JOIN jobs j ON j.id = i.job "
                         "WHERE i.fingerprint = ? AND i.state = ? LIMIT 1", (fingerprint, ImageState.DONE)).fetchone()
        if row is None:
            return {"twin": None, "twin_of": None, "twin_url": None}
        first = json.loads(row["outputs"])[0]
        return {"twin": str(self._path(row["out_dir"]) / first), "twin_of": [row["id"], first],
                "twin_url": job_file_url(row["id"], first)}

    def lease_outputs(self, lease_id: str, now: float) -> dict[str, tuple[Path, Path, set[str]]] | None:
        """A live lease's jobs: for each, its job file, its output folder and the output paths of the lease's
        images; None when the lease is gone (expired now, or before)."""
        with self._tx() as db:
            self._expire(db, now)
            if db.execute("SELECT 1 FROM leases WHERE id = ?", (lease_id,)).fetchone() is None:
                return None
            held: dict[str, tuple[Path, Path, set[str]]] = {}
            for job_id, path, out_dir, outputs in db.execute(
                    "SELECT j.id, j.path, j.out_dir, i.outputs FROM images i JOIN jobs j ON j.id = i.job "
                    "WHERE i.lease = ?", (lease_id,)):
                held.setdefault(job_id, (self._path(path), self._path(out_dir), set()))[2].update(json.loads(outputs))
        return held

    def heartbeat(self, lease_id: str, now: float, ttl: float, worker: str | None = None,
                  gpu: dict | None = None, ready: bool = False) -> bool:
        """Extends the lease; False when it is gone (the worker's results will be ignored). Raises NotHolder
        when `worker` is not the one it was issued to (None: the server's own call, no check)."""
        with self._tx() as db:
            if worker is not None:
                self._seen(db, worker, gpu, now, ready)
            self._expire(db, now)
            if not self._held(db, lease_id, worker):
                return False
            return db.execute("UPDATE leases SET expires = ? WHERE id = ?", (now + ttl, lease_id)).rowcount == 1

    def _held(self, db, lease_id: str, worker: str | None) -> bool:
        """Whether the lease is live; raises NotHolder when `worker` is not its holder (None: no check)."""
        row = db.execute("SELECT worker FROM leases WHERE id = ?", (lease_id,)).fetchone()
        if row is not None and worker is not None and row["worker"] != worker:
            raise NotHolder(lease_id, worker)
        return row is not None

    def give_back(self, lease_id: str, worker: str, reason: str, now: float) -> Strike | None:
        """The worker could not render the lease for an error of its own machine (its device unusable, a CUDA
        error): its images go back to the queue without using up an attempt, and the worker takes a strike
        (quarantined at MAX_STRIKES in a row). None when the lease is gone; raises NotHolder."""
        with self._tx() as db:
            self._expire(db, now)
            if not self._held(db, lease_id, worker):
                return None
            held = db.execute("SELECT id, job FROM images WHERE lease = ?", (lease_id,)).fetchall()
            db.execute("UPDATE images SET state = CASE WHEN (SELECT canceled FROM jobs WHERE id = images.job) "
                       "THEN ? ELSE ? END, attempts = attempts - 1, lease = NULL WHERE lease = ?",
                       (ImageState.CANCELED, ImageState.QUEUED, lease_id))
            db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            strikes, quarantined = self._strike(db, worker, reason)
            self._count(db, STRIKES)
            if quarantined and strikes == MAX_STRIKES:
                self._count(db, QUARANTINES)
            for job_id in dict.fromkeys(r["job"] for r in held):
                self._event(db, job_id, "lease_lost", now, requeued=[r["id"] for r in held if r["job"] == job_id],
                            reason=f"worker {worker}: {reason}")
                self._finished(db, job_id, now)
            return Strike(strikes, quarantined)

    def complete(self, lease_id: str, done: list[int], cached: list[int], failed: dict[int, str], now: float,
                 work: Work | None = None, record: Callable[[dict[str, set[str]]], None] | None = None,
                 worker: str | None = None, strike: str | None = None) -> bool:
        """Records a lease's results; its images not named go back to the queue with their attempts (a worker
        stopping). False, and nothing recorded, when the lease is gone; NotHolder when `worker` is not its
        holder. `record({job: outputs of its done images})` runs inside the transaction, before it commits (the
        job folders' manifest lines): if it raises, nothing is recorded. The holder's strikes in a row end, unless
        `strike` says what of its own machine left the images not named (a strike, as a give-back's)."""
        work = work or Work()
        with self._tx() as db:
            self._expire(db, now)
            if not self._held(db, lease_id, worker):
                self._count(db, LATE)
                return False
            holder = db.execute("SELECT worker FROM leases WHERE id = ?", (lease_id,)).fetchone()[0]
            if strike is None:
                db.execute("UPDATE workers SET strikes = 0 WHERE id = ?", (holder,))
            else:
                strikes, quarantined = self._strike(db, holder, strike)
                self._count(db, STRIKES)
                if quarantined and strikes == MAX_STRIKES:
                    self._count(db, QUARANTINES)
            if work.batches:
                self._calibrate(db, lease_id, worker, sum(b[2] for b in work.batches))
            held = db.execute("SELECT i.id, i.job, j.canceled, i.outputs FROM images i JOIN jobs j ON j.id = i.job "
                              "WHERE i.lease = ?", (lease_id,)).fetchall()
            if record is not None:
                outputs: dict[str, set[str]] = {}
                for image, job_id, _, paths in held:
                    if image in done:
                        outputs.setdefault(job_id, set()).update(json.loads(paths))
                record(outputs)
            for image, _, canceled, _ in held:
                if image in done:
                    db.execute("UPDATE images SET state = ?, cached = ?, done = ?, lease = NULL WHERE id = ?",
                               (ImageState.DONE, image in cached, now, image))
                elif image in failed:
                    db.execute("UPDATE images SET state = ?, reason = ?, done = ?, lease = NULL WHERE id = ?",
                               (ImageState.FAILED, failed[image], now, image))
                else:
                    db.execute("UPDATE images SET state = ?, attempts = attempts - 1, lease = NULL WHERE id = ?",
                               (ImageState.CANCELED if canceled else ImageState.QUEUED, image))
            db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            held_ids = {r[0] for r in held}
            done_, cached_ = set(done) & held_ids, set(cached) & set(done) & held_ids
            self._count(db, RENDERED, len(done_ - cached_))
            self._count(db, CACHED, len(cached_))
            self._count(db, FAILED, len(set(failed) & held_ids))
            self._count(db, OOMS, work.out_of_memory)
            self._count(db, MODEL_LOADS, work.model_loads)
            for shape, images, seconds, *bucket in work.batches:
                self._observe(db, BATCH_SECONDS, shape, seconds)
                if bucket and bucket[0]:
                    self._observe(db, BATCH_FILL, "", images / bucket[0])
                for _ in range(images):
                    self._observe(db, IMAGE_RENDER, "", seconds / images)
            for job_id in dict.fromkeys(r[1] for r in held):
                mine = {r[0] for r in held if r[1] == job_id}
                first = self._first_image(db, job_id, len(done_ & mine), now)
                if first is not None:
                    self._observe(db, FIRST_IMAGE, *first)
                self._event(db, job_id, "images", now, lease=lease_id, done=sorted((done_ - cached_) & mine),
                            cached=sorted(cached_ & mine),
                            failed={str(k): v for k, v in failed.items() if k in mine})
                self._finished(db, job_id, now)
            return True

    def restarted(self, now: float, ttl: float) -> None:
        """The server starts again: the time it was down does not count against its workers. Each registration
        counts as seen now and each lease as renewed now for `ttl` (--lease-s), so a worker that outlived the
        outage keeps its id, its calibration and its lease by calling within `ttl` (a registered worker retries an
        unreachable server at least every ttl / 3: worker.py); one that did not is forgotten, and its lease
        expires, `ttl` from now (a machine's clock set back since then holds none longer)."""
        with self._tx() as db:
            db.execute("UPDATE workers SET seen = ?", (now,))
            db.execute("UPDATE leases SET expires = ?", (now + ttl,))

    def sweep(self, now: float) -> None:
        """Expired leases ended now (their images queued again, or failed), not at the next worker's call:
        a job's state and events stay true while no worker is asking (the server calls it periodically)."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM leases WHERE expires < ? LIMIT 1", (now,)).fetchone():
                self._expire(db, now)
            self._forget(db, now)

    def _expire(self, db, now: float) -> None:
        self._outage_over(db, now)
        for (lease_id,) in db.execute("SELECT id FROM leases WHERE expires < ?", (now,)).fetchall():
            held = db.execute("SELECT id, job, attempts FROM images WHERE lease = ?", (lease_id,)).fetchall()
            db.execute("UPDATE images SET state = ?, reason = ?, done = ?, lease = NULL WHERE lease = ? "
                       "AND attempts >= ?", (ImageState.FAILED, f"its worker was lost {MAX_ATTEMPTS} times", now,
                                             lease_id, MAX_ATTEMPTS))
            db.execute("UPDATE images SET state = CASE WHEN (SELECT canceled FROM jobs WHERE id = images.job) "
                       "THEN ? ELSE ? END, lease = NULL WHERE lease = ?",
                       (ImageState.CANCELED, ImageState.QUEUED, lease_id))  # a canceled job's are not leased again
            db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            self._count(db, EXPIRED)
            self._count(db, FAILED, sum(r["attempts"] >= MAX_ATTEMPTS for r in held))
            for job_id in dict.fromkeys(r["job"] for r in held):
                canceled = db.execute("SELECT canceled FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
                self._event(db, job_id, "lease_lost", now, requeued=[] if canceled else [
                    r["id"] for r in held if r["job"] == job_id and r["attempts"] < MAX_ATTEMPTS])
                self._finished(db, job_id, now)

    def _finished(self, db, job_id: str, now: float) -> None:
        """Stamps a job whose last image just ended (once), and ends its event stream (a canceled job's too:
        after its leased batches landed, so that `end` counts what the job holds)."""
        open_ = db.execute("SELECT COUNT(*) FROM images WHERE job = ? AND state IN (?, ?)",
                           (job_id, *ImageState.OPEN)).fetchone()[0]
        job = db.execute("SELECT submitted, canceled, finished FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if open_ or job["finished"] is not None:
            return
        db.execute("UPDATE jobs SET finished = ? WHERE id = ?", (now, job_id))
        if not job["canceled"]:
            self._observe(db, JOB_LATENCY, "", now - job["submitted"])
        self._event(db, job_id, END, now)

    def expire(self, now: float) -> None:
        with self._tx() as db:
            self._expire(db, now)

    # jobs

    def cancel(self, job_id: str, now: float) -> bool:
        """Queued images are canceled at once; leased ones when their batch is done (the job is canceled from
        now on: its stream says `canceled`, then the leased batches' `images`, and ends once they landed).
        False for no such job; JobFinal for one already final."""
        with self._tx() as db:
            if not self._open_job(db, job_id):
                return False
            db.execute("UPDATE jobs SET canceled = 1 WHERE id = ?", (job_id,))
            db.execute("UPDATE images SET state = ? WHERE job = ? AND state = ?",
                       (ImageState.CANCELED, job_id, ImageState.QUEUED))
            self._event(db, job_id, "canceled", now)
            self._finished(db, job_id, now)
            return True

    def set_priority(self, job_id: str, priority: str, now: float) -> bool:
        """False for no such job; JobFinal for one already final."""
        if priority not in TIERS:
            raise BadInput(f"priority must be one of {', '.join(TIERS)}, got {priority!r}")
        with self._tx() as db:
            if not self._open_job(db, job_id):
                return False
            db.execute("UPDATE jobs SET priority = ?, front = NULL WHERE id = ?", (priority, job_id))
            self._event(db, job_id, "priority", now, priority=priority)
            return True

    def to_front(self, job_id: str, now: float) -> bool:
        """The job ranks ahead of every open job (until its priority is changed again): its queued images are the
        next leased. False for no such job; JobFinal for one already final."""
        with self._tx() as db:
            if not self._open_job(db, job_id):
                return False
            ranks = [schedule.rank(*r) for r in db.execute(
                "SELECT j.priority, j.submitted, j.front FROM jobs j WHERE j.id != ? AND EXISTS (SELECT 1 FROM images "
                "i WHERE i.job = j.id AND i.state IN (?, ?))", (job_id, *ImageState.OPEN))]
            own = db.execute("SELECT priority, submitted, front FROM jobs WHERE id = ?", (job_id,)).fetchone()
            front = min([schedule.rank(*own), *(r - 1.0 for r in ranks)])
            db.execute("UPDATE jobs SET front = ? WHERE id = ?", (front, job_id))
            self._event(db, job_id, "front", now, rank=front)
            return True

    def retry(self, job_id: str, now: float) -> list[int] | None:
        """The job's failed images queued again, their attempts and reasons cleared; a failed job runs again (its
        stream goes on after its `end` with `retried`). The ids queued; None for no such job. Raises JobFinal for a
        canceled job, NothingToRetry for a job without a failed image."""
        with self._tx() as db:
            job = db.execute("SELECT canceled FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if job is None:
                return None
            if job["canceled"]:
                raise JobFinal(job_id, JobState.CANCELED)
            failed = [r[0] for r in db.execute("SELECT id FROM images WHERE job = ? AND state = ? ORDER BY ord",
                                               (job_id, ImageState.FAILED))]
            if not failed:
                raise NothingToRetry(job_id)
            db.execute("UPDATE images SET state = ?, attempts = 0, reason = NULL, done = NULL, lease = NULL, "
                       "worker = NULL, leased = NULL WHERE job = ? AND state = ?",
                       (ImageState.QUEUED, job_id, ImageState.FAILED))
            db.execute("UPDATE jobs SET finished = NULL WHERE id = ?", (job_id,))
            self._event(db, job_id, "retried", now, requeued=failed)
            return failed

    def job_state(self, job_id: str) -> str | None:
        """The job's state (None: no such job)."""
        with self.lock:
            canceled = self.db.execute("SELECT canceled FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if canceled is None:
                return None
            states = self._states(self.db, job_id)
        return schedule.job_state(states, bool(canceled[0]))

    def lease_worker(self, lease_id: str) -> str | None:
        """The worker holding a lease (None: no such lease)."""
        with self.lock:
            row = self.db.execute("SELECT worker FROM leases WHERE id = ?", (lease_id,)).fetchone()
        return None if row is None else row[0]

    def job_file(self, job_id: str) -> Path | None:
        """The job file a served job was saved as (its folder holds the job's inputs and leases' reports)."""
        with self.lock:
            row = self.db.execute("SELECT path FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._path(row[0])

    def ended(self) -> list[tuple[str, float, Path]]:
        """Every job that ended: its id, when, and its output folder (what the server's start checks the views of)."""
        with self.lock:
            rows = self.db.execute("SELECT id, finished, out_dir FROM jobs WHERE finished IS NOT NULL").fetchall()
        return [(r["id"], r["finished"], self._path(r["out_dir"])) for r in rows]

    def job(self, job_id: str, now: float) -> dict | None:
        """The job with its images, its state, the images queued ahead of it and an ETA."""
        with self.lock:
            db = self.db
            job = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if job is None:
                return None
            images = db.execute("SELECT * FROM images WHERE job = ? ORDER BY ord", (job_id,)).fetchall()
            ahead = db.execute(f"SELECT COUNT(*) FROM images i JOIN jobs j ON j.id = i.job WHERE i.state = ? AND "
                               f"i.job != ? AND {RANK_SQL} < ?", (ImageState.QUEUED, job_id, schedule.rank(
                                   job["priority"], job["submitted"], job["front"]))).fetchone()[0]
            rate = self._drain_rate(db, now)
            eta = self._eta(db, job, now)
        states = Counter(r["state"] for r in images)
        state = schedule.job_state(states, bool(job["canceled"]))
        left = sum(states[s] for s in ImageState.OPEN)
        return {"id": job["id"], "name": job["name"], "state": state, "priority": job["priority"],
                "submitted": job["submitted"], "finished": job["finished"], "out_dir": str(self._path(job["out_dir"])),
                "images_by_state": dict(states), "queue_position": ahead if left else None,
                "eta_s": None if not left else open_seconds(eta) if eta is not None else
                open_seconds((ahead + left) / rate) if rate else None,
                "images": [{"id": r["id"], "shot": r["shot"], "candidate": r["k"], "seed": r["seed"],
                            "state": r["state"], "attempts": r["attempts"], "cached": bool(r["cached"]),
                            "reason": r["reason"], "outputs": json.loads(r["outputs"])} for r in images]}
