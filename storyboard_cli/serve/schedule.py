"""Who renders next, and what a full queue answers. Pure: no SQLite, no torch, no clock (times come in).

Priority tiers with aging: an image ranks by its job's submission time plus its tier's delay, so a bulk
job submitted 30 minutes ago ranks with an urgent one submitted now, and nothing starves. A lease is one
batch of the best-ranked job: any number of workers lease batches of one job at once (the server is its
folder's one writer). Within the job, the batch with the most work goes first (longest processing time
first: the job's tail is short), except that a worker gets a batch it has warm (same models, shape, steps,
sampler, control, LoRA set: nothing to capture, no LoRA swap) before one it would have to prepare.
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
    FINAL = (SUCCEEDED, FAILED, CANCELED)


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
    cost: float = 1.0  # its denoising work (steps x pixels, more with a ControlNet): what orders a job's batches
    front: float | None = None  # the rank its job was moved to (None: its priority and submission time rank it)


def rank(priority: str, submitted: float, front: float | None = None) -> float:
    """An image's rank (lower first): its job's submission time plus its tier's delay, or the rank the job was
    moved to (`front`: ahead of every job open when it was moved)."""
    return submitted + TIERS[priority] if front is None else front


def pick(waiting: list[Waiting], busy_fingerprints: set[str], warm: frozenset[str] = frozenset()) -> list[Waiting]:
    """The next lease's images: none whose twin is being rendered (it is copied once that lands). The
    best-ranked job's batch: of its bucket keys, one whose mix is in `warm` (what the asking worker has
    prepared) before the others, then the one whose next batch has the most work; its images in plan order,
    up to the job's largest bucket. Room left goes to other jobs' images of the same mix (same models, shape
    and LoRA set), best ranked first, one image per fingerprint."""
    free = [w for w in waiting if w.fingerprint not in busy_fingerprints]
    if not free:
        return []
    head = min(free, key=_order)
    groups: dict[str, list[Waiting]] = {}
    for w in free:
        if w.job == head.job:
            groups.setdefault(w.key, []).append(w)
    same = max(groups.values(), key=lambda g: (g[0].mix in warm, _work(g, head.batch), -min(w.order for w in g)))
    picked = sorted(same, key=lambda w: w.order)[: head.batch]
    first = picked[0]
    if first.mix is not None and len(picked) < head.batch:
        fingerprints = {w.fingerprint for w in picked}
        for w in sorted((w for w in free if w.job != head.job and w.mix == first.mix), key=_order):
            if len(picked) == head.batch:
                break
            if w.fingerprint not in fingerprints:
                picked.append(w)
                fingerprints.add(w.fingerprint)
    return picked


def _order(w: Waiting) -> tuple:
    return rank(w.priority, w.submitted, w.front), w.job, w.order


def _work(group: list[Waiting], batch: int) -> float:
    """The denoising work of the next batch cut from a job's images of one bucket key."""
    return sum(sorted((w.cost for w in group), reverse=True)[:batch])


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
