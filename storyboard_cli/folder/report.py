"""Timing report: per stage, per bucket, per graph. JSON for tools, Markdown for people."""

from __future__ import annotations

import json
import signal
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# typing's TypedDict, before Python 3.12, is not one pydantic validates (serve/wire.py)
from typing_extensions import NotRequired, TypedDict

from storyboard_cli.errors import Status, StoryboardError
from storyboard_cli.folder.layout import REPORT_JSON, REPORT_MD, read_report
from storyboard_cli.folder.outputs import atomic_write
from storyboard_cli.job.file import Job, as_draft, load_job
from storyboard_cli.job.conditions import KINDS, shown

if TYPE_CHECKING:
    from storyboard_cli.models.lora import Swap

STAGES = ("load", "capture", "encode", "denoise", "decode", "save")
# report.json's keys for what a job's images are conditioned on beyond the prompt: each kind's (`Kind.report`)
CONDITIONS = tuple(key for kind in KINDS for key in kind.report_keys)
# report.json's keys left out where they are None (as the conditioning's are where a job has none): a served job's
# cached images, a merged report's figures, what the denoising hid
OPTIONAL = ("images_cached", "render_s", "render_images_per_s", "workers", "hidden_s")


class BucketRow(TypedDict):
    """A bucket's row in report.json (`BucketTiming.row`): what a merge reads back (`from_row`)."""

    bucket: str
    images: int
    batches: int
    rows: int
    steps: int
    denoise_s: float
    ms_per_step: float
    waited_s: NotRequired[float]  # the loops waited this long for their inputs (a report before it: absent, 0)


@dataclass
class BucketTiming:
    label: str
    images: int = 0
    batches: int = 0
    rows: int = 0  # UNet rows including CFG and padding
    steps: int = 0  # denoising steps run (per batch, summed)
    denoise_s: float = 0.0
    # of the encode stage: how long its batches' loops waited for their inputs (`Timings.exposed`'s share of it; the
    # first batch's inputs whole, nothing ran beside them)
    waited_s: float = 0.0

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.denoise_s / self.steps if self.steps else 0.0

    def add(self, other: BucketTiming) -> None:
        self.images, self.batches, self.rows = self.images + other.images, self.batches + other.batches, \
            self.rows + other.rows
        self.steps, self.denoise_s = self.steps + other.steps, self.denoise_s + other.denoise_s
        self.waited_s += other.waited_s

    def row(self) -> BucketRow:
        """The report's row for this bucket."""
        return {"bucket": self.label, "images": self.images, "batches": self.batches, "rows": self.rows,
                "steps": self.steps, "denoise_s": round(self.denoise_s, 4), "ms_per_step": round(self.ms_per_step, 2),
                "waited_s": round(self.waited_s, 4)}

    @classmethod
    def from_row(cls, row: BucketRow) -> BucketTiming:
        return cls(row["bucket"], row["images"], row["batches"], row["rows"], row["steps"], row["denoise_s"],
                   row.get("waited_s", 0.0))


@dataclass
class Timings:
    sync: object = None  # callable that waits for the device, so stage times are true
    stages: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    buckets: dict[str, BucketTiming] = field(default_factory=dict)
    # of a stage that runs beside the denoising (encode, decode, save), the seconds it did not hide: the UNet's stream
    # waited for it, or the render's end did
    exposed: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Seconds of a stage measured by its caller (on a stream's events, or on another thread)."""
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def expose(self, name: str, seconds: float) -> None:
        self.exposed[name] = self.exposed.get(name, 0.0) + seconds

    def hidden_s(self) -> dict[str, float] | None:
        """Per stage that ran beside the denoising: the seconds of it the denoising hid; None when none did."""
        if not self.exposed:
            return None
        return {k: round(max(0.0, self.stages.get(k, 0.0) - v), 4) for k, v in self.exposed.items()}

    def bucket(self, label: str) -> BucketTiming:
        return self.buckets.setdefault(label, BucketTiming(label))

    def merge(self, other: Timings) -> None:
        """Adds another run's stage seconds and buckets (a multi-GPU render's workers)."""
        for name, seconds in other.stages.items():
            self.stages[name] = self.stages.get(name, 0.0) + seconds
        for name, seconds in other.exposed.items():
            self.expose(name, seconds)
        for b in other.buckets.values():
            self.bucket(b.label).add(b)

    def stages_s(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.stages.items()}

    def bucket_rows(self) -> list[BucketRow]:
        return [b.row() for b in self.buckets.values()]


def lora_section(swaps: list[Swap] | None) -> dict | None:
    """The LoRA swaps the batch runner did, each set by its label; None without any."""
    if not swaps:
        return None
    seconds = [s.seconds for s in swaps]
    return {"swaps": len(swaps), "total_s": round(sum(seconds), 4), "median_s": round(statistics.median(seconds), 4),
            "layers": [s.layers for s in swaps], "sets": [list(s.labels) for s in swaps]}


def job_conditions(job: Job) -> dict[str, list[dict[str, Any]] | None]:
    """What the job's images are conditioned on beyond the prompt, for the report
    (`Report.build(conditions=job_conditions(job))`): each kind's entries (`Kind.report`: the characters and one-off
    references, the named ControlNets), each None where the job has none (a `controlnet:` job's one net included), so
    older jobs' reports keep their keys."""
    return {key: value for kind in KINDS for key, value in kind.report(job).items()}


def _per_s(count: float, seconds: float, digits: int) -> float:
    """A rate as the report rounds it; 0.0 for no time."""
    return round(count / seconds, digits) if seconds else 0.0


@dataclass(frozen=True)
class WorkerShare:
    """What a torchrun worker sends with its report for rank 0's merge (not written to report.json)."""

    rank: int
    host: str
    busy_s: float  # from its first claim to its report
    arrived_s: float  # from the moment the plan was shared to its report, by its own clock


@dataclass(frozen=True)
class Report:
    """report.json, one field per key, in its order, with its rounding: what one render did (`build`), or a
    multi-GPU render's workers together (`merge`). `to_json` and `from_json` carry it to the file and back."""

    job: str
    output_dir: str
    status: str
    run: dict[str, str]  # id, started, finished
    stopped_by: str | None  # the signal that stopped an interrupted render
    error: str | None  # what ended a failed one
    lora: dict[str, Any] | None  # the LoRA swaps (lora_section)
    device: str
    dtype: str
    engine: str
    model: str
    wall_s: float
    images_rendered: int
    images_skipped: int
    images_failed: int
    images_per_s: float  # over the wall time
    steps_per_s: float  # while denoising
    peak_memory_mb: float | None  # None on the CPU
    stages_s: dict[str, float]
    buckets: list[BucketRow]
    graphs: list[dict[str, Any]]  # Engine.describe()
    failures: list[dict[str, Any]]  # path, shot, reason
    notes: list[str]
    draft: bool
    shots: list[dict[str, Any]]  # what each shot used (plan.shot_levers)
    # what the images are conditioned on (job_conditions): each kind's report.json keys (`Kind.report_keys`) at the
    # top level of report.json, each absent where the job has none
    conditions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # a multi-GPU render's (`merge`): the wall time less weight loading, and each worker's row
    render_s: float | None = None
    render_images_per_s: float | None = None
    workers: list[dict[str, Any]] | None = None
    share: WorkerShare | None = None  # a worker's report on its way to the merge
    # a served job's (serve/folders.py): its images copied from an identical one rendered before (dedup), which
    # `images_rendered` leaves out; absent from report.json elsewhere
    images_cached: int | None = None
    # per stage that ran beside the denoising (encode, decode, save): the seconds of stages_s it hid (Timings.hidden_s)
    hidden_s: dict[str, float] | None = None

    @classmethod
    def build(cls, *, job: str, out_dir: Path, device: str, dtype: str, engine: str, model: str, timings: Timings,
              wall_s: float, rendered: int, skipped: int, failed: list[dict], peak_mem_mb: float | None,
              graphs: list[dict], status: str, notes: list[str], run: dict | None = None,
              stopped_by: int | None = None, error: str | None = None, lora_swaps: list[Swap] | None = None,
              shots: list[dict] | None = None, conditions: dict[str, list[dict] | None] | None = None,
              cached: int | None = None) -> Report:
        """One render's report. `run`: id, started, finished; `stopped_by`: the signal that stopped an interrupted
        render; `error`: what ended a failed one; `shots`: what each shot used (plan.shot_levers); `conditions`: what its
        images are conditioned on (job_conditions: each kind's keys, None where the job has none)."""
        shots = shots or []
        total_steps = sum(b.steps for b in timings.buckets.values())
        return cls(job=job, output_dir=str(out_dir), status=status, run=run or {},
                   stopped_by=signal.Signals(stopped_by).name if stopped_by else None, error=error,
                   lora=lora_section(lora_swaps), device=device, dtype=dtype, engine=engine, model=model,
                   wall_s=round(wall_s, 3), images_rendered=rendered, images_skipped=skipped,
                   images_failed=len(failed), images_per_s=_per_s(rendered, wall_s, 4),
                   steps_per_s=_per_s(total_steps, timings.stages["denoise"], 3),
                   peak_memory_mb=None if peak_mem_mb is None else round(peak_mem_mb, 1),
                   stages_s=timings.stages_s(), hidden_s=timings.hidden_s(), buckets=timings.bucket_rows(),
                   graphs=graphs, failures=failed, notes=notes, draft=any(s["draft"] for s in shots), shots=shots,
                   conditions={k: v for k, v in (conditions or {}).items() if v is not None}, images_cached=cached)

    @classmethod
    def merge(cls, reports: list[Report]) -> Report:
        """Workers' reports, each with its share, in rank order -> the job's: counts summed, stage seconds and what
        they hid summed over workers, buckets merged, and a `workers` table (busy, idle, images/s per worker). A
        worker may send several reports (a served job's leases: serve/folders.py): its row sums them. A worker's idle
        time is how long before the last one it finished (`arrived_s`: each by its own clock, so no clocks are
        compared across machines). The graphs are every worker's, each distinct one once (rank 0's first); the rest
        is the first report's (rank 0's: its run, its LoRA swaps, its shots)."""
        first = reports[0]
        ranks: dict[int, list[Report]] = {}
        for r in reports:
            ranks.setdefault(r.share.rank, []).append(r)
        end = max(r.share.arrived_s for r in reports)
        idle_s = {rank: end - max(r.share.arrived_s for r in mine) for rank, mine in ranks.items()}
        rendered = sum(r.images_rendered for r in reports)
        wall = first.wall_s + idle_s[first.share.rank]  # rank 0 is the last to finish: it waited for the others
        timings = Timings(stages={})
        for r in reports:
            timings.merge(r.timings)
        workers = [_worker_row(mine, idle_s[rank]) for rank, mine in ranks.items()]
        render_s = max(w["capture_s"] + w["busy_s"] + w["idle_s"] for w in workers)  # weight loading excluded
        peaks = [r.peak_memory_mb for r in reports if r.peak_memory_mb is not None]
        return replace(first, share=None, status=Status.worst(r.status for r in reports), wall_s=round(wall, 3),
                       images_rendered=rendered, images_failed=sum(r.images_failed for r in reports),
                       images_per_s=_per_s(rendered, wall, 4), render_s=round(render_s, 3),
                       render_images_per_s=_per_s(rendered, render_s, 4),
                       steps_per_s=round(sum(_steps_per_s(mine) for mine in ranks.values()), 3),
                       peak_memory_mb=max(peaks) if peaks else None, stages_s=timings.stages_s(),
                       hidden_s=timings.hidden_s(), buckets=timings.bucket_rows(),
                       graphs=list({json.dumps(g, sort_keys=True): g for r in reports for g in r.graphs}.values()),
                       failures=[f for r in reports for f in r.failures],
                       notes=list(dict.fromkeys(n for r in reports for n in r.notes)), workers=workers)

    @property
    def steps(self) -> int:
        """Denoising steps run (per batch, summed over its buckets)."""
        return sum(row["steps"] for row in self.buckets)

    def recounted(self, rendered: int) -> Report:
        """With `rendered` images (what the manifest holds of its run, once a multi-GPU launcher merged the lines of
        workers whose figures never came in) and the rate that follows from it."""
        return replace(self, images_rendered=rendered, images_per_s=_per_s(rendered, self.wall_s, 4))

    @property
    def timings(self) -> Timings:
        """The stage and bucket timings it was built from (as rounded here), what the denoising did not hide
        included."""
        return Timings(stages=dict(self.stages_s),
                       buckets={row["bucket"]: BucketTiming.from_row(row) for row in self.buckets},
                       exposed={k: self.stages_s.get(k, 0.0) - hid for k, hid in (self.hidden_s or {}).items()})

    def to_json(self) -> dict[str, Any]:
        """report.json's object; a merged report's figures after the rest, a worker's share last."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("share", "conditions")}
        for name in OPTIONAL:
            if out[name] is None:
                del out[name]
        at = list(out).index("shots") + 1  # the conditions' keys after the shots, where report.json always had them
        items = list(out.items())
        out = dict(items[:at] + [(k, self.conditions[k]) for k in CONDITIONS if k in self.conditions] + items[at:])
        return out | (asdict(self.share) if self.share else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        """A report as `to_json` wrote it (a worker's share included)."""
        share = WorkerShare(**{f.name: data[f.name] for f in fields(WorkerShare)}) if "rank" in data else None
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data and f.name != "share"},
                   conditions={k: data[k] for k in CONDITIONS if data.get(k) is not None}, share=share)


def _worker_row(reports: list[Report], idle_s: float) -> dict[str, Any]:
    """A worker's row in a merged report's workers table, from its reports (one per multi-GPU rank, one per lease of
    a served job)."""
    first, busy_s = reports[0], sum(r.share.busy_s for r in reports)
    images = sum(r.images_rendered for r in reports)
    return {"rank": first.share.rank, "host": first.share.host, "device": first.device, "images": images,
            "failed": sum(r.images_failed for r in reports),
            "load_s": round(sum(r.stages_s["load"] for r in reports), 4),
            "capture_s": round(sum(r.stages_s["capture"] for r in reports), 4),
            "busy_s": round(busy_s, 3), "idle_s": round(idle_s, 3), "images_per_s": _per_s(images, busy_s, 4)}


def _steps_per_s(reports: list[Report]) -> float:
    """One worker's denoising rate over its reports: their steps over their denoising seconds (each report's seconds
    as its own steps and rate give them, unrounded). Workers run side by side: the job's rate is the sum of theirs."""
    seconds = sum(r.steps / r.steps_per_s for r in reports if r.steps_per_s)
    return sum(r.steps for r in reports if r.steps_per_s) / seconds if seconds else 0.0


def _cached(report: dict) -> str:
    n = report.get("images_cached")
    return "" if n is None else f"{n} cached (copied from identical images rendered before), "


def markdown(report: dict) -> str:
    r = report
    run = r.get("run") or {}
    out = [f"# Render report: {r['job']}", "",
           f"- run {run.get('id', '?')}: {run.get('started', '?')} -> {run.get('finished', '?')}",
           f"- status: **{r['status']}**{_why(r)}; device `{r['device']}`, dtype {r['dtype']}, engine {r['engine']}, "
           f"model `{r['model']}`",
           f"- {r['images_rendered']} rendered, {_cached(r)}{r['images_skipped']} skipped (already done), "
           f"{r['images_failed']} failed in {r['wall_s']:.2f} s: {r['images_per_s']:.3f} images/s, "
           f"{r['steps_per_s']:.2f} steps/s while denoising",
           f"- peak device memory: {r['peak_memory_mb']} MB" if r["peak_memory_mb"] is not None else
           "- peak device memory: n/a (CPU)", "", "## Stages", ""]
    hidden = r.get("hidden_s") or {}
    if hidden:  # the stages that ran beside the denoising, and how much of each it hid
        out += ["| stage | s | hidden s |", "|---|---:|---:|"]
        out += [f"| {k} | {v:.3f} | {f'{hidden[k]:.3f}' if k in hidden else ''} |" for k, v in r["stages_s"].items()]
    else:
        out += ["| stage | s |", "|---|---:|"]
        out += [f"| {k} | {v:.3f} |" for k, v in r["stages_s"].items()]
    out += ["", "## Buckets", "", "| bucket | images | batches | UNet rows | steps | denoise s | ms/step |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {b['bucket']} | {b['images']} | {b['batches']} | {b['rows']} | {b['steps']} | "
            f"{b['denoise_s']:.3f} | {b['ms_per_step']:.1f} |" for b in r["buckets"]]
    if r["graphs"]:
        out += ["", "## Graphs", "", "GPU idle: the time the GPU waited for the host between the replays of the "
                "graph's loops.", "",
                "| shape | state | capture s | pool MB | replays | replay ms | GPU idle ms | note |",
                "|---|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {g['shape']} | {g['state']} | {g['capture_s']:.2f} | {g['pool_mb']:.0f} | {g['replays']} | "
                f"{g['replay_ms']:.2f} | {g.get('idle_ms', 0.0):.1f} | {g.get('reason') or ''} |" for g in r["graphs"]]
    levered = [s for s in r.get("shots", ()) if s["draft"] or s["guided_steps"] < s["steps"] or s["deepcache"]
               or (s.get("control_steps") or s["steps"]) < s["steps"]]
    if levered:
        out += ["", "## Draft levers" + (" (a draft render)" if r.get("draft") else ""), "",
                "| shot | draft | guided steps | cfg_cutoff | ControlNet steps | DeepCache |", "|---|---|---:|---:|---:|---|"]
        out += [f"| {s['shot']} | {'draft' if s['draft'] else ''} | {s['guided_steps']}/{s['steps']} | "
                f"{s['cfg_cutoff']:g} | {_control(s)} | {_deepcache(s)} |" for s in levered]
    hires = [s for s in r.get("shots", ()) if isinstance(s.get("hires"), dict)]
    if hires:
        out += ["", "## Hires passes", "", "| shot | size | hires size | steps run | strength | upscaler |",
                "|---|---|---|---:|---:|---|"]
        out += [f"| {s['shot']} | {h.get('size', '?')} | {h['width']}x{h['height']} | "
                f"{h.get('steps_run', '?')}/{h['steps']} | {h['strength']:g} | {h['upscaler']} |"
                for s in hires for h in [s["hires"]]]
    if r.get("workers"):  # a merged report (Report.merge): a multi-GPU render, a served job
        out += ["", "## Workers", "", "| rank | host | device | images | failed | load s | capture s | busy s | idle s "
                "| images/s |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {w['rank']} | {w['host']} | {w['device']} | {w['images']} | {w['failed']} | {w['load_s']:.2f} | "
                f"{w['capture_s']:.2f} | {w['busy_s']:.3f} | {w['idle_s']:.3f} | {w['images_per_s']:.3f} |"
                for w in r["workers"]]
    out += _conditions_md(r)
    if r.get("lora"):
        lo = r["lora"]
        out += ["", "## LoRA", "", f"- {lo['swaps']} swaps, {lo['total_s']:.3f} s in all, median {lo['median_s']:.3f} s",
                "", "| from | to | layers |", "|---|---|---:|"]
        out += [f"| {a} | {b} | {n} |" for (a, b), n in zip(lo["sets"], lo["layers"])]
    if r["failures"]:
        out += ["", "## Failures", "", "| image | reason |", "|---|---|"]
        out += [f"| {f['path']} | {f['reason']} |" for f in r["failures"]]
    if r["notes"]:
        out += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(out) + "\n"


def _conditions_md(r: dict) -> list[str]:
    """Each kind's tables (`Kind.report_md`: the references, the named ControlNets)."""
    return [line for kind in shown() for line in kind.report_md(r)]


def _control(shot: dict) -> str:
    return "" if shot.get("control_steps") is None else f"{shot['control_steps']}/{shot['steps']}"


def _deepcache(shot: dict) -> str:
    if shot["deepcache"]:
        return f"interval {shot['deepcache']['interval']}, branch {shot['deepcache']['branch']}"
    return "off (ControlNet)" if shot["deepcache_dropped"] else "off"


def _why(r: dict) -> str:
    if r.get("stopped_by"):
        return f" (stopped by {r['stopped_by']})"
    return f" ({r['error']})" if r.get("error") else ""


def write_report(out_dir: Path, report: Report) -> tuple[Path, Path]:
    """report.json and report.md: where a report stops being a `Report`."""
    data = report.to_json()
    js, md = out_dir / REPORT_JSON, out_dir / REPORT_MD
    atomic_write(js, (json.dumps(data, indent=2) + "\n").encode())
    atomic_write(md, markdown(data).encode())
    return js, md


def job_of_folder(out_dir: Path) -> Job | None:
    """The job that rendered `out_dir` (its report.json names the job file), if that file still loads."""
    report = read_report(out_dir)
    if not report or not isinstance(report.get("job"), str):
        return None
    try:
        job = load_job(report["job"])
    except StoryboardError:
        return None
    return as_draft(job) if report.get("draft") is True else job  # a draft folder: the job as --draft ran it
