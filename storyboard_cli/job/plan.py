"""Job -> WorkItems -> Batches. Pure Python, no torch: tested in milliseconds."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from storyboard_cli.folder.layout import output_name
from storyboard_cli.job.digests import SHORT, file_sha256, weights_digest
from storyboard_cli.job.file import Job, LoraFile, Shot
from storyboard_cli.job.lora_files import lora_set_label
from storyboard_cli.job.preflight import check_destination, check_model_path, free_bytes
from storyboard_cli.job.prompts import long_prompts
from storyboard_cli.steps import (NO_DEEPCACHE, DeepCache, StepPlan, control_steps, guided_steps, levers_label,
                                  step_costs, step_plan)

LoraScales = tuple[tuple[str, float], ...]  # ((name, scale), ...) sorted by name: one LoRA set


@dataclass(frozen=True, order=True)
class BucketKey:
    """Everything that changes the shape or the schedule of a denoising loop, and the LoRA set (a batch
    runs under one set of weights)."""

    width: int
    height: int
    steps: int
    sampler: str
    control: bool
    loras: LoraScales = ()
    guided: bool = True  # False: every image's guidance <= 1, the conditional rows alone at every step
    cfg_cutoff: float = 1.0
    deepcache: DeepCache = NO_DEEPCACHE  # with control: after the ControlNet's end
    control_end: float = 1.0  # the fraction of the steps the ControlNet runs (a batch with control)

    @property
    def guided_steps(self) -> int:
        return guided_steps(self.steps, self.cfg_cutoff) if self.guided else 0

    @property
    def control_steps(self) -> int | None:
        """The steps the ControlNet runs (the first ones); None without one."""
        return control_steps(self.steps, self.control_end) if self.control else None

    @property
    def plan(self) -> StepPlan:
        """Each step's kind (steps.step_plan): one plan per batch."""
        return step_plan(self.steps, self.guided_steps, self.deepcache.interval, self.deepcache.branch,
                         self.control_steps)

    @property
    def levers(self) -> str:
        """What the batches do differently from a full render ("" when nothing): the label's tail."""
        return levers_label(self.steps, self.guided, self.cfg_cutoff, self.control, self.control_end, self.deepcache)

    @property
    def label(self) -> str:
        lora = f" lora {lora_set_label(self.loras)}" if self.loras else ""
        levers = f" [{self.levers}]" if self.levers else ""
        return (f"{self.width}x{self.height} {self.steps} steps {self.sampler}{' +control' if self.control else ''}"
                f"{lora}{levers}")

    @property
    def flops_saved(self) -> float:
        """The fraction of the UNet's FLOPs a batch of this key saves against the same batch with every step
        guided and whole, the ControlNet included (step_costs): the estimate `bcg plan` shows per bucket."""
        return 1 - step_costs(self.plan, self.control) / self.steps


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
    control_file: str = ""  # the control image as seen from the job file's folder
    loras: tuple[tuple[LoraFile, float], ...] = ()  # sorted by name, no zero scales
    cfg_cutoff: float = 1.0  # 1.0 where it does not apply (guidance <= 1: no guided step to cut)
    deepcache: DeepCache = NO_DEEPCACHE  # off where it does not apply (a ControlNet that runs to the end)
    draft: bool = False
    control_end: float = 1.0  # 1.0 where it does not apply (no ControlNet, or one that runs every step)

    @property
    def lora_scales(self) -> LoraScales:
        return tuple((f.name, scale) for f, scale in self.loras)

    @property
    def key(self) -> BucketKey:
        return BucketKey(self.width, self.height, self.steps, self.sampler, self.control_image is not None,
                         self.lora_scales, self.guidance > 1, self.cfg_cutoff, self.deepcache, self.control_end)

    @property
    def identity(self) -> tuple:
        return (self.prompt, self.negative, self.width, self.height, self.seed, self.steps, self.guidance,
                self.sampler, str(self.control_image), self.control_scale,
                tuple((f.sha256, scale) for f, scale in self.loras), self.cfg_cutoff, self.deepcache, self.draft,
                self.control_end)

    def settings(self, model: str, controlnet: str | None) -> dict:
        """What decides the pixels: written into each PNG and the manifest, and used to tell a stale file
        from a done one. Files are recorded by content (a control image's sha256, a LoRA's hash, weights
        given as a path by size + mtime + header); keys appear only where they apply, so an image without
        them keeps its fingerprint."""
        s = {"prompt": self.prompt, "negative": self.negative, "width": self.width, "height": self.height,
             "seed": self.seed, "steps": self.steps, "guidance": self.guidance, "sampler": self.sampler,
             "model": model}
        _put_weights(s, "model_weights", model)
        if self.control_image is not None:
            s.update(controlnet=controlnet, control_image=self.control_file or str(self.control_image),
                     control_scale=self.control_scale, control_sha256=_content(self.control_image))
            _put_weights(s, "controlnet_weights", controlnet)
            if self.control_end < 1:
                s["control_end"] = self.control_end
        if self.loras:
            s["loras"] = [{"name": f.name, "scale": scale, "file": f.file, "sha256": f.sha256,
                           "shorthash": f.shorthash} for f, scale in self.loras]
        if self.cfg_cutoff < 1:
            s["cfg_cutoff"] = self.cfg_cutoff
        if self.deepcache:
            s["deepcache"] = self.deepcache.to_json()
        if self.draft:
            s["draft"] = True
        return s

    def fingerprint(self, model: str, controlnet: str | None) -> str:
        s = self.settings(model, controlnet)
        # where the files live does not decide the pixels: a moved project folder keeps its images
        s.pop("control_image", None)
        for lora in s.get("loras", ()):
            lora.pop("file")
        blob = json.dumps(s, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _content(path: Path) -> str:
    try:
        return file_sha256(path)[:SHORT]
    except OSError as e:  # gone since the job was loaded: the render fails this image and names the file
        return f"unreadable: {e.strerror or e.__class__.__name__}"


def _put_weights(settings: dict, key: str, spec: str | None) -> None:
    digest = weights_digest(spec)
    if digest is not None:
        settings[key] = digest


@dataclass(frozen=True)
class Batch:
    key: BucketKey
    items: tuple[WorkItem, ...]
    size: int  # the bucket: >= len(items); the rest are padding rows (copies of a real row)

    @property
    def padding(self) -> int:
        return self.size - len(self.items)


def work_items(job: Job) -> list[WorkItem]:
    """One item per image; image k of a shot has seed + k. Identical requests are merged."""
    items: dict[tuple, WorkItem] = {}
    for shot in job.shots:
        loras = tuple((job.loras[name], scale) for name, scale in shot.loras)
        for k in range(shot.first_candidate, shot.first_candidate + shot.candidates):
            seed = shot.seed + k
            control = shot.control
            item = WorkItem(shot.id, k, seed, shot.prompt, shot.negative, shot.width, shot.height, shot.steps,
                            shot.guidance, shot.sampler, control.image if control else None,
                            control.scale if control else 0.0, (output_name(shot.id, k, seed),),
                            control.file if control else "", loras, *levers(shot))
            twin = items.get(item.identity)
            if twin is None:
                items[item.identity] = item
            else:
                items[item.identity] = replace(twin, outputs=twin.outputs + item.outputs)
    return list(items.values())


def levers(shot: Shot) -> tuple[float, DeepCache, bool, float]:
    """(cfg_cutoff, deepcache, draft, control_end) as they apply to the shot's images: no cut-off where there is no
    guidance to cut (guidance <= 1, or a cut-off that keeps every step), a ControlNet's end only where it stops
    before the last step, and DeepCache with a ControlNet only when it stops (DeepCache runs after it: its
    residuals feed the blocks a shallow step skips)."""
    cut_off = shot.guidance > 1 and guided_steps(shot.steps, shot.cfg_cutoff) < shot.steps
    ends = shot.control is not None and control_steps(shot.steps, shot.control.end) < shot.steps
    deepcache = NO_DEEPCACHE if shot.control and not ends else shot.deepcache
    return (shot.cfg_cutoff if cut_off else 1.0), deepcache, shot.draft, (shot.control.end if ends else 1.0)


def shot_levers_label(shot: Shot) -> str:
    """The draft levers a shot's images use, as `bcg plan` names them (`levers_label`; "" for a full render)."""
    cutoff, deepcache, _, end = levers(shot)
    return levers_label(shot.steps, shot.guidance > 1, cutoff, shot.control is not None, end, deepcache)


def deepcache_dropped(job: Job) -> list[str]:
    """The shots that ask for DeepCache but have a ControlNet that runs to the last step: they get the cut-off
    only."""
    return [s.id for s in job.shots if s.deepcache and not levers(s)[1]]


def deepcache_note(job: Job) -> str | None:
    """What `bcg plan` and the report say, once, about ControlNet shots that asked for DeepCache."""
    shots = deepcache_dropped(job)
    if not shots:
        return None
    listed = ", ".join(shots[:5]) + (f" and {len(shots) - 5} more" if len(shots) > 5 else "")
    return (f"DeepCache is off for the ControlNet shots ({listed}): ControlNet's residuals feed the blocks its "
            f"shallow steps skip; they get the guidance cut-off only (DeepCache runs after a `control.end`)")


def shot_levers(job: Job) -> list[dict]:
    """What each shot's images use, for the report: the guided steps of all steps, the cut-off and DeepCache as
    they apply (see `levers`), and whether the shot is a draft."""
    rows = []
    for s in job.shots:
        cutoff, deepcache, _, end = levers(s)
        rows.append({"shot": s.id, "draft": s.draft, "steps": s.steps,
                     "guided_steps": guided_steps(s.steps, cutoff) if s.guidance > 1 else 0,
                     "cfg_cutoff": cutoff, "deepcache": deepcache.to_json(),
                     "deepcache_dropped": bool(s.deepcache and not deepcache),
                     "control_steps": control_steps(s.steps, end) if s.control else None})
    return rows


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
    """Groups items by bucket key and cuts each group into batches. Groups follow their first appearance,
    gathered by LoRA set (no LoRA first, then each set in one run): the fewest swaps a job can have, one
    per distinct set (see `lora_swaps`)."""
    groups: dict[BucketKey, list[WorkItem]] = {}
    for item in items:
        groups.setdefault(item.key, []).append(item)
    sets: dict[LoraScales, int] = {(): 0}
    for key in groups:
        sets.setdefault(key.loras, len(sets))
    batches = []
    for key, group in sorted(groups.items(), key=lambda kv: sets[kv[0].loras]):  # stable: appearance order within a set
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
    rows: int  # UNet rows: bucket sizes x 2 for classifier-free guidance (x 1 where no image is guided)
    padded_rows: int

    @property
    def waste(self) -> float:
        return self.padded_rows / self.rows if self.rows else 0.0

    @property
    def row_steps(self) -> int:
        return self.rows * self.key.steps

    def to_json(self) -> dict:
        """The row in `bcg plan --json`."""
        k = self.key
        return {"bucket": k.label, "width": k.width, "height": k.height, "steps": k.steps, "sampler": k.sampler,
                "control": k.control, "images": self.images, "unique": self.unique, "batches": list(self.batches),
                "rows": self.rows, "padded_rows": self.padded_rows, "waste": round(self.waste, 4),
                "row_steps": self.row_steps, "levers": k.levers, "guided_steps": k.guided_steps,
                "cfg_cutoff": k.cfg_cutoff, "control_steps": k.control_steps, "deepcache": k.deepcache.to_json(),
                "flops_saved_estimate": round(k.flops_saved, 4)}


def bucket_table(batches: list[Batch]) -> list[BucketRow]:
    rows: dict[BucketKey, BucketRow] = {}
    for b in batches:
        cfg = 2 if b.key.guided else 1
        prev = rows.get(b.key) or BucketRow(b.key, 0, 0, (), 0, 0)
        rows[b.key] = BucketRow(b.key, prev.images + sum(len(i.outputs) for i in b.items),
                                prev.unique + len(b.items), prev.batches + (b.size,),
                                prev.rows + cfg * b.size, prev.padded_rows + cfg * b.padding)
    return list(rows.values())


def lora_swaps(batches: list[Batch]) -> int:
    """How many times the weights change running these batches in order, starting from the model's own."""
    swaps, active = 0, ()
    for b in batches:
        if b.key.loras != active:
            swaps, active = swaps + 1, b.key.loras
    return swaps


@dataclass(frozen=True)
class LoraSetRow:
    loras: LoraScales
    images: int  # files written under this set
    batches: int

    @property
    def label(self) -> str:
        return lora_set_label(self.loras)

    def to_json(self) -> dict:
        return {"set": self.label, "images": self.images, "batches": self.batches}


def lora_table(batches: list[Batch]) -> list[LoraSetRow]:
    """One row per LoRA set, in the order the batches run them (what `bcg plan` shows, with `lora_swaps`)."""
    rows: dict[LoraScales, LoraSetRow] = {}
    for b in batches:
        prev = rows.get(b.key.loras) or LoraSetRow(b.key.loras, 0, 0)
        rows[b.key.loras] = LoraSetRow(b.key.loras, prev.images + sum(len(i.outputs) for i in b.items),
                                       prev.batches + 1)
    return list(rows.values())


PNG_BYTES_PER_PIXEL = 1.5  # what a rendered frame takes as bcg writes it (PNG, compress level 4), roughly


def disk_estimate(job: Job) -> int:
    """The bytes the job's images take on disk, roughly (every candidate, each its own file)."""
    return int(sum(s.candidates * s.width * s.height for s in job.shots) * PNG_BYTES_PER_PIXEL)


def decimal_size(nbytes: float) -> str:
    """1.5 MB, 2.0 TB: decimal units, as disks are sold and `df -H` shows them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


@dataclass(frozen=True)
class PlanSummary:
    """What `bcg plan` shows of a job, found without loading a model (`summary`)."""

    job: Job
    unique_images: int  # images denoised: identical requests once
    buckets: tuple[BucketRow, ...]
    lora_sets: tuple[LoraSetRow, ...]  # in render order
    lora_swaps: int
    warnings: tuple[str, ...]  # the prompts CLIP cuts, then the disk where the images will not fit
    note: str | None  # about ControlNet shots that asked for DeepCache (deepcache_note)
    disk_bytes: int  # the images' size on disk, roughly

    @property
    def images(self) -> int:
        """Files written: every candidate of every shot."""
        return sum(s.candidates for s in self.job.shots)

    @property
    def levered(self) -> bool:
        """Whether a bucket runs a draft lever (or no guidance): the table shows the levers and the saving."""
        return any(r.key.levers for r in self.buckets)

    @property
    def flops_saved(self) -> float:
        """The job's FLOPs the levers save, its buckets weighed by their rows x steps."""
        row_steps = sum(r.row_steps for r in self.buckets)
        return sum(r.key.flops_saved * r.row_steps for r in self.buckets) / max(1, row_steps)

    def to_json(self) -> dict:
        """`bcg plan --json`."""
        j = self.job
        return {"job": str(j.path), "name": j.name, "model": j.model, "controlnet": j.controlnet,
                "output_dir": str(j.output_dir), "shots": len(j.shots), "images": self.images,
                "unique_images": self.unique_images, "disk_bytes_estimate": self.disk_bytes,
                "buckets": [r.to_json() for r in self.buckets], "notes": [self.note] if self.note else [],
                "loras": {n: {"file": str(f.path), "sha256": f.sha256, "shorthash": f.shorthash}
                          for n, f in j.loras.items()},
                "lora_sets": [r.to_json() for r in self.lora_sets], "lora_swaps": self.lora_swaps,
                "prompt_warnings": list(self.warnings)}


def summary(job: Job) -> PlanSummary:
    """`bcg plan`: the model paths and the output folder checked (BadInput, ModelError), the job's images planned
    into batches, what CLIP will cut from the prompts, and whether the images fit on the disk."""
    check_model_path(job.model, "model")
    check_model_path(job.controlnet, "controlnet")
    check_destination(job.output_dir)
    items = work_items(job)
    batches = make_batches(items, job.buckets)
    warnings = [str(w) for w in long_prompts(job)]
    disk, free = disk_estimate(job), free_bytes(job.output_dir)
    if free is not None and disk > free:
        warnings.append(f"the images need about {decimal_size(disk)} on disk, {job.output_dir} has "
                        f"{decimal_size(free)} free")
    return PlanSummary(job, len(items), tuple(bucket_table(batches)), tuple(lora_table(batches)), lora_swaps(batches),
                       tuple(warnings), deepcache_note(job), disk)
