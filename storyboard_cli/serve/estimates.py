"""The queue's time estimates: each image carries its share of its batch's seconds on the server's cost table
(intake: `PlannedImage.est`, job/estimate.py); each worker is calibrated online against it from its leases' batch
timings (the median of its last leases' measured over predicted seconds: a worker's first lease, which loads its
model and captures its graphs, does not set it alone). From them: a job's `eta_s` (the work ranked ahead of it and its
own, over what the live workers drain per second), the images per second a full queue's `Retry-After` divides by,
and the stale leases (running past STALE x their worker's prediction: `bcg_stale_leases`, the BcgLeaseStale rule).
`Estimates`: the part of `store.Store` that does it, sharing its connection and lock. Torch-free."""

from __future__ import annotations

import statistics
from collections import deque

from storyboard_cli.serve.schedule import ImageState, rank

STALE = 1.5  # a lease running longer than this times its prediction is stale
KEPT = 9  # leases per worker the calibration keeps (their median)


class Calibration:
    """Per worker, measured / predicted seconds of its last KEPT leases."""

    def __init__(self) -> None:
        self.ratios: dict[str, deque[float]] = {}

    def observe(self, worker: str, measured_s: float, predicted_s: float) -> float | None:
        """The ratio kept (None for a lease that measured or predicted nothing)."""
        if measured_s > 0 and predicted_s > 0:
            self.keep(worker, measured_s / predicted_s)
            return measured_s / predicted_s
        return None

    def keep(self, worker: str, ratio: float) -> None:
        self.ratios.setdefault(worker, deque(maxlen=KEPT)).append(ratio)

    def factor(self, worker: str) -> float | None:
        """How much longer than the table this worker takes (None before its first lease landed)."""
        kept = self.ratios.get(worker)
        return statistics.median(kept) if kept else None

    def rate(self, workers: list[str]) -> float | None:
        """Predicted seconds the workers drain per second together (None when none is calibrated)."""
        factors = [f for w in workers if (f := self.factor(w))]
        return sum(1 / f for f in factors) if factors else None


class Estimates:
    """`eta_s`, the drain rate for `Retry-After`, the stale leases; `calibration` learns from each completion."""

    calibration: Calibration

    def _live_workers(self, db, now: float) -> list[str]:
        return [r[0] for r in db.execute("SELECT id FROM workers WHERE seen + ttl >= ? AND quarantined IS NULL",
                                         (now,))]

    def _calibrate(self, db, lease_id: str, worker: str | None, measured_s: float) -> None:
        """A completion's batch seconds against its lease's prediction (inside `complete`'s transaction), kept in the
        queue file too: a server started again knows its workers' factors before their next lease lands."""
        row = db.execute("SELECT worker, est FROM leases WHERE id = ?", (lease_id,)).fetchone()
        if row is None:
            return
        worker = worker or row["worker"]
        ratio = self.calibration.observe(worker, measured_s, row["est"])
        if ratio is not None:
            db.execute("INSERT INTO calibration (worker, ratio) VALUES (?, ?)", (worker, ratio))
            db.execute("DELETE FROM calibration WHERE worker = ? AND seq NOT IN (SELECT seq FROM calibration "
                       "WHERE worker = ? ORDER BY seq DESC LIMIT ?)", (worker, worker, KEPT))

    def _load_calibration(self) -> None:
        """The registered workers' kept ratios from the queue file (a server's start); a forgotten worker's dropped."""
        with self._tx() as db:
            db.execute("DELETE FROM calibration WHERE worker NOT IN (SELECT id FROM workers)")
            for row in db.execute("SELECT worker, ratio FROM calibration ORDER BY seq").fetchall():
                self.calibration.keep(row["worker"], row["ratio"])

    def _eta(self, db, job, now: float) -> float | None:
        """Seconds until the job's last image lands: the work ranked ahead of it and its own open images, over what
        the live calibrated workers drain; None before any is calibrated, or where an image it counts has no price (no
        table prices its model: a zero would read as "done now"); the caller falls back to images/s."""
        rate = self.calibration.rate(self._live_workers(db, now))
        if not rate:
            return None
        mine = rank(job["priority"], job["submitted"])
        ahead = [r[2] for r in db.execute(
            "SELECT j.priority, j.submitted, i.est FROM images i JOIN jobs j ON j.id = i.job WHERE i.state = ? "
            "AND i.job != ?", (ImageState.QUEUED, job["id"])) if rank(r[0], r[1]) < mine]
        left = [r[0] for r in db.execute("SELECT est FROM images WHERE job = ? AND state IN (?, ?)",
                                         (job["id"], *ImageState.OPEN))]
        if any(not est or est <= 0 for est in ahead + left):
            return None
        return (sum(ahead) + sum(left)) / rate

    def _drain_estimate(self, db, now: float) -> float | None:
        """Images per second the live workers drain, from their calibration and the open images' mean estimate
        (what `Retry-After` divides the excess by); the measured rate where none is calibrated."""
        rate = self.calibration.rate(self._live_workers(db, now))
        mean = db.execute("SELECT AVG(est) FROM images WHERE state IN (?, ?) AND est > 0",
                          ImageState.OPEN).fetchone()[0]
        return rate / mean if rate and mean else self._drain_rate(db, now)

    def stale_leases(self, now: float) -> int:
        """Leases running longer than STALE x their prediction on their (calibrated) worker."""
        with self.lock:
            rows = self.db.execute("SELECT worker, started, est FROM leases WHERE started IS NOT NULL AND est > 0"
                                   ).fetchall()
        return sum(1 for r in rows if (f := self.calibration.factor(r["worker"])) and
                   now - r["started"] > STALE * f * r["est"])
