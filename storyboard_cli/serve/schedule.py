"""Who renders next, and what a full queue answers. Pure: no SQLite, no torch, no clock (times come in).

Priority tiers with aging: an image ranks by its job's submission time plus its tier's delay, so a bulk
job submitted 30 minutes ago ranks with an urgent one submitted now, and nothing starves. A lease is one
batch: the best-ranked free image, then the images of its job with the same bucket key (shape, steps,
sampler, control, LoRA set) in plan order, up to the job's largest bucket.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

TIERS = {"urgent": 0.0, "normal": 300.0, "bulk": 1800.0}  # seconds of delay in the rank
DEFAULT_PRIORITY = "normal"
MAX_ATTEMPTS = 3  # leases an image may lose (its worker died) before it fails
UNKNOWN_DRAIN_S = 10  # Retry-After before any image was rendered
END = "end"  # the kind of a job's last progress event: it reached a final state


class ImageState:
    QUEUED, LEASED, DONE, FAILED, CANCELED = "queued", "leased", "done", "failed", "canceled"
    OPEN = (QUEUED, LEASED)


class JobState:
    QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELED = "queued", "running", "succeeded", "failed", "canceled"
    ALL = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELED)


@dataclass(frozen=True)
class Waiting:
    """A queued image, as the scheduler sees it."""

    image: int
    job: str
    priority: str
    submitted: float
    key: str  # the bucket key's label: one batch runs one key
    fingerprint: str
    order: int  # its place in the job's plan
    batch: int  # the job's largest bucket
    mix: str | None = None  # images of other jobs with the same mix may share its batch (None: none may)


def rank(priority: str, submitted: float) -> float:
    return submitted + TIERS[priority]


def pick(waiting: list[Waiting], busy_jobs: set[str], busy_fingerprints: set[str]) -> list[Waiting]:
    """The next lease's images: none of a job another lease holds (its folder has one writer), none whose
    twin is being rendered (it is copied once that lands). The best-ranked image's job fills the batch
    first; room left goes to other jobs' images of the same mix (same models, shape and LoRA set), best
    ranked first, one image per fingerprint."""
    free = [w for w in waiting if w.job not in busy_jobs and w.fingerprint not in busy_fingerprints]
    if not free:
        return []
    head = min(free, key=_order)
    same = sorted((w for w in free if w.job == head.job and w.key == head.key), key=lambda w: w.order)
    picked = same[: head.batch]
    if head.mix is not None and len(picked) < head.batch:
        fingerprints = {w.fingerprint for w in picked}
        for w in sorted((w for w in free if w.job != head.job and w.mix == head.mix), key=_order):
            if len(picked) == head.batch:
                break
            if w.fingerprint not in fingerprints:
                picked.append(w)
                fingerprints.add(w.fingerprint)
    return picked


def _order(w: Waiting) -> tuple:
    return rank(w.priority, w.submitted), w.job, w.order


def retry_after(excess_images: int, drain_per_s: float | None) -> int:
    """Seconds until `excess_images` have drained at the measured rate (at least 1, at most an hour)."""
    if not drain_per_s:
        return UNKNOWN_DRAIN_S
    return max(1, min(3600, math.ceil(excess_images / drain_per_s)))


def job_state(states: Counter, canceled: bool) -> str:
    """A job's state from its images' states."""
    if canceled:
        return JobState.CANCELED
    if not any(states[s] for s in ImageState.OPEN):
        return JobState.FAILED if states[ImageState.FAILED] else JobState.SUCCEEDED
    if states[ImageState.QUEUED] == sum(states.values()):
        return JobState.QUEUED
    return JobState.RUNNING
