"""The durable queue: one SQLite file under the server's root (WAL, synchronous=FULL: a job the API
accepted survives kill -9 and a power cut). One process writes it (the server; workers reach it over
HTTP), one connection behind one lock. Torch-free.

Leases: a worker leases one batch of one job for `ttl` seconds and renews it by heartbeat. A lease that
expires goes back to the queue; an image whose lease was lost MAX_ATTEMPTS times fails. A completion for a
lease that is gone (expired, its images leased again) is ignored and counted.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import schedule
from storyboard_cli.serve.intake import Planned
from storyboard_cli.serve.schedule import MAX_ATTEMPTS, TIERS, ImageState, JobState, Waiting

DB = "queue.sqlite3"
DRAIN_WINDOW_S = 300.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, idem_key TEXT UNIQUE, content_hash TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
  out_dir TEXT NOT NULL, priority TEXT NOT NULL, submitted REAL NOT NULL, batch INTEGER NOT NULL,
  canceled INTEGER NOT NULL DEFAULT 0, finished REAL);
CREATE TABLE IF NOT EXISTS images (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL REFERENCES jobs(id), ord INTEGER NOT NULL, shot TEXT NOT NULL,
  k INTEGER NOT NULL, seed INTEGER NOT NULL, outputs TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
  state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, lease TEXT, reason TEXT, cached INTEGER NOT NULL DEFAULT 0,
  done REAL);
CREATE INDEX IF NOT EXISTS images_state ON images(state);
CREATE INDEX IF NOT EXISTS images_job ON images(job);
CREATE INDEX IF NOT EXISTS images_fingerprint ON images(fingerprint, state);
CREATE TABLE IF NOT EXISTS leases (id TEXT PRIMARY KEY, worker TEXT NOT NULL, job TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

# counters kept in the database, so /metrics totals survive a restart
RENDERED, CACHED, FAILED, EXPIRED, LATE, REJECTED_FULL, REJECTED_INVALID = (
    "images_rendered", "images_cached", "images_failed", "lease_expiries", "late_completions",
    "rejected_queue_full", "rejected_invalid")


class QueueFull(Exception):
    """Refused whole: the queue holds too many images. `retry_after` in seconds."""

    def __init__(self, retry_after: int, depth: int):
        super().__init__(f"the queue holds {depth} images; retry in {retry_after} s")
        self.retry_after, self.depth = retry_after, depth


class IdempotencyConflict(BadInput):
    """The same Idempotency-Key came with another body."""


class Store:
    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(root / DB, isolation_level=None, check_same_thread=False, timeout=30)
        self.db.row_factory = sqlite3.Row
        self.lock = threading.Lock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
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

    # submission

    def replay(self, key: str, content_hash: str) -> str | None:
        """The job first submitted with this Idempotency-Key, if any; raises IdempotencyConflict when it
        came with another body."""
        with self.lock:
            return self._replay(self.db, key, content_hash)

    def _replay(self, db, key: str, content_hash: str) -> str | None:
        row = db.execute("SELECT id, content_hash FROM jobs WHERE idem_key = ?", (key,)).fetchone()
        if row and row["content_hash"] != content_hash:
            raise IdempotencyConflict(f"Idempotency-Key {key!r} was used for another job ({row['id']})")
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

    def _insert(self, db, job: Planned, key: str | None, now: float) -> None:
        db.execute("INSERT INTO jobs (id, idem_key, content_hash, name, path, out_dir, priority, submitted, batch)"
                   " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (job.id, key, job.content_hash, job.name, str(job.path), str(job.out_dir), job.priority, now,
                    job.batch))
        db.executemany("INSERT INTO images (job, ord, shot, k, seed, outputs, key, fingerprint, state)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       [(job.id, i.order, i.shot, i.k, i.seed, json.dumps(i.outputs), i.key, i.fingerprint,
                         ImageState.QUEUED) for i in job.images])

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

    def lease(self, worker: str, now: float, ttl: float) -> dict | None:
        """The next batch for `worker`, or None when nothing is free."""
        with self._tx() as db:
            self._expire(db, now)
            rows = db.execute("SELECT i.id, i.job, i.key, i.fingerprint, i.ord, j.priority, j.submitted, j.batch "
                              "FROM images i JOIN jobs j ON j.id = i.job WHERE i.state = ?", (ImageState.QUEUED,))
            waiting = [Waiting(r["id"], r["job"], r["priority"], r["submitted"], r["key"], r["fingerprint"], r["ord"],
                               r["batch"]) for r in rows]
            busy_jobs = {r[0] for r in db.execute("SELECT job FROM leases")}
            busy_fps = {r[0] for r in db.execute("SELECT fingerprint FROM images WHERE state = ?",
                                                 (ImageState.LEASED,))}
            picked = schedule.pick(waiting, busy_jobs, busy_fps)
            if not picked:
                return None
            lease_id, job_id = uuid.uuid4().hex, picked[0].job
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?)", (lease_id, worker, job_id, now + ttl))
            ids = [w.image for w in picked]
            db.executemany("UPDATE images SET state = ?, lease = ?, attempts = attempts + 1 WHERE id = ?",
                           [(ImageState.LEASED, lease_id, i) for i in ids])
            job = db.execute("SELECT path, out_dir FROM jobs WHERE id = ?", (job_id,)).fetchone()
            images = []
            for i in ids:
                r = db.execute("SELECT outputs, fingerprint FROM images WHERE id = ?", (i,)).fetchone()
                images.append({"id": i, "outputs": json.loads(r["outputs"]), "twin": self._twin(db, r["fingerprint"])})
            return {"lease": lease_id, "job": job_id, "path": job["path"], "out_dir": job["out_dir"],
                    "expires": now + ttl, "ttl": ttl, "images": images}

    def _twin(self, db, fingerprint: str) -> str | None:
        """A PNG already rendered with this fingerprint (any job): the worker copies it instead of rendering."""
        row = db.execute("SELECT j.out_dir, i.outputs FROM images i JOIN jobs j ON j.id = i.job "
                         "WHERE i.fingerprint = ? AND i.state = ? LIMIT 1", (fingerprint, ImageState.DONE)).fetchone()
        return str(Path(row["out_dir"]) / json.loads(row["outputs"])[0]) if row else None

    def heartbeat(self, lease_id: str, now: float, ttl: float) -> bool:
        """Extends the lease; False when it is gone (the worker's results will be ignored)."""
        with self._tx() as db:
            self._expire(db, now)
            return db.execute("UPDATE leases SET expires = ? WHERE id = ?", (now + ttl, lease_id)).rowcount == 1

    def complete(self, lease_id: str, done: list[int], cached: list[int], failed: dict[int, str], now: float) -> bool:
        """Records a lease's results; its images not named go back to the queue without a strike (a worker
        stopping). False, and nothing recorded, when the lease is gone."""
        with self._tx() as db:
            self._expire(db, now)
            lease = db.execute("SELECT job FROM leases WHERE id = ?", (lease_id,)).fetchone()
            if lease is None:
                self._count(db, LATE)
                return False
            canceled = db.execute("SELECT canceled FROM jobs WHERE id = ?", (lease["job"],)).fetchone()[0]
            for (image,) in db.execute("SELECT id FROM images WHERE lease = ?", (lease_id,)).fetchall():
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
            self._count(db, RENDERED, len(set(done) - set(cached)))
            self._count(db, CACHED, len(set(cached) & set(done)))
            self._count(db, FAILED, len(failed))
            self._finished(db, lease["job"], now)
            return True

    def _expire(self, db, now: float) -> None:
        for lease in db.execute("SELECT id, job FROM leases WHERE expires < ?", (now,)).fetchall():
            db.execute("UPDATE images SET state = ?, reason = ?, done = ?, lease = NULL WHERE lease = ? "
                       "AND attempts >= ?", (ImageState.FAILED, f"its worker was lost {MAX_ATTEMPTS} times", now,
                                             lease["id"], MAX_ATTEMPTS))
            failed = db.execute("SELECT changes()").fetchone()[0]
            db.execute("UPDATE images SET state = ?, lease = NULL WHERE lease = ?", (ImageState.QUEUED, lease["id"]))
            db.execute("DELETE FROM leases WHERE id = ?", (lease["id"],))
            self._count(db, EXPIRED)
            self._count(db, FAILED, failed)
            self._finished(db, lease["job"], now)

    def _finished(self, db, job_id: str, now: float) -> None:
        open_ = db.execute("SELECT COUNT(*) FROM images WHERE job = ? AND state IN (?, ?)",
                           (job_id, *ImageState.OPEN)).fetchone()[0]
        if not open_:
            db.execute("UPDATE jobs SET finished = COALESCE(finished, ?) WHERE id = ?", (now, job_id))

    def expire(self, now: float) -> None:
        with self._tx() as db:
            self._expire(db, now)

    # jobs

    def cancel(self, job_id: str, now: float) -> bool:
        """Queued images are canceled at once; leased ones when their batch is done."""
        with self._tx() as db:
            if not db.execute("UPDATE jobs SET canceled = 1 WHERE id = ?", (job_id,)).rowcount:
                return False
            db.execute("UPDATE images SET state = ? WHERE job = ? AND state = ?",
                       (ImageState.CANCELED, job_id, ImageState.QUEUED))
            self._finished(db, job_id, now)
            return True

    def set_priority(self, job_id: str, priority: str) -> bool:
        if priority not in TIERS:
            raise BadInput(f"priority must be one of {', '.join(TIERS)}, got {priority!r}")
        with self._tx() as db:
            return db.execute("UPDATE jobs SET priority = ? WHERE id = ?", (priority, job_id)).rowcount == 1

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

    def stats(self) -> dict:
        """What /metrics shows: queue depth per priority (images, jobs), jobs per state, the counters."""
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
        jobs = Counter(schedule.job_state(c, canceled[j]) for j, c in per_job.items())
        return {"depth": depth, "jobs": {s: jobs[s] for s in JobState.ALL}, "counters": counters, "leases": leases}
