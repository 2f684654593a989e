"""What the studio holds back, kept in the queue file so that it survives a restart of the server: dispatch paused
(no worker is leased a batch; running batches finish) and workers drained (a drained worker is leased nothing more;
its current batch finishes). A drain holds the worker's name, the machine the studio sees, not its registration: a
worker process that starts again (the server's own, restarted with it) registers anew under its name and stays
drained until it is resumed. Each change is an event of the queue's one global stream (`events_after`), beside the
jobs' own: the events table's sequence numbers are the stream's ids, monotonic across jobs and restarts.
`QueueControl`: the part of `store.Store` that writes and reads them. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from storyboard_cli.serve.queue_file import QueueFile

PAUSED = "paused"  # the controls row of a paused queue (its value: when, as JSON)
DRAINED = "drained:"  # + a worker's name: the controls row of a drained worker (its value: when)
QUEUE = ""  # the `job` of an event of the queue or its workers, not of one job (a job id is never empty)
# the global stream's own events, beside the jobs' (queued, running, images, ...)
QUEUE_PAUSED, QUEUE_RESUMED, WORKER_DRAINED, WORKER_RESUMED = ("queue_paused", "queue_resumed", "worker_drained",
                                                                "worker_resumed")
MAX_EVENTS = 1000  # events read at once: a stream resumed far behind catches up in pages


@dataclass(frozen=True)
class Dispatch:
    """Whether the queue leases batches: `paused` since when (None: it does), and the drained workers' names."""

    paused: float | None
    drained: frozenset[str]


class QueueControl(QueueFile):
    """Pause and resume dispatch, drain and resume a worker, and the global event stream."""

    def _note(self, db, kind: str, now: float, **data) -> None:
        """One event of the queue (not of a job) on the global stream, written in the transaction that made it."""
        db.execute("INSERT INTO events (job, kind, data) VALUES (?, ?, ?)",
                   (QUEUE, kind, json.dumps({"at": now, **data})))

    def pause(self, now: float) -> bool:
        """No batch is leased from now on (running ones finish); False when it was already paused."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM controls WHERE name = ?", (PAUSED,)).fetchone():
                return False
            db.execute("INSERT INTO controls VALUES (?, ?)", (PAUSED, json.dumps(now)))
            self._note(db, QUEUE_PAUSED, now)
            return True

    def resume(self, now: float) -> bool:
        """Batches are leased again; False when it was not paused."""
        with self._tx() as db:
            if not db.execute("DELETE FROM controls WHERE name = ?", (PAUSED,)).rowcount:
                return False
            self._note(db, QUEUE_RESUMED, now)
            return True

    def drain(self, worker: str, now: float, draining: bool = True) -> bool | None:
        """The worker (every registration of its name) is leased nothing more after its current batch (`draining`
        False: it is again); None for a worker not registered, False when it already was (or was not)."""
        with self._tx() as db:
            row = db.execute("SELECT name FROM workers WHERE id = ?", (worker,)).fetchone()
            if row is None:
                return None
            if draining:
                changed = db.execute("INSERT OR IGNORE INTO controls VALUES (?, ?)",
                                     (DRAINED + row["name"], json.dumps(now))).rowcount
            else:
                changed = db.execute("DELETE FROM controls WHERE name = ?", (DRAINED + row["name"],)).rowcount
            if changed:
                self._note(db, WORKER_DRAINED if draining else WORKER_RESUMED, now, worker=worker, name=row["name"])
            return bool(changed)

    def dispatch(self) -> Dispatch:
        with self.lock:
            return self._dispatch(self.db)

    def _dispatch(self, db) -> Dispatch:
        rows = dict(db.execute("SELECT name, value FROM controls WHERE name = ? OR name LIKE ?",
                               (PAUSED, DRAINED + "%")))
        paused = rows.pop(PAUSED, None)
        return Dispatch(None if paused is None else json.loads(paused), frozenset(n[len(DRAINED):] for n in rows))

    def _held_back(self, db, worker: str) -> bool:
        """Whether `worker` may be leased nothing now: the queue is paused, or the worker drained."""
        return db.execute("SELECT 1 FROM controls WHERE name = ? OR name = ? || (SELECT name FROM workers WHERE "
                          "id = ?)", (PAUSED, DRAINED, worker)).fetchone() is not None

    def _warm(self, db, worker: str, warm: frozenset[str]) -> None:
        """The mixes the worker says it has prepared (its warm graphs), as its last lease request named them."""
        db.execute("UPDATE workers SET warm = ? WHERE id = ?", (json.dumps(sorted(warm)), worker))

    def events_after(self, after: int, limit: int = MAX_EVENTS,
                     job: str | None = None) -> list[tuple[int, str, str, str]]:
        """The global stream after sequence number `after`, oldest first, at most `limit`: (seq, job or "" for the
        queue's own, kind, JSON data); `job`: that job's events alone."""
        only = "AND job = ? " if job is not None else ""
        with self.lock:
            rows = self.db.execute(f"SELECT seq, job, kind, data FROM events WHERE seq > ? {only}ORDER BY seq LIMIT ?",
                                   (after, *([job] if job is not None else []), limit)).fetchall()
        return [tuple(r) for r in rows]

    def last_event(self) -> int:
        """The global stream's last id (0 before any event): a page that read the queue opens the stream after it."""
        with self.lock:
            return self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
