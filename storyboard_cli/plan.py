"""Job -> WorkItems -> Batches. Pure Python, no torch: tested in milliseconds."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from storyboard_cli.job import Job


@dataclass(frozen=True, order=True)
class BucketKey:
    """Everything that changes the shape or the schedule of a denoising loop."""

    width: int
    height: int
    steps: int
    sampler: str
    control: bool

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height} {self.steps} steps {self.sampler}{' +control' if self.control else ''}"


@dataclass(frozen=True)
class WorkItem:
    """One image to render. Identical requests share one item with several outputs."""

    shot: str
    k: int
    seed: int
    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    guidance: float
    sampler: str
    control_image: Path | None
    control_scale: float
    outputs: tuple[str, ...]  # paths relative to the output folder; the first is the item's own

    @property
    def key(self) -> BucketKey:
        return BucketKey(self.width, self.height, self.steps, self.sampler, self.control_image is not None)

    @property
    def identity(self) -> tuple:
        return (self.prompt, self.negative, self.width, self.height, self.seed, self.steps, self.guidance,
                self.sampler, str(self.control_image), self.control_scale)

    def settings(self, model: str, controlnet: str | None) -> dict:
        """What decides the pixels: written into each PNG and used to tell a stale file from a done one."""
        s = {"prompt": self.prompt, "negative": self.negative, "width": self.width, "height": self.height,
             "seed": self.seed, "steps": self.steps, "guidance": self.guidance, "sampler": self.sampler,
             "model": model}
        if self.control_image is not None:
            s.update(controlnet=controlnet, control_image=str(self.control_image), control_scale=self.control_scale)
        return s

    def fingerprint(self, model: str, controlnet: str | None) -> str:
        blob = json.dumps(self.settings(model, controlnet), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Batch:
    key: BucketKey
    items: tuple[WorkItem, ...]
    size: int  # the bucket: >= len(items); the rest are padding rows (copies of a real row)

    @property
    def padding(self) -> int:
        return self.size - len(self.items)


def output_name(shot: str, k: int, seed: int) -> str:
    return f"{shot}/{shot}_c{k}_s{seed}.png"


def work_items(job: Job) -> list[WorkItem]:
    """One item per image; image k of a shot has seed + k. Identical requests are merged."""
    items: dict[tuple, WorkItem] = {}
    for shot in job.shots:
        for k in range(shot.candidates):
            seed = shot.seed + k
            control = shot.control
            item = WorkItem(shot.id, k, seed, shot.prompt, shot.negative, shot.width, shot.height, shot.steps,
                            shot.guidance, shot.sampler, control.image if control else None,
                            control.scale if control else 0.0, (output_name(shot.id, k, seed),))
            twin = items.get(item.identity)
            if twin is None:
                items[item.identity] = item
            else:
                items[item.identity] = replace(twin, outputs=twin.outputs + item.outputs)
    return list(items.values())


def cut(n: int, buckets: tuple[int, ...]) -> list[int]:
    """Bucket sizes for n images: largest bucket that fits, the last one padded if nothing fits.

    Largest-fit beats padding up: a graphed step costs nearly the same per image at 2, 4 or 8
    images (see ARCHITECTURE.md), so padded rows are pure waste.
    """
    sizes = []
    ordered = sorted(buckets)
    while n > 0:
        fit = [b for b in ordered if b <= n]
        b = fit[-1] if fit else ordered[0]
        sizes.append(b)
        n -= min(b, n)
    return sizes


def make_batches(items: list[WorkItem], buckets: tuple[int, ...]) -> list[Batch]:
    """Groups items by bucket key (in order of first appearance) and cuts each group into batches."""
    groups: dict[BucketKey, list[WorkItem]] = {}
    for item in items:
        groups.setdefault(item.key, []).append(item)
    batches = []
    for key, group in groups.items():
        start = 0
        for size in cut(len(group), buckets):
            chunk = tuple(group[start:start + size])
            batches.append(Batch(key, chunk, size))
            start += len(chunk)
    return batches


@dataclass(frozen=True)
class BucketRow:
    key: BucketKey
    images: int  # files written
    unique: int  # images actually denoised
    batches: tuple[int, ...]
    rows: int  # UNet rows: bucket sizes x 2 for classifier-free guidance
    padded_rows: int

    @property
    def waste(self) -> float:
        return self.padded_rows / self.rows if self.rows else 0.0

    @property
    def row_steps(self) -> int:
        return self.rows * self.key.steps


def bucket_table(batches: list[Batch]) -> list[BucketRow]:
    rows: dict[BucketKey, BucketRow] = {}
    for b in batches:
        prev = rows.get(b.key) or BucketRow(b.key, 0, 0, (), 0, 0)
        rows[b.key] = BucketRow(b.key, prev.images + sum(len(i.outputs) for i in b.items),
                                prev.unique + len(b.items), prev.batches + (b.size,),
                                prev.rows + 2 * b.size, prev.padded_rows + 2 * b.padding)
    return list(rows.values())
