"""What the queue page and its API read of the queue: the jobs a page at a time (newest first, filtered by state,
walked by a cursor with no cap on the total), what each job's row adds to its view (the workers rendering it, its
latest image), who rendered each image and for how long, the registered workers as a table, and the queue's
summary per priority. Read-only. `QueueViews`: the part of `store.Store` that reads them. Torch-free.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from storyboard_cli.serve import schedule
from storyboard_cli.serve.queue_file import QueueFile
from storyboard_cli.serve.queue_stats import DRAIN_WINDOW_S
from storyboard_cli.serve.schedule import TIERS, ImageState, JobState

SCAN = 256  # jobs read at once while a page is filled
# schedule.rank of a row of `jobs j`, in SQL (the same float arithmetic): a job's queue position is counted by SQLite,
# not by a Python loop over every queued image, so a page of 50 jobs reads fast with thousands queued
RANK_SQL = ("COALESCE(j.front, j.submitted + CASE j.priority "
            + " ".join(f"WHEN '{p}' THEN {delay!r}" for p, delay in TIERS.items()) + " END)")
OPEN_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})


class WorkerState:
    """A registered worker, as the page shows it: rendering a batch, idle (ready), cold (its model not ready yet),
    draining (its last batch running), drained, quarantined, or lost (not seen within --lease-s)."""

    RENDERING, IDLE, COLD, DRAINING, DRAINED, QUARANTINED, LOST = ("rendering", "idle", "cold", "draining", "drained",
                                                                   "quarantined", "lost")
    ALL = (RENDERING, IDLE, COLD, DRAINING, DRAINED, QUARANTINED, LOST)


@dataclass(frozen=True)
class Page:
    """A page of jobs, newest first: their ids, and the cursor of the next page (None: this is the last)."""

    ids: list[str]
    next: int | None


class QueueViews(QueueFile):
    """The jobs a page at a time, the workers, the queue's summary."""

    def jobs_page(self, states: frozenset[str] | None, before: int | None, limit: int) -> Page:
        """Up to `limit` jobs submitted before the cursor `before` (None: from the newest), newest first, whose state
        is one of `states` (None: any). Final jobs are skipped in SQL when only open ones are asked for (a job is
        stamped `finished` once no image of it is open, and only then)."""
        only_open = states is not None and states <= OPEN_STATES
        ids: list[str] = []
        cursor = before if before is not None else (1 << 62)
        with self.lock:
            db = self.db
            while len(ids) < limit:
                rows = db.execute("SELECT rowid, id, canceled FROM jobs WHERE rowid < ? "
                                  + ("AND finished IS NULL " if only_open else "") + "ORDER BY rowid DESC LIMIT ?",
                                  (cursor, SCAN)).fetchall()
                if not rows:
                    return Page(ids, None)
                counts = self._counts(db, [r["id"] for r in rows])
                for row in rows:
                    cursor = row["rowid"]
                    if states is None or schedule.job_state(counts[row["id"]], bool(row["canceled"])) in states:
                        ids.append(row["id"])
                        if len(ids) == limit:
                            break
            more = db.execute("SELECT 1 FROM jobs WHERE rowid < ? " + ("AND finished IS NULL " if only_open else "")
                              + "LIMIT 1", (cursor,)).fetchone()
        return Page(ids, cursor if more else None)

    def _counts(self, db, job_ids: list[str]) -> dict[str, Counter]:
        counts: dict[str, Counter] = {j: Counter() for j in job_ids}
        for job, state, n in db.execute(f"SELECT job, state, COUNT(*) FROM images WHERE job IN "
                                        f"({','.join('?' * len(job_ids))}) GROUP BY job, state", job_ids):
            counts[job][state] = n
        return counts

    def job_rows(self, job_ids: list[str]) -> dict[str, dict]:
        """What a job's row shows beside its view: `workers` (the ids rendering its images now), `latest` (the shot
        and output of its image finished last, or None) and `front` (moved to the front)."""
        rows = {j: {"workers": [], "latest": None, "front": False} for j in job_ids}
        if not job_ids:
            return rows
        marks = ",".join("?" * len(job_ids))
        with self.lock:
            for job, worker in self.db.execute(f"SELECT DISTINCT job, worker FROM images WHERE job IN ({marks}) AND "
                                               f"state = ? AND worker IS NOT NULL ORDER BY worker",
                                               (*job_ids, ImageState.LEASED)):
                rows[job]["workers"].append(worker)
            for job, shot, outputs in self.db.execute(
                    f"SELECT job, shot, outputs FROM images i WHERE job IN ({marks}) AND state = ? AND done = "
                    f"(SELECT MAX(done) FROM images WHERE job = i.job AND state = ?) GROUP BY job",
                    (*job_ids, ImageState.DONE, ImageState.DONE)):
                rows[job]["latest"] = (shot, json.loads(outputs)[0])
            for job, front in self.db.execute(f"SELECT id, front FROM jobs WHERE id IN ({marks})", job_ids):
                rows[job]["front"] = front is not None
        return rows

    def image_runs(self, job_id: str, now: float) -> dict[int, dict]:
        """Each image of the job that was leased: the worker of its last lease and its seconds (lease to done, or to
        now while it renders)."""
        with self.lock:
            rows = self.db.execute("SELECT id, worker, leased, done, state FROM images WHERE job = ? AND leased IS NOT "
                                   "NULL", (job_id,)).fetchall()
        return {r["id"]: {"worker": r["worker"],
                          "seconds": round(max((r["done"] if r["done"] is not None else now) - r["leased"], 0.0), 3)
                          if r["state"] != ImageState.QUEUED else None} for r in rows}

    def workers_table(self, now: float, window_s: float) -> list[dict]:
        """Every registered worker: its id, name, state (WorkerState), its current lease (job, images, bucket key),
        its warm mixes, seconds since it was last heard from, images per second over the drain window, its GPU
        figures (None on a CPU), strikes and why it is quarantined."""
        with self.lock:
            db = self.db
            workers = db.execute("SELECT * FROM workers ORDER BY name, id").fetchall()
            drained = self._dispatch(db).drained
            leases = {r["worker"]: r for r in db.execute(
                "SELECT l.worker, l.id, l.job, l.expires, COUNT(i.id) AS images, MIN(i.key) AS key FROM leases l "
                "LEFT JOIN images i ON i.lease = l.id GROUP BY l.id")}
            since = now - DRAIN_WINDOW_S
            rates = {r[0]: r[1] / max(now - max(since, r[2]), 1.0) for r in db.execute(
                "SELECT worker, COUNT(*), MIN(leased) FROM images WHERE state = ? AND done >= ? AND worker IS NOT "
                "NULL GROUP BY worker", (ImageState.DONE, since))}
        table = []
        for w in workers:
            lease = leases.get(w["id"])
            table.append({
                "id": w["id"], "name": w["name"],
                "state": _worker_state(w, w["name"] in drained, lease is not None, now - w["seen"] <= window_s),
                "job": lease["job"] if lease else None, "lease": lease["id"] if lease else None,
                "images": lease["images"] if lease else 0, "shape": lease["key"] if lease else None,
                "warm": json.loads(w["warm"] or "[]"), "heartbeat_age_s": round(max(now - w["seen"], 0.0), 3),
                "images_per_s": round(rates.get(w["id"], 0.0), 4), "gpu": json.loads(w["gpu"] or "null"),
                "ready": bool(w["ready"]), "draining": w["name"] in drained, "strikes": w["strikes"],
                "quarantined": w["quarantined"]})
        return table

    def summary(self, now: float) -> dict:
        """The queue per priority (images queued, rendering, jobs open, the oldest queued image's age), the leases,
        images finished per second (the drain rate), and the global stream's last id."""
        with self.lock:
            db = self.db
            tiers = {p: {"queued": 0, "rendering": 0, "jobs": 0, "oldest_s": 0.0} for p in TIERS}
            for prio, state, images, jobs, oldest in db.execute(
                    "SELECT j.priority, i.state, COUNT(*), COUNT(DISTINCT j.id), MIN(j.submitted) FROM images i JOIN "
                    "jobs j ON j.id = i.job WHERE i.state IN (?, ?) GROUP BY j.priority, i.state", ImageState.OPEN):
                tier = tiers[prio]
                if state == ImageState.QUEUED:
                    tier["queued"], tier["oldest_s"] = images, round(max(now - oldest, 0.0), 3)
                else:
                    tier["rendering"] = images
            for prio, jobs in db.execute("SELECT j.priority, COUNT(DISTINCT j.id) FROM images i JOIN jobs j ON "
                                         "j.id = i.job WHERE i.state IN (?, ?) GROUP BY j.priority", ImageState.OPEN):
                tiers[prio]["jobs"] = jobs
            leases = db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
            rate = self._drain_rate(db, now)
            last = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
        return {"tiers": tiers, "leases": leases, "images_per_s": round(rate or 0.0, 4), "last_event": last}


def _worker_state(w, draining: bool, rendering: bool, seen: bool) -> str:
    if w["quarantined"] is not None:
        return WorkerState.QUARANTINED
    if draining:
        return WorkerState.DRAINING if rendering else WorkerState.DRAINED
    if rendering:
        return WorkerState.RENDERING
    if not seen:
        return WorkerState.LOST
    return WorkerState.IDLE if w["ready"] else WorkerState.COLD
