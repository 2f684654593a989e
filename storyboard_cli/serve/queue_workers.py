"""The queue's registered workers: the server issues each worker its id on registration, and forgets it once
it has not been seen for its ttl (--lease-s) and holds no lease. Leases and heartbeats name that id, so the
worker table (and the metric series per worker) holds at most --max-workers live rows, whatever names clients
invent. A worker that gives back MAX_STRIKES leases in a row for an error of its own machine (its device unusable,
a CUDA error) is quarantined: it gets no more leases. `WorkerRegistry`: the part of `store.Store` that writes and
reads that table. Torch-free.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

from storyboard_cli.serve.queue_file import QueueFile

MAX_STRIKES = 3  # leases in a row given back for this worker's own machine: then it is quarantined


@dataclass(frozen=True)
class Seen:
    """A registered worker seen lately: its issued id, its name, its GPU figures (None on a CPU), ready, and why it
    is quarantined (None: it is not)."""

    id: str
    name: str
    gpu: dict | None
    ready: bool
    quarantined: str | None = None


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


class Quarantined(Exception):
    """A worker that gave back MAX_STRIKES leases in a row for an error of its own machine: it gets no more."""

    def __init__(self, worker: str, name: str, reason: str):
        super().__init__(f"worker {worker} ({name}) is quarantined: {MAX_STRIKES} leases in a row failed on its "
                         f"machine (last: {reason}); it gets no more leases: fix its device, then start it again")
        self.reason = reason


class WorkerRegistry(QueueFile):
    """Workers: ids issued on registration, forgotten with their last lease."""

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

    def _usable(self, db, worker: str) -> None:
        """Raises Quarantined for a quarantined worker."""
        row = db.execute("SELECT name, quarantined FROM workers WHERE id = ?", (worker,)).fetchone()
        if row is not None and row["quarantined"] is not None:
            raise Quarantined(worker, row["name"], row["quarantined"])

    def _strike(self, db, worker: str, reason: str) -> tuple[int, bool]:
        """One more lease in a row given back for the worker's own machine: (its strikes in a row, whether it is
        quarantined now)."""
        db.execute("UPDATE workers SET strikes = strikes + 1, quarantined = CASE WHEN strikes + 1 >= ? THEN ? "
                   "ELSE quarantined END WHERE id = ?", (MAX_STRIKES, reason, worker))
        row = db.execute("SELECT strikes, quarantined FROM workers WHERE id = ?", (worker,)).fetchone()
        return (0, False) if row is None else (row["strikes"], row["quarantined"] is not None)

    def _forget(self, db, now: float) -> None:
        """Registrations not seen within their ttl and holding no live lease: their ids and series are gone."""
        self._outage_over(db, now)
        db.execute("DELETE FROM workers WHERE seen + ttl < ? AND id NOT IN "
                   "(SELECT worker FROM leases WHERE expires >= ?)", (now, now))

    def readiness(self, now: float, window_s: float) -> tuple[int, int]:
        """(registered workers seen within the window, those of them ready and not quarantined): a worker that
        stops asking for work and heartbeating drops out of both."""
        with self.lock:
            row = self.db.execute("SELECT COUNT(*), COALESCE(SUM(ready AND quarantined IS NULL), 0) FROM workers "
                                  "WHERE seen >= ?",
                                  (now - window_s,)).fetchone()
        return row[0], row[1]
