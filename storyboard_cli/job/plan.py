"""Job -> WorkItems -> Batches. Pure Python, no torch: tested in milliseconds. The items and their bucket keys are
job/items.py's (`WorkItem`, `BucketKey`, imported from here too)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from storyboard_cli.errors import JobError
from storyboard_cli.folder.layout import base_name, output_name, refine_name
from storyboard_cli.job.conditions import KINDS, merged, parts
from storyboard_cli.job.file import Job, Shot
from storyboard_cli.job.hires import hires_size
from storyboard_cli.job.kind import ShotSource
from storyboard_cli.job.values import Context
from storyboard_cli.job.yaml_loader import Located
from storyboard_cli.job.items import BucketKey, LoraScales, WorkItem
from storyboard_cli.job.lora_files import lora_set_label
from storyboard_cli.job.preflight import check_destination, free_bytes, job_spec, model_problem
from storyboard_cli.job.prompts import long_prompts
from storyboard_cli.steps import NO_DEEPCACHE, DeepCache, control_steps, guided_steps, levers_label


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
        cutoff, deepcache, draft, _ = levers(shot)
        conditioned = merged(kind.item(shot, job) for kind in KINDS)
        for k in range(shot.first_candidate, shot.first_candidate + shot.candidates):
            seed = shot.seed + k
            out = refine_name(shot.refine.source, shot.refine.tag, k, seed) if shot.refine else \
                output_name(shot.id, k, seed)
            item = WorkItem(shot=shot.id, k=k, seed=seed, prompt=shot.prompt, negative=shot.negative,
                            width=shot.width, height=shot.height, steps=shot.steps, guidance=shot.guidance,
                            sampler=shot.sampler, outputs=(out,), loras=loras, cfg_cutoff=cutoff,
                            deepcache=deepcache, draft=draft, hires=shot.hires, refine=shot.refine,
                            folder=job.folder, **conditioned)
            twin = items.get(item.identity)
            if twin is None:
                items[item.identity] = item
            else:
                items[item.identity] = replace(twin, outputs=twin.outputs + item.outputs)
    return list(items.values())


# ---------------------------------------------------------------- images that start from another (hires, refine)

UPSCALE_MODES = {"lanczos": "stretch", "latent": "latent"}  # a hires upscaler -> how its source takes the new size


def started_from(ctx: Context, job: Job, shot: Shot, image: Path, strength: float, line: int | None,
                 area: Located | None = None, resize: str | None = None) -> dict:
    """The shot fields of a picture that starts from `image` (an absolute path) and repaints `area` (a mapping as a
    shot's would be, its image read from `ctx`'s folder): the fields of the kind a picture starts from
    (`Kind.start_keys`), read by its row as a shot's keys would be, at the shot's size (errors at `ctx`'s file and
    `line`)."""
    rows = [kind for kind in KINDS if kind.start_keys]
    if not rows:
        raise JobError(ctx.file, line, shot.id, None, "this build has no kind that starts from an image")
    fields: dict = {}
    for kind in rows:
        source, repaint = kind.start_keys
        start = Located(image=str(image), strength=strength, **({"resize": resize} if resize else {}))
        start.line, start.lines = line, {k: line for k in start}
        given = {source: start, repaint: area}

        def get(key: str, given=given) -> tuple[object, int | None]:
            value = given.get(key)
            return value, value.line if isinstance(value, Located) else line

        part, _ = kind.resolve_shot(ctx, ShotSource(get=get, shot_id=shot.id, size=(shot.width, shot.height),
                                                    job_dir=ctx.folder, job=job, lora_scales={}, lora_raw=None,
                                                    lora_line=None, prompt_line=line))
        fields.update(part)
    return fields


def base_item(item: WorkItem) -> WorkItem:
    """A hires image's first pass: the picture at the shot's size, kept beside the candidate (`base_name`)."""
    return replace(item, hires=None, outputs=(base_name(item.outputs[0]),))


def first_pass(items: list[WorkItem]) -> list[WorkItem]:
    """What a render's first phase denoises: every item but the hires passes (they start from their bases)."""
    return [i for i in items if i.hires is None]


def planned_passes(job: Job, items: list[WorkItem]) -> list[WorkItem]:
    """The hires passes of `items` as planned before their bases exist: each at its new size over the steps it runs
    (its schedule's tail, counted from 0: what it costs and the shapes it runs; the kinds' parts as `second_pass` makes
    them, without the picture it starts from). The engine sizes its buffers and wants kernels for them ahead of the
    first batch; an estimate prices them. `second_pass` makes the one that runs."""
    shots = {s.id: s for s in job.shots}
    unstarted = {key: None for kind in KINDS for key in kind.start_keys}

    def planned(item: WorkItem) -> WorkItem:
        width, height = hires_size(item.width, item.height, item.hires.scale)
        again = replace(shots[item.shot], width=width, height=height, steps=item.hires.steps_run(item.steps),
                        **unstarted)
        return replace(item, width=width, height=height, steps=again.steps, hires=None,
                       **merged(kind.item(again, job) for kind in KINDS))

    return [planned(i) for i in items if i.hires is not None]


def phases(job: Job, items: list[WorkItem]) -> tuple[list[WorkItem], list[WorkItem]]:
    """What a render of `items` runs, as an estimate prices it: the first phase, one item per item in its order (a
    hires image's base at the shot's size), and the hires passes as planned, one per hires image in its order."""
    return [base_item(i) if i.hires is not None else i for i in items], planned_passes(job, items)


def render_batches(job: Job, items: list[WorkItem]) -> list[Batch]:
    """The batches of both phases (`phases`)."""
    firsts, passes = phases(job, items)
    return make_batches(firsts, job.buckets) + make_batches(passes, job.buckets)


def second_pass(job: Job, item: WorkItem, out_dir: Path) -> WorkItem:
    """A hires image's second pass: its base (on disk) upscaled and denoised again at the new size over the tail
    of the pass's schedule; it writes the planned item's name and settings (`WorkItem.final`). Raises JobError
    where the base cannot be read."""
    hires = item.hires
    width, height = hires_size(item.width, item.height, hires.scale)
    shot = next(s for s in job.shots if s.id == item.shot)
    base = (out_dir / base_name(item.outputs[0])).resolve()
    part = started_from(Context(str(job.path)), job, replace(shot, width=width, height=height), base,
                        hires.strength, shot.line, resize=UPSCALE_MODES[hires.upscaler])
    steps = hires.schedule(item.steps)
    again = replace(shot, width=width, height=height, steps=steps, **part)
    return replace(item, width=width, height=height, steps=steps, hires=None, final=item,
                   **merged(kind.item(again, job) for kind in KINDS))


def sides(shot: Shot) -> tuple[int, float]:
    """(the side networks the shot's images run at each step, where the last ends as it applies): the kinds'."""
    found = [kind.shot_side(shot) for kind in KINDS]
    return sum(n for n, _ in found), max((end for n, end in found if n), default=1.0)


def levers(shot: Shot) -> tuple[float, DeepCache, bool, float]:
    """(cfg_cutoff, deepcache, draft, control_end) as they apply to the shot's images: no cut-off where there is no
    guidance to cut (guidance <= 1, or a cut-off that keeps every step), the side networks' end (a ControlNet's, the
    last one's) only where they stop before the last step, and DeepCache with side networks only when they all stop
    (DeepCache runs after them: their residuals feed the blocks a shallow step skips)."""
    cut_off = shot.guidance > 1 and guided_steps(shot.steps, shot.cfg_cutoff) < shot.steps
    n, end = sides(shot)
    deepcache = NO_DEEPCACHE if n and end == 1.0 else shot.deepcache
    return (shot.cfg_cutoff if cut_off else 1.0), deepcache, shot.draft, end


def shot_levers_label(shot: Shot) -> str:
    """The draft levers a shot's images use, as `bcg plan` names them (`levers_label`; "" for a full render)."""
    cutoff, deepcache, _, end = levers(shot)
    return levers_label(shot.steps, shot.guidance > 1, cutoff, sides(shot)[0] > 0, end, deepcache)


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
                     "control_steps": control_steps(s.steps, end) if sides(s)[0] else None,
                     **({"hires": s.hires.settings(s.width, s.height, s.steps)
                         | {"size": f"{s.width}x{s.height}", "steps_run": s.hires.steps_run(s.steps)}}
                       if s.hires else {})})
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
        return self.rows * self.key.runs

    def to_json(self) -> dict:
        """The row in `bcg plan --json`."""
        k = self.key
        return {"bucket": k.label, "width": k.width, "height": k.height, "steps": k.steps,
                **({"runs": k.runs} if k.first else {}), "sampler": k.sampler, "control": k.control, "images": self.images, "unique": self.unique, "batches": list(self.batches),
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


def hires_rows(job: Job) -> list[dict]:
    """Each shot's hires pass as `bcg plan` shows it: the sizes and the steps that run of its schedule."""
    rows = []
    for s in job.shots:
        if s.hires is None:
            continue
        w, h = hires_size(s.width, s.height, s.hires.scale)
        rows.append({"shot": s.id, "size": f"{s.width}x{s.height}", "hires_size": f"{w}x{h}",
                     "scale": s.hires.scale, "strength": s.hires.strength, "steps": s.hires.schedule(s.steps),
                     "steps_run": s.hires.steps_run(s.steps), "upscaler": s.hires.upscaler,
                     "images": s.candidates})
    return rows


@dataclass(frozen=True)
class PlanSummary(*parts("SummaryPart")):
    """What `bcg plan` shows of a job, found without loading a model (`summary`); what it says of each conditioning
    kind are the kind's fields (`Kind.summary`)."""

    job: Job
    unique_images: int  # images denoised: identical requests once
    buckets: tuple[BucketRow, ...]
    lora_sets: tuple[LoraSetRow, ...]  # in render order
    lora_swaps: int
    warnings: tuple[str, ...]  # the prompts CLIP cuts, then the disk where the images will not fit
    note: str | None  # about ControlNet shots that asked for DeepCache (deepcache_note)
    disk_bytes: int  # the images' size on disk, roughly
    hires: tuple[dict, ...] = ()  # each hires shot's pass (hires_rows)

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

    @property
    def kind_notes(self) -> list[str]:
        """What each conditioning kind says of the job, once (`Kind.notes`)."""
        return [n for kind in KINDS for n in kind.notes(self)]

    def to_json(self) -> dict:
        """`bcg plan --json`: each kind's keys beside the model and at the end (`Kind.plan_json`), those of named
        nets and of references only where the job has them."""
        j = self.job
        keys = [kind.plan_json(j, self) for kind in KINDS]
        out = {"job": str(j.path), "name": j.name, "model": j.model, **merged(head for head, _ in keys),
               "output_dir": str(j.output_dir), "shots": len(j.shots), "images": self.images,
               "unique_images": self.unique_images, "disk_bytes_estimate": self.disk_bytes,
               "buckets": [r.to_json() for r in self.buckets],
               "notes": [n for n in (self.note, *self.kind_notes) if n],
               "loras": {n: {"file": str(f.path), "sha256": f.sha256, "shorthash": f.shorthash}
                         for n, f in j.loras.items()},
               "lora_sets": [r.to_json() for r in self.lora_sets], "lora_swaps": self.lora_swaps,
               "prompt_warnings": list(self.warnings)}
        if j.warnings:
            out["warnings"] = list(j.warnings)
        if self.hires:  # only where a shot has a pass: a job without one keeps its plan byte for byte
            out["hires"] = list(self.hires)
        for _, tail in keys:
            out.update(tail)
        return out


def model_fields(job: Job) -> list[tuple[str, str | None]]:
    """(field, spec as written) of every model the job names: `model`, then each kind's (`Kind.models`)."""
    return [("model", job.model), *(field for kind in KINDS for field in kind.models(job))]


def check_models(job: Job) -> None:
    """Every model the job names is a preset of its field, a path that exists (from the job file's folder) or a hub
    id: else a JobError at the field's line."""
    for field, spec in model_fields(job):
        problem = model_problem(job_spec(spec, job.folder), field)
        if problem:
            raise JobError(str(job.path), job.lines.get(field), None, field, problem)


def summary(job: Job) -> PlanSummary:
    """`bcg plan`: the model paths and the output folder checked (BadInput, ModelError), the job's images planned
    into batches, what CLIP will cut from the prompts, and whether the images fit on the disk."""
    check_models(job)
    check_destination(job.output_dir)
    items = work_items(job)
    batches = make_batches(items, job.buckets)
    warnings = [str(w) for w in long_prompts(job)]
    disk, free = disk_estimate(job), free_bytes(job.output_dir)
    if free is not None and disk > free:
        warnings.append(f"the images need about {decimal_size(disk)} on disk, {job.output_dir} has "
                        f"{decimal_size(free)} free")
    return PlanSummary(job, len(items), tuple(bucket_table(batches)), tuple(lora_table(batches)), lora_swaps(batches),
                       tuple(warnings), deepcache_note(job), disk, tuple(hires_rows(job)),
                       **merged(kind.summary(job) for kind in KINDS))
