"""The durable queue: one SQLite file under the server's root (WAL, synchronous=FULL: a job the API
accepted survives kill -9 and a power cut). One process writes it (the server; workers reach it over
HTTP), one connection behind one lock. Torch-free.

Leases: a worker leases one batch of one job for `ttl` seconds and renews it by heartbeat. A lease that
expires goes back to the queue; an image whose lease was lost MAX_ATTEMPTS times fails. A completion for a
lease that is gone (expired, its images leased again) is ignored and counted.

Workers: the server issues each worker its id on registration, and forgets it once it has not been seen for
its ttl (--lease-s) and holds no lease. Leases and heartbeats name that id, so the worker table (and the
metric series per worker) holds at most --max-workers live rows, whatever names clients invent.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import schedule
from storyboard_cli.serve.intake import Planned
from storyboard_cli.serve.schedule import END, MAX_ATTEMPTS, TIERS, ImageState, JobState, Waiting

DB = "queue.sqlite3"
DRAIN_WINDOW_S = 300.0
APPLICATION_ID = 0x62636771  # PRAGMA application_id of a bcg queue ("bcgq"): another program's SQLite file is refused
SCHEMA_VERSION = 1  # PRAGMA user_version: a queue written by a newer bcg is refused, not rewritten
KEEP = "the file is the only record of the jobs this server accepted: keep it, never delete or overwrite it"

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, idem_key TEXT UNIQUE, content_hash TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
  out_dir TEXT NOT NULL, priority TEXT NOT NULL, submitted REAL NOT NULL, batch INTEGER NOT NULL,
  canceled INTEGER NOT NULL DEFAULT 0, finished REAL);
CREATE TABLE IF NOT EXISTS images (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL REFERENCES jobs(id), ord INTEGER NOT NULL, shot TEXT NOT NULL,
  k INTEGER NOT NULL, seed INTEGER NOT NULL, outputs TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
  state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, lease TEXT, reason TEXT, cached INTEGER NOT NULL DEFAULT 0,
  done REAL, mix TEXT, cost REAL NOT NULL DEFAULT 1);
CREATE INDEX IF NOT EXISTS images_state ON images(state);
CREATE INDEX IF NOT EXISTS images_job ON images(job);
CREATE INDEX IF NOT EXISTS images_fingerprint ON images(fingerprint, state);
CREATE TABLE IF NOT EXISTS leases (id TEXT PRIMARY KEY, worker TEXT NOT NULL, job TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, kind TEXT NOT NULL,
  data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_job ON events(job, seq);
CREATE TABLE IF NOT EXISTS histograms (name TEXT NOT NULL, label TEXT NOT NULL, bucket INTEGER NOT NULL,
  n INTEGER NOT NULL, PRIMARY KEY (name, label, bucket));
CREATE TABLE IF NOT EXISTS histogram_sums (name TEXT NOT NULL, label TEXT NOT NULL, total REAL NOT NULL,
  PRIMARY KEY (name, label));
CREATE TABLE IF NOT EXISTS workers (id TEXT PRIMARY KEY, name TEXT NOT NULL, seen REAL NOT NULL, ttl REAL NOT NULL,
  gpu TEXT, ready INTEGER NOT NULL DEFAULT 0, first_ready REAL);
"""
# a queue made before application_id was set holds only these (sqlite_sequence: AUTOINCREMENT's)
QUEUE_TABLES = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA)) | {"sqlite_sequence"}

# counters kept in the database, so /metrics totals survive a restart
RENDERED, CACHED, FAILED, EXPIRED, LATE, REJECTED_FULL, REJECTED_INVALID, RETRIES, OOMS, MODEL_LOADS = (
    "images_rendered", "images_cached", "images_failed", "lease_expiries", "late_completions",
    "rejected_queue_full", "rejected_invalid", "image_retries", "out_of_memory", "model_loads")
# histograms kept in the database (observations per bucket, and their sum)
QUEUE_WAIT, IMAGE_RENDER, JOB_LATENCY, BATCH_SECONDS = "queue_wait", "image_render", "job_latency", "batch"
BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# the SLO histograms: submission to a job's first finished image (label: the job's priority), a batch's real
# rows over its bucket's rows, a worker's seconds from its start to the first lease it takes ready
FIRST_IMAGE, BATCH_FILL, WORKER_STARTUP = "first_image", "batch_fill", "worker_startup"
FILL_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)  # eighths: a bucket of 8 one row at a time
BUCKETS = {BATCH_FILL: FILL_BUCKETS}  # a histogram's own bounds; every other one is in seconds, BUCKETS_S


def bounds(name: str) -> tuple[float, ...]:
    """The histogram's bucket bounds (the +Inf bucket after the last)."""
    return BUCKETS.get(name, BUCKETS_S)


@dataclass(frozen=True)
class Work:
    """What a worker measured while rendering a lease: (shape, images, seconds, bucket or None) per batch,
    out-of-memory retries, model loads."""

    batches: tuple[tuple, ...] = ()  # (shape, images, seconds[, bucket])
    out_of_memory: int = 0
    model_loads: int = 0


@dataclass(frozen=True)
class Seen:
    """A registered worker seen lately: its issued id, its name, its GPU figures (None on a CPU), ready."""

    id: str
    name: str
    gpu: dict | None
    ready: bool


class QueueFull(Exception):
    """Refused whole: the queue holds too many images. `retry_after` in seconds."""

    def __init__(self, retry_after: int, depth: int):
        super().__init__(f"the queue holds {depth} images; retry in {retry_after} s")
        self.retry_after, self.depth = retry_after, depth


class TooManyWorkers(Exception):
    """Refused registration: --max-workers registrations are live. `retry_after` in seconds (until the
    first of them can expire)."""

    def __init__(self, retry_after: int, live: int):
        super().__init__(f"{live} workers are registered, the most this server takes; retry in {retry_after} s")
        self.retry_after = retry_after


class UnknownWorker(Exception):
    """A worker id this server did not issue, or whose registration expired: the worker registers again."""

    def __init__(self, worker: str):
        super().__init__(f"worker {worker[:80]!r} is not registered here (or no longer): register again "
                         "(POST /v1/workers)")


class IdempotencyConflict(BadInput):
    """The same Idempotency-Key came with another body."""


class JobFinal(Exception):
    """The job is already succeeded, failed or canceled: a cancel or a priority change would rewrite its
    outcome, so it is refused and nothing changes. `state`: that final state."""

    def __init__(self, job_id: str, state: str):
        super().__init__(f"job {job_id} is already {state}")
        self.state = state


class QueueUnusable(BadInput):
    """The queue file cannot be this server's queue (damaged, another program's, read-only, of a newer bcg);
    refused before anything was written to it."""


def _open(root: Path) -> sqlite3.Connection:
    """The queue's connection (WAL, synchronous=FULL, stamped as a bcg queue). What could be someone's data
    is only read until it is known to be a bcg queue this server can write; else QueueUnusable, one line."""
    path = root / DB
    _check_writable(root, path)
    try:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    except sqlite3.Error as e:
        raise _unusable(path, e) from None
    try:
        db.row_factory = sqlite3.Row
        _identify(db, path)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # a write: a queue that cannot take one fails here
    except sqlite3.Error as e:
        db.close()
        raise _unusable(path, e) from None
    except BaseException:
        db.close()
        raise
    return db


def _check_writable(root: Path, path: Path) -> None:
    """The root folder made, and it and the queue file writable. The mode is read too, not only access():
    root may write a 0444 file, and a file or folder someone made read-only is not the server's to write."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QueueUnusable(f"--root {root}: cannot make the folder ({e.strerror or e})") from None
    keep = f"; {KEEP}" if path.exists() else ""
    if not os.access(root, os.W_OK) or not root.stat().st_mode & 0o222:
        raise QueueUnusable(f"--root {root} is read-only: the queue {path} and its journal are written there; "
                            f"make the folder writable, or start on a copy in a writable folder{keep}")
    if path.exists() and (not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222):
        raise QueueUnusable(f"{path} is read-only (mode {path.stat().st_mode & 0o777:o}): every job the server "
                            f"accepts is written there; make it writable (chmod u+w){keep}")


def _identify(db: sqlite3.Connection, path: Path) -> None:
    """Reads (never writes) the file's header and tables: a bcg queue, an empty file, or a queue made before
    the header was stamped pass; another program's database and a newer bcg's queue are refused."""
    tables = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if app_id != APPLICATION_ID and (app_id or not set(tables) <= QUEUE_TABLES):
        shown = ", ".join(t[:40] for t in tables[:3]) + (", ..." if len(tables) > 3 else "")
        owner = f"application id {app_id:#x}, " if app_id else ""
        raise QueueUnusable(f"{path} is not a bcg queue but another program's SQLite database ({owner}tables: "
                            f"{shown or 'none'}); bcg left it untouched: give --root a folder of its own")
    if version > SCHEMA_VERSION:
        raise QueueUnusable(f"{path} is the queue of a newer bcg (schema {version}, this one reads up to "
                            f"{SCHEMA_VERSION}): serve it with that bcg; {KEEP}")


def _unusable(path: Path, e: sqlite3.Error) -> QueueUnusable:
    """SQLite's refusal as the line a person can act on."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF  # the primary result code
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return QueueUnusable(f"{path} is damaged or not a SQLite database ({e}); {KEEP} (`sqlite3 {path} "
                             ".recover` may save its jobs) and start on another --root meanwhile")
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM):
        return QueueUnusable(f"{path} cannot be written ({e}): make it and its folder writable; {KEEP}")
    return QueueUnusable(f"{path}: the queue cannot be opened ({e}); {KEEP}")


class Store:
    def __init__(self, root: Path):
        self.db = _open(root)  # raises QueueUnusable
        self.lock = threading.Lock()
        self.db.executescript(SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(images)")}
        if "mix" not in columns:  # a queue of v1
            self.db.execute("ALTER TABLE images ADD COLUMN mix TEXT")
        if "cost" not in columns:  # before batches were ordered by their work
            self.db.execute("ALTER TABLE images ADD COLUMN cost REAL NOT NULL DEFAULT 1")
        worker_columns = {r["name"] for r in self.db.execute("PRAGMA table_info(workers)")}
        if "ttl" in worker_columns and "first_ready" not in worker_columns:  # before the start-up histogram
            self.db.execute("ALTER TABLE workers ADD COLUMN first_ready REAL")
        if "ttl" not in worker_columns:  # before registration
            self.db.execute("DROP TABLE workers")  # rows named by the workers themselves: they register again
            self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _count(self, db, name: str, n: int = 1) -> None:
        if n:
            db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                       (name, n, n))

    def count(self, name: str, n: int = 1) -> None:
        with self._tx() as db:
            self._count(db, name, n)

    def _observe(self, db, name: str, label: str, value: float) -> None:
        les = bounds(name)
        bucket = next((i for i, le in enumerate(les) if value <= le), len(les))  # last: +Inf
        db.execute("INSERT INTO histograms VALUES (?, ?, ?, 1) ON CONFLICT(name, label, bucket) DO UPDATE "
                   "SET n = n + 1", (name, label, bucket))
        db.execute("INSERT INTO histogram_sums VALUES (?, ?, ?) ON CONFLICT(name, label) DO UPDATE "
                   "SET total = total + ?", (name, label, value, value))

    def _event(self, db, job_id: str, kind: str, now: float, **data) -> None:
        """One step of the job's progress stream, written in the transaction that made it (so a reader
        resuming after event n misses none and sees none twice). None after the stream's `end`: the job's
        last event says its final state (a canceled job's leased images may still finish, unannounced)."""
        job = db.execute("SELECT canceled, finished FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if kind != END and (job["canceled"] or job["finished"] is not None):  # its `end` is written
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

    # workers: ids issued on registration, forgotten with their last lease

    def register_worker(self, name: str, now: float, max_workers: int, ttl: float) -> str:
        """A new worker id (`w-` and 12 hex digits) for the worker called `name`. Raises TooManyWorkers while
        `max_workers` registrations are live (seen within their `ttl`, or holding a live lease): each has its own
        metric series. `name` is checked at the edge (wire.Registration)."""
        with self._tx() as db:
            self._forget(db, now)
            live = db.execute("SELECT COUNT(*), MIN(seen + ttl) FROM workers").fetchone()
            if live[0] >= max_workers:
                full = TooManyWorkers(max(math.ceil(live[1] - now), 1), live[0])
            else:
                full, worker = None, f"w-{uuid.uuid4().hex[:12]}"
                db.execute("INSERT INTO workers (id, name, seen, ttl) VALUES (?, ?, ?, ?)", (worker, name, now, ttl))
        if full is not None:  # raised after the commit: the expired registrations stay forgotten
            raise full
        return worker

    def seen(self, worker: str, gpu: dict | None, now: float, ready: bool = False) -> None:
        """A worker asked for work or renewed a lease; `gpu`: its device's memory and utilisation (None on
        a CPU); `ready`: its model is loaded and its graphs captured. Raises UnknownWorker."""
        with self._tx() as db:
            self._seen(db, worker, gpu, now, ready)

    def _seen(self, db, worker: str, gpu: dict | None, now: float, ready: bool = False) -> None:
        self._forget(db, now)
        if db.execute("SELECT 1 FROM workers WHERE id = ?", (worker,)).fetchone() is None:  # never issued, or expired
            raise UnknownWorker(worker)
        db.execute("UPDATE workers SET seen = ?, gpu = ?, ready = ? WHERE id = ?",
                   (now, json.dumps(gpu), ready, worker))

    def _forget(self, db, now: float) -> None:
        """Registrations not seen within their ttl and holding no live lease: their ids and series are gone."""
        db.execute("DELETE FROM workers WHERE seen + ttl < ? AND id NOT IN "
                   "(SELECT worker FROM leases WHERE expires >= ?)", (now, now))

    def readiness(self, now: float, window_s: float) -> tuple[int, int]:
        """(registered workers seen within the window, those of them ready): a worker that stops asking for
        work and heartbeating drops out of both."""
        with self.lock:
            row = self.db.execute("SELECT COUNT(*), COALESCE(SUM(ready), 0) FROM workers WHERE seen >= ?",
                                  (now - window_s,)).fetchone()
        return row[0], row[1]

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
                refused = QueueFull(schedule.retry_after(depth + n - max_queue, self._drain_rate(db, now)), depth)
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
            refused = QueueFull(schedule.retry_after(depth + 1 - max_queue, self._drain_rate(db, now)), depth)
        raise refused

    def _insert(self, db, job: Planned, key: str | None, now: float) -> None:
        db.execute("INSERT INTO jobs (id, idem_key, content_hash, name, path, out_dir, priority, submitted, batch)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (job.id, key, job.content_hash, job.name, str(job.path), str(job.out_dir), job.priority, now,
                    job.batch))
        db.executemany("INSERT INTO images (job, ord, shot, k, seed, outputs, key, fingerprint, state, mix, cost)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       [(job.id, i.order, i.shot, i.k, i.seed, json.dumps(i.outputs), i.key, i.fingerprint,
                         ImageState.QUEUED, i.mix, i.cost) for i in job.images])
        self._event(db, job.id, "queued", now, priority=job.priority)

    def _depth(self, db) -> int:
        return db.execute("SELECT COUNT(*) FROM images WHERE state IN (?, ?)", ImageState.OPEN).fetchone()[0]

    def _drain_rate(self, db, now: float) -> float | None:
        """Images finished per second over the last few minutes, or since the first job was submitted if
        that is later (None before any has)."""
        since = now - DRAIN_WINDOW_S
        n = db.execute("SELECT COUNT(*) FROM images WHERE done >= ?", (since,)).fetchone()[0]
        first = db.execute("SELECT MIN(submitted) FROM jobs").fetchone()[0]
        return n / max(now - max(since, first), 1.0) if n else None

    # leases

    def lease(self, worker: str, now: float, ttl: float, gpu: dict | None = None, ready: bool = False,
              warm: frozenset[str] = frozenset(), uptime_s: float | None = None) -> dict | None:
        """The next batch for `worker`, or None when nothing is free: `job` (the head job, the best ranked),
        `jobs` (each job of the batch: its job file and output folder), `images` (each with its job and mix).
        `warm`: the mixes the worker has prepared (schedule.pick prefers them)."""
        with self._tx() as db:
            self._seen(db, worker, gpu, now, ready)
            self._expire(db, now)
            rows = db.execute("SELECT i.id, i.job, i.key, i.fingerprint, i.ord, i.mix, i.cost, j.priority, "
                              "j.submitted, j.batch FROM images i JOIN jobs j ON j.id = i.job WHERE i.state = ?",
                              (ImageState.QUEUED,))
            waiting = [Waiting(r["id"], r["job"], r["priority"], r["submitted"], r["key"], r["fingerprint"], r["ord"],
                               r["batch"], r["mix"], r["cost"]) for r in rows]
            busy = db.execute("SELECT fingerprint FROM images WHERE state = ?", (ImageState.LEASED,)).fetchall()
            picked = schedule.pick(waiting, {r[0] for r in busy}, warm)
            if not picked:
                return None
            lease_id, head = uuid.uuid4().hex, picked[0].job
            if ready and uptime_s is not None and db.execute(
                    "UPDATE workers SET first_ready = ? WHERE id = ? AND first_ready IS NULL", (now, worker)).rowcount:
                self._observe(db, WORKER_STARTUP, "", uptime_s)  # its first lease taken ready
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?)", (lease_id, worker, head, now + ttl))
            ids = [w.image for w in picked]
            for image, attempts, submitted, priority in db.execute(
                    f"SELECT i.id, i.attempts, j.submitted, j.priority FROM images i JOIN jobs j ON j.id = i.job "
                    f"WHERE i.id IN ({','.join('?' * len(ids))})", ids).fetchall():
                if attempts:  # its last lease was lost
                    self._count(db, RETRIES)
                else:
                    self._observe(db, QUEUE_WAIT, priority, now - submitted)
            db.executemany("UPDATE images SET state = ?, lease = ?, attempts = attempts + 1 WHERE id = ?",
                           [(ImageState.LEASED, lease_id, i) for i in ids])
            images, jobs = [], {}
            for w in picked:
                r = db.execute("SELECT outputs, fingerprint FROM images WHERE id = ?", (w.image,)).fetchone()
                images.append({"id": w.image, "job": w.job, "outputs": json.loads(r["outputs"]), "mix": w.mix,
                               **self._twin(db, r["fingerprint"])})
                if w.job not in jobs:
                    job = db.execute("SELECT path, out_dir FROM jobs WHERE id = ?", (w.job,)).fetchone()
                    jobs[w.job] = {"path": job["path"], "out_dir": job["out_dir"]}
            for job_id in jobs:
                self._event(db, job_id, "running", now, worker=worker, lease=lease_id,
                            images=[w.image for w in picked if w.job == job_id])
            return {"lease": lease_id, "job": head, "jobs": jobs, "expires": now + ttl, "ttl": ttl, "images": images}

    def _twin(self, db, fingerprint: str) -> dict:
        """A PNG already rendered with this fingerprint (any job), which the worker copies instead of
        rendering: `twin`, its path on the server, and `twin_of`, [its job, its output path]."""
        row = db.execute("SELECT j.id, j.out_dir, i.outputs FROM images i JOIN jobs j ON j.id = i.job "
                         "WHERE i.fingerprint = ? AND i.state = ? LIMIT 1", (fingerprint, ImageState.DONE)).fetchone()
        if row is None:
            return {"twin": None, "twin_of": None}
        first = json.loads(row["outputs"])[0]
        return {"twin": str(Path(row["out_dir"]) / first), "twin_of": [row["id"], first]}

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
                held.setdefault(job_id, (Path(path), Path(out_dir), set()))[2].update(json.loads(outputs))
        return held

    def heartbeat(self, lease_id: str, now: float, ttl: float, worker: str | None = None,
                  gpu: dict | None = None, ready: bool = False) -> bool:
        """Extends the lease; False when it is gone (the worker's results will be ignored)."""
        with self._tx() as db:
            if worker is not None:
                self._seen(db, worker, gpu, now, ready)
            self._expire(db, now)
            return db.execute("UPDATE leases SET expires = ? WHERE id = ?", (now + ttl, lease_id)).rowcount == 1

    def complete(self, lease_id: str, done: list[int], cached: list[int], failed: dict[int, str], now: float,
                 work: Work | None = None, record: Callable[[dict[str, set[str]]], None] | None = None) -> bool:
        """Records a lease's results; its images not named go back to the queue without a strike (a worker
        stopping). False, and nothing recorded, when the lease is gone. `record({job: outputs of its done
        images})` runs inside the transaction, before it commits (the job folders' manifest lines): if it
        raises, nothing is recorded."""
        work = work or Work()
        with self._tx() as db:
            self._expire(db, now)
            if db.execute("SELECT 1 FROM leases WHERE id = ?", (lease_id,)).fetchone() is None:
                self._count(db, LATE)
                return False
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

    def sweep(self, now: float) -> None:
        """Expired leases ended now (their images queued again, or failed), not at the next worker's call:
        a job's state and events stay true while no worker is asking (the server calls it periodically)."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM leases WHERE expires < ? LIMIT 1", (now,)).fetchone():
                self._expire(db, now)
            self._forget(db, now)

    def _expire(self, db, now: float) -> None:
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
                self._event(db, job_id, "lease_lost", now,
                            requeued=[r["id"] for r in held if r["job"] == job_id and r["attempts"] < MAX_ATTEMPTS])
                self._finished(db, job_id, now)

    def _finished(self, db, job_id: str, now: float) -> None:
        """Stamps a job whose last image just ended (once), and ends its event stream."""
        open_ = db.execute("SELECT COUNT(*) FROM images WHERE job = ? AND state IN (?, ?)",
                           (job_id, *ImageState.OPEN)).fetchone()[0]
        job = db.execute("SELECT submitted, canceled, finished FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if open_ or job["finished"] is not None:
            return
        db.execute("UPDATE jobs SET finished = ? WHERE id = ?", (now, job_id))
        if not job["canceled"]:  # a canceled job's stream ended when it was canceled
            self._observe(db, JOB_LATENCY, "", now - job["submitted"])
            self._event(db, job_id, END, now)

    def expire(self, now: float) -> None:
        with self._tx() as db:
            self._expire(db, now)

    # jobs

    def cancel(self, job_id: str, now: float) -> bool:
        """Queued images are canceled at once; leased ones when their batch is done (the job is canceled from
        now on, and its stream ends). False for no such job; JobFinal for one already final."""
        with self._tx() as db:
            if not self._open_job(db, job_id):
                return False
            db.execute("UPDATE jobs SET canceled = 1 WHERE id = ?", (job_id,))
            db.execute("UPDATE images SET state = ? WHERE job = ? AND state = ?",
                       (ImageState.CANCELED, job_id, ImageState.QUEUED))
            self._finished(db, job_id, now)
            self._event(db, job_id, END, now)
            return True

    def set_priority(self, job_id: str, priority: str, now: float) -> bool:
        """False for no such job; JobFinal for one already final."""
        if priority not in TIERS:
            raise BadInput(f"priority must be one of {', '.join(TIERS)}, got {priority!r}")
        with self._tx() as db:
            if not self._open_job(db, job_id):
                return False
            db.execute("UPDATE jobs SET priority = ? WHERE id = ?", (priority, job_id))
            self._event(db, job_id, "priority", now, priority=priority)
            return True

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
        return None if row is None else Path(row[0])

    def job(self, job_id: str, now: float) -> dict | None:
        """The job with its images, its state, the images queued ahead of it and an ETA."""
        with self.lock:
            db = self.db
            job = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if job is None:
                return None
            images = db.execute("SELECT * FROM images WHERE job = ? ORDER BY ord", (job_id,)).fetchall()
            ahead = sum(1 for r in db.execute("SELECT j.priority, j.submitted FROM images i JOIN jobs j ON j.id = i.job "
                                              "WHERE i.state = ? AND i.job != ?", (ImageState.QUEUED, job_id))
                        if schedule.rank(r[0], r[1]) < schedule.rank(job["priority"], job["submitted"]))
            rate = self._drain_rate(db, now)
        states = Counter(r["state"] for r in images)
        state = schedule.job_state(states, bool(job["canceled"]))
        left = sum(states[s] for s in ImageState.OPEN)
        return {"id": job["id"], "name": job["name"], "state": state, "priority": job["priority"],
                "submitted": job["submitted"], "finished": job["finished"], "out_dir": job["out_dir"],
                "images_by_state": dict(states), "queue_position": ahead if left else None,
                "eta_s": round((ahead + left) / rate, 1) if rate and left else None,
                "images": [{"id": r["id"], "shot": r["shot"], "candidate": r["k"], "seed": r["seed"],
                            "state": r["state"], "attempts": r["attempts"], "cached": bool(r["cached"]),
                            "reason": r["reason"], "outputs": json.loads(r["outputs"])} for r in images]}

    def stats(self, now: float, worker_window_s: float) -> dict:
        """What /metrics shows: queue depth per priority (images, jobs), jobs per state, the counters, the
        histograms ({(name, label): (per-bucket counts, sum)}), the registered workers seen within the window
        (Seen) and the images finished per second."""
        with self.lock:
            db = self.db
            depth = {p: [0, 0] for p in TIERS}
            for prio, images, jobs in db.execute(
                    "SELECT j.priority, COUNT(*), COUNT(DISTINCT j.id) FROM images i JOIN jobs j ON j.id = i.job "
                    "WHERE i.state IN (?, ?) GROUP BY j.priority", ImageState.OPEN):
                depth[prio] = [images, jobs]
            per_job: dict[str, Counter] = {}
            canceled = {r[0]: bool(r[1]) for r in db.execute("SELECT id, canceled FROM jobs")}
            for job, state, n in db.execute("SELECT job, state, COUNT(*) FROM images GROUP BY job, state"):
                per_job.setdefault(job, Counter())[state] = n
            counters = {r[0]: r[1] for r in db.execute("SELECT name, value FROM counters")}
            leases = db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
            histograms: dict[tuple[str, str], tuple[list[int], float]] = {}
            for name, label, total in db.execute("SELECT name, label, total FROM histogram_sums"):
                histograms[name, label] = ([0] * (len(bounds(name)) + 1), total)
            for name, label, bucket, n in db.execute("SELECT name, label, bucket, n FROM histograms"):
                histograms[name, label][0][bucket] = n
            seen = db.execute("SELECT id, name, gpu, ready FROM workers WHERE seen >= ? ORDER BY id",
                              (now - worker_window_s,)).fetchall()
            rate = self._drain_rate(db, now)
        jobs = Counter(schedule.job_state(c, canceled[j]) for j, c in per_job.items())
        return {"depth": depth, "jobs": {s: jobs[s] for s in JobState.ALL}, "counters": counters, "leases": leases,
                "histograms": histograms,
                "workers": [Seen(r["id"], r["name"], json.loads(r["gpu"] or "null"), bool(r["ready"])) for r in seen],
                "images_per_s": rate or 0.0}

    def slo_stats(self, now: float) -> dict:
        """What /metrics shows beside `stats` for the service objectives: per priority, the seconds the
        oldest image still waiting for a lease has waited since its job's submission (0 when none waits)."""
        with self.lock:
            rows = self.db.execute("SELECT j.priority, MIN(j.submitted) FROM images i JOIN jobs j ON j.id = i.job "
                                   "WHERE i.state = ? GROUP BY j.priority", (ImageState.QUEUED,)).fetchall()
        oldest = {p: 0.0 for p in TIERS}
        oldest.update({prio: max(now - submitted, 0.0) for prio, submitted in rows})
        return {"oldest_queued_s": oldest}

    def _first_image(self, db, job_id: str, landed: int, now: float) -> tuple[str, float] | None:
        """(the job's priority, seconds since its submission) when the `landed` images a completion has just
        recorded as done, in this transaction, are the job's first: what FIRST_IMAGE observes. None otherwise."""
        if not landed:
            return None
        row = db.execute("SELECT priority, submitted, (SELECT COUNT(*) FROM images WHERE job = ? AND state = ?) "
                         "AS done FROM jobs WHERE id = ?", (job_id, ImageState.DONE, job_id)).fetchone()
        return (row["priority"], now - row["submitted"]) if row and row["done"] == landed else None
