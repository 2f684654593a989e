"""The queue's figures: counters and histograms kept in the queue file (so /metrics totals survive a
restart), the drain rate, and what /metrics reads (`stats`, `slo_stats`). `QueueStats`: the part of
`store.Store` that counts, observes and reads them. Torch-free.
"""

from __future__ import annotations

import json
from collections import Counter

from storyboard_cli.serve import schedule
from storyboard_cli.serve.queue_file import QueueFile
from storyboard_cli.serve.queue_workers import Seen
from storyboard_cli.serve.schedule import TIERS, ImageState, JobState

DRAIN_WINDOW_S = 300.0

# counters kept in the database, so /metrics totals survive a restart
RENDERED, CACHED, FAILED, EXPIRED, LATE, REJECTED_FULL, REJECTED_INVALID, RETRIES, OOMS, MODEL_LOADS = (
    "images_rendered", "images_cached", "images_failed", "lease_expiries", "late_completions",
    "rejected_queue_full", "rejected_invalid", "image_retries", "out_of_memory", "model_loads")
# leases a worker gave back for an error of its own machine (its device), workers quarantined for it
STRIKES, QUARANTINES = "worker_strikes", "worker_quarantines"
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


class QueueStats(QueueFile):
    """Counters, histograms and the reads /metrics shows."""

    def __init__(self, root):
        super().__init__(root)
        self._final: dict[str, tuple[float, str]] = {}  # a finished job: (when it finished, its state)

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

    def _drain_rate(self, db, now: float) -> float | None:
        """Images finished per second over the last few minutes, or since the first job was submitted if
        that is later (None before any has)."""
        since = now - DRAIN_WINDOW_S
        n = db.execute("SELECT COUNT(*) FROM images WHERE done >= ?", (since,)).fetchone()[0]
        first = db.execute("SELECT MIN(submitted) FROM jobs").fetchone()[0]
        return n / max(now - max(since, first), 1.0) if n else None

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
            jobs = self._job_states(db)
            counters = {r[0]: r[1] for r in db.execute("SELECT name, value FROM counters")}
            leases = db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
            histograms: dict[tuple[str, str], tuple[list[int], float]] = {}
            for name, label, total in db.execute("SELECT name, label, total FROM histogram_sums"):
                histograms[name, label] = ([0] * (len(bounds(name)) + 1), total)
            for name, label, bucket, n in db.execute("SELECT name, label, bucket, n FROM histograms"):
                histograms[name, label][0][bucket] = n
            seen = db.execute("SELECT id, name, gpu, ready, quarantined FROM workers WHERE seen >= ? ORDER BY id",
                              (now - worker_window_s,)).fetchall()
            rate = self._drain_rate(db, now)
        return {"depth": depth, "jobs": {s: jobs[s] for s in JobState.ALL}, "counters": counters, "leases": leases,
                "histograms": histograms,
                "workers": [Seen(r["id"], r["name"], json.loads(r["gpu"] or "null"), bool(r["ready"]), r["quarantined"])
                            for r in seen],
                "images_per_s": rate or 0.0}

    def _job_states(self, db) -> Counter:
        """Jobs per state. A finished job's state is read from its images once and kept (`_final`, with the time it
        finished: a retry that runs it again changes that), so a scrape reads the images of the open jobs only, not
        every image the queue ever finished."""
        final, jobs = self._final, Counter()
        for job_id, canceled, finished in db.execute("SELECT id, canceled, finished FROM jobs").fetchall():
            kept = final.get(job_id)
            if finished is not None and kept is not None and kept[0] == finished:
                jobs[kept[1]] += 1
                continue
            states = Counter(dict(db.execute("SELECT state, COUNT(*) FROM images WHERE job = ? GROUP BY state",
                                             (job_id,)).fetchall()))
            if not states:
                continue
            state = schedule.job_state(states, bool(canceled))
            if finished is not None:
                final[job_id] = (finished, state)
            jobs[state] += 1
        return jobs

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
