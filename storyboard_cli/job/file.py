"""YAML job file -> frozen, validated dataclasses. No torch here.

Every error names file:line, the shot id and the field, in one line (errors.JobError). The YAML is read by
job/yaml_loader.py, values are checked by job/values.py, the LoRA files and images the job names by job/files.py,
and each conditioning kind's keys by its row in job/conditions/ (`Job` and `Shot` inherit the kinds' parts).
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from storyboard_cli.errors import did_you_mean
from storyboard_cli.folder.layout import RESERVED
from storyboard_cli.job.conditions import KINDS, merged, parts
from storyboard_cli.job.files import LoraFile, declared_inputs, lora_set, resolve_loras, shot_loras
from storyboard_cli.job.hires import Hires, read_hires
from storyboard_cli.job.refinement import Refinement
from storyboard_cli.job.inputs import INPUTS_KEY, Inputs
from storyboard_cli.job.kind import ShotSource
from storyboard_cli.job.lora_files import LORA_TAG
from storyboard_cli.job.preflight import expanded, job_spec
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_int, as_str, check_keys,
                                       given, line_of, sub_mapping, type_name)
from storyboard_cli.job.yaml_loader import SHOT_ID, Located, clip, read_yaml, short_repr
from storyboard_cli.samplers import MAX_STEPS, SAMPLERS
from storyboard_cli.steps import NO_DEEPCACHE, DeepCache, guided_steps

NAMED_SIZES = {
    "square": (1024, 1024),
    "portrait": (832, 1216),
    "landscape": (1216, 832),
    "wide": (1344, 768),
}
DEFAULT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)  # every size up to 8: a group never splits into more batches than it must
MIN_SIDE, MAX_SIDE = 64, 4096
MAX_CANDIDATES = 64
MAX_BUCKET = 64
MAX_SEED = 2**63 - 1 - MAX_CANDIDATES
MAX_PATH = 4096  # Linux's PATH_MAX

TOP_KEYS = ("version", "name", "model", "output_dir", "buckets", "loras", "defaults", "shots", INPUTS_KEY,
            *(key for kind in KINDS for key in kind.job_keys))
SHOT_KEYS = ("id", "prompt", "negative", "candidates", "size", "seed", "steps", "guidance", "sampler", "lora",
             "cfg_cutoff", "deepcache", "hires", *(key for kind in KINDS for key in kind.shot_keys))
DEEPCACHE_KEYS = ("interval", "branch")
MAX_INTERVAL = 10
MAX_BRANCH = 2  # SDXL's UNet has 3 up blocks: branches 0 (the shallowest skip) to 2
# `bcg render --draft`: the levers every shot gets (docs/PERFORMANCE.md, "Draft renders"): guidance on the
# first half of the steps (the guidance-interval paper's finding: little is lost at low noise), DeepCache's
# full UNet every 3rd step on the shallowest branch (its paper's SDXL setting); a ControlNet stops where the
# guidance stops (the composition it holds is set in the early, noisy steps), and DeepCache runs after it
DRAFT_CUTOFF = 0.5
DRAFT_DEEPCACHE = DeepCache(3, 0)
SHOT_DEFAULTS: dict[str, Any] = {
    "negative": "",
    "candidates": 1,
    "size": "square",
    "steps": 30,
    "guidance": 5.0,
    "sampler": "euler",
}


@dataclass(frozen=True)
class Shot(*parts("ShotPart")):
    """One shot of the job; what it is conditioned on are its kinds' fields (job/conditions/: `shot.controls`)."""

    id: str
    prompt: str
    negative: str
    candidates: int
    width: int
    height: int
    seed: int
    steps: int
    guidance: float
    sampler: str
    line: int
    first_candidate: int = 0  # > 0 only for candidates added later (bcg render --reroll)
    loras: tuple[tuple[str, float], ...] = ()  # (name in Job.loras, scale), sorted by name, no zero scales
    cfg_cutoff: float = 1.0  # the fraction of the steps that use guidance (1.0: every step)
    deepcache: DeepCache = NO_DEEPCACHE
    draft: bool = False  # rendered by `bcg render --draft`: marked so in every output
    hires: Hires | None = None  # a hires pass after the shot's size (job/hires.py)
    refine: Refinement | None = None  # a refinement of one of its candidates (`bcg refine`: folder/refines.py)


@dataclass(frozen=True)
class Job(*parts("JobPart")):
    """A job file, validated; its conditioning kinds' top-level keys are their fields (job/conditions/)."""

    path: Path
    name: str
    model: str
    output_dir: Path
    buckets: tuple[int, ...]
    shots: tuple[Shot, ...]
    loras: dict[str, LoraFile] = field(default_factory=dict)  # the top-level `loras:`, by name
    lines: dict[str, int | None] = field(default_factory=dict)  # the model fields' lines (model and the kinds')
    warnings: tuple[str, ...] = ()  # said once where the job loads (located as its errors are): `bcg plan`, `render`

    @property
    def folder(self) -> Path:
        """The job file's folder: every relative path in the job is read from it (preflight.job_spec)."""
        return self.path.resolve().parent


def parse_size(text: Any) -> tuple[int, int]:
    """'WxH' or a named aspect -> (width, height). Raises ValueError with a reason."""
    if not isinstance(text, str):
        raise ValueError(f"must be 'WxH' or one of {', '.join(NAMED_SIZES)}, got {given(text)}")
    key = text.strip().lower()
    if key in NAMED_SIZES:
        return NAMED_SIZES[key]
    m = re.fullmatch(r"(\d{1,9})\s*[x×]\s*(\d{1,9})", key)  # 9 digits: int() stays cheap, the range check says why
    if not m:
        raise ValueError(f"must be 'WxH' or one of {', '.join(NAMED_SIZES)}, got {short_repr(text)}"
                         f"{did_you_mean(key, NAMED_SIZES)}")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if side % 8:
            raise ValueError(f"{width}x{height}: both sides must be multiples of 8")
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise ValueError(f"{width}x{height}: each side must be between {MIN_SIDE} and {MAX_SIDE}")
    return width, height


def _default_seed(shot_id: str) -> int:
    # stable across runs and machines, unlike hash()
    return zlib.crc32(shot_id.encode())


def _resolve_shot(ctx: Context, raw: Any, index: int, defaults: Located, job_dir: Path, list_line: int,
                  job: Job) -> Shot:
    if not isinstance(raw, Located):
        raise ctx.fail(list_line, f"#{index + 1}", None, f"a shot must be a mapping, got {type_name(raw)}")
    shot_id = raw.get("id")
    if shot_id is None:
        raise ctx.fail(raw.line, f"#{index + 1}", "id", "missing")
    label = clip(shot_id) if isinstance(shot_id, str) else f"#{index + 1}"
    id_line = line_of(raw, "id")
    shot_id = as_str(ctx, shot_id, id_line, label, "id", empty_ok=False)
    if not SHOT_ID.fullmatch(shot_id):
        label = clip(shot_id) if shot_id.isprintable() else f"#{index + 1}"  # the message stays one line
        raise ctx.fail(id_line, label, "id", f"{SAFE_NAME_RULE} (it names a folder), got {short_repr(shot_id)}")
    if shot_id.lower() in RESERVED:
        raise ctx.fail(id_line, label, "id", f"'{shot_id}' is a name bcg uses in the output folder "
                       f"({', '.join(RESERVED)}); choose another")
    check_keys(ctx, raw, SHOT_KEYS, shot_id)

    def get(field: str) -> tuple[Any, int | None]:
        if field in raw:
            return raw[field], line_of(raw, field)
        if field in defaults:
            return defaults[field], line_of(defaults, field)
        if field in SHOT_DEFAULTS:
            return SHOT_DEFAULTS[field], raw.line
        return None, raw.line

    prompt, line = get("prompt")
    if prompt is None:
        raise ctx.fail(line, shot_id, "prompt", "missing")
    prompt = as_str(ctx, prompt, line, shot_id, "prompt", empty_ok=False)
    lora_raw, lora_line = get("lora")
    prompt_line = line
    prompt, lora_scales = shot_loras(ctx, prompt, line, lora_raw, lora_line, shot_id, job.loras)
    negative, line = get("negative")
    negative = "" if negative is None else as_str(ctx, negative, line, shot_id, "negative", empty_ok=True)
    if LORA_TAG.search(negative):
        raise ctx.fail(line, shot_id, "negative", "a <lora:...> tag cannot go in the negative prompt; "
                       "put it in the prompt or in 'lora:'")
    candidates = as_int(ctx, *get("candidates"), shot_id, "candidates", 1, MAX_CANDIDATES)
    size, line = get("size")
    try:
        width, height = parse_size(size)
    except ValueError as e:
        raise ctx.fail(line, shot_id, "size", str(e)) from None
    seed, line = get("seed")
    seed = _default_seed(shot_id) if seed is None else as_int(ctx, seed, line, shot_id, "seed", 0, MAX_SEED)
    steps = as_int(ctx, *get("steps"), shot_id, "steps", 1, MAX_STEPS)
    guidance = as_float(ctx, *get("guidance"), shot_id, "guidance", 0.0, 30.0)
    sampler, line = get("sampler")
    sampler = as_str(ctx, sampler, line, shot_id, "sampler", empty_ok=False)
    if sampler not in SAMPLERS:
        raise ctx.fail(line, shot_id, "sampler", f"unknown sampler {short_repr(sampler)} (known: {', '.join(SAMPLERS)})"
                       f"{did_you_mean(sampler, SAMPLERS)}")
    conditioned = {}
    for kind in KINDS:
        part, lora_scales = kind.resolve_shot(ctx, ShotSource(get, shot_id, (width, height), job_dir, job, lora_scales,
                                                              lora_raw, lora_line, prompt_line))
        conditioned.update(part)
    cfg_cutoff, line = get("cfg_cutoff")
    cfg_cutoff = 1.0 if cfg_cutoff is None else as_float(ctx, cfg_cutoff, line, shot_id, "cfg_cutoff", 0.0, 1.0)
    deepcache = _deepcache(ctx, *get("deepcache"), shot_id)
    hires = read_hires(ctx, *get("hires"), shot_id, width, height, steps)
    return Shot(shot_id, prompt, negative, candidates, width, height, seed, steps, guidance, sampler, raw.line,
                loras=lora_set(lora_scales), cfg_cutoff=cfg_cutoff, deepcache=deepcache, hires=hires, **conditioned)


def _deepcache(ctx: Context, raw: Any, line: int | None, shot_id: str) -> DeepCache:
    """`deepcache: {interval: N, branch: K}` (branch 0 when left out); `off`, `false` or nothing: off."""
    raw = sub_mapping(ctx, raw, line, shot_id, "deepcache", DEEPCACHE_KEYS, "{interval: 3, branch: 0}", "interval",
                      "the full UNet runs every N-th step")
    if raw is None:
        return NO_DEEPCACHE
    interval = as_int(ctx, raw["interval"], line_of(raw, "interval"), shot_id, "deepcache.interval", 2,
                       MAX_INTERVAL)
    branch = as_int(ctx, raw.get("branch", 0), line_of(raw, "branch", raw.line), shot_id, "deepcache.branch", 0,
                     MAX_BRANCH)
    return DeepCache(interval, branch)


def as_draft(job: Job) -> Job:
    """The job as `bcg render --draft` renders it: every shot with the draft levers, marked as a draft; a kind's
    side network ends where the guidance does (or earlier, where the shot says so: `Kind.draft`)."""
    def draft(s: Shot) -> Shot:
        end = guided_steps(s.steps, DRAFT_CUTOFF) / s.steps
        return replace(s, cfg_cutoff=DRAFT_CUTOFF, deepcache=DRAFT_DEEPCACHE, draft=True,
                       **merged(kind.draft(s, end) for kind in KINDS))

    return replace(job, shots=tuple(draft(s) for s in job.shots))


def _top_field(ctx: Context, doc: Located, key: str, *, required: bool = False) -> tuple[Any, int | None]:
    line = line_of(doc, key)
    if key not in doc or doc[key] is None:
        if required:
            raise ctx.fail(doc.line, None, key, "missing")
        return None, line
    return doc[key], line


def _first_content_line(path: Path) -> int:
    lines = path.read_text(encoding="utf-8").splitlines()
    return next((i + 1 for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")), 1)


def load_job(path: str | Path, roots: tuple[Path, ...] | None = None, inputs: Inputs | None = None) -> Job:
    """Reads and validates a job file. Raises JobError (exit code 2) on any problem. With `roots` (the
    render service's folders), every file the job names must lie under one of them, or it is refused
    before it is read. With `inputs` (the service and its workers), files the job names by sha256 are read
    from a blob store (job/inputs.py)."""
    path = Path(path).expanduser()
    ctx = Context(str(path), roots, inputs)
    doc = read_yaml(path)
    if doc is None:
        raise ctx.fail(1, None, None, "the job file is empty")
    if not isinstance(doc, Located):
        raise ctx.fail(_first_content_line(path), None, None, f"the top level must be a mapping, got {type_name(doc)}")
    check_keys(ctx, doc, TOP_KEYS, None)

    version, line = _top_field(ctx, doc, "version", required=True)
    if version != 1 or isinstance(version, bool):
        raise ctx.fail(line, None, "version", f"must be 1, got {short_repr(version)}")
    name, line = _top_field(ctx, doc, "name")
    if name is None:
        name = _name_from_file(ctx, path, doc.line)
    else:
        name = as_str(ctx, name, line, None, "name", empty_ok=False)
        if not SAFE_NAME.fullmatch(name):
            raise ctx.fail(line, None, "name", f"{SAFE_NAME_RULE} (it names a folder), got {short_repr(name)}")
    model, line = _top_field(ctx, doc, "model", required=True)
    model = as_str(ctx, model, line, None, "model", empty_ok=False)
    ctx.model_spec(model, line, "model")
    output_dir, line = _top_field(ctx, doc, "output_dir")
    output_dir = Path("outputs") / name if output_dir is None else _output_dir(ctx, output_dir, line)
    ctx.confine(path.resolve().parent / output_dir, line, None, "output_dir", clip(str(output_dir)))

    buckets, line = _top_field(ctx, doc, "buckets")
    if buckets is None:
        buckets = DEFAULT_BUCKETS
    else:
        if not isinstance(buckets, list) or not buckets:
            raise ctx.fail(line, None, "buckets", f"must be a non-empty list of batch sizes, got {given(buckets)}")
        buckets = tuple(sorted({as_int(ctx, b, line, None, "buckets", 1, MAX_BUCKET) for b in buckets}))

    defaults, line = _top_field(ctx, doc, "defaults")
    if defaults is None:
        defaults = Located()
        defaults.line, defaults.lines = doc.line, {}
    elif not isinstance(defaults, Located):
        raise ctx.fail(line, None, "defaults", f"must be a mapping, got {type_name(defaults)}")
    else:
        check_keys(ctx, defaults, tuple(k for k in SHOT_KEYS if k != "id"), None, prefix="defaults.")

    job_dir = path.resolve().parent
    declared_inputs(ctx, *_top_field(ctx, doc, INPUTS_KEY))
    loras = resolve_loras(ctx, *_top_field(ctx, doc, "loras"), job_dir, job_spec(model, job_dir))
    conditioned = merged(kind.resolve_job(ctx, doc, job_spec(model, ctx.folder), job_dir, loras) for kind in KINDS)
    job = Job(path, name, model, output_dir, buckets, (), loras, dict(ctx.lines), **conditioned)

    shots_raw, line = _top_field(ctx, doc, "shots", required=True)
    if not isinstance(shots_raw, list):
        raise ctx.fail(line, None, "shots", f"must be a list of shots, got {type_name(shots_raw)}")
    if not shots_raw:
        raise ctx.fail(line, None, "shots", "the job has no shots")
    shots: list[Shot] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(shots_raw):
        shot = _resolve_shot(ctx, raw, i, defaults, job_dir, line, job)
        folded = shot.id.lower()  # case-insensitive file systems would merge 'A' and 'a'
        if folded in seen:
            raise ctx.fail(line_of(raw, "id"), shot.id, "id",
                           f"duplicate shot id (first used on line {seen[folded]})")
        seen[folded] = line_of(raw, "id") or 0
        shots.append(shot)
    return replace(job, shots=tuple(shots), warnings=tuple(ctx.warnings))


def _output_dir(ctx: Context, raw: Any, line: int | None) -> Path:
    """The job's `output_dir:`, `~` expanded as the model path is."""
    text = as_str(ctx, raw, line, None, "output_dir", empty_ok=False)
    if len(text) > MAX_PATH:
        raise ctx.fail(line, None, "output_dir", f"is {len(text)} characters long; a path has at most {MAX_PATH}")
    ctx.refuse_home(text, line, None, "output_dir")
    folder = expanded(text)
    if folder is None:
        raise ctx.fail(line, None, "output_dir", f"{clip(text)}: {clip(text.split('/')[0])} names no user of "
                       f"this machine")
    return folder


def _name_from_file(ctx: Context, path: Path, line: int) -> str:
    """A job without `name:` is named after its file, made safe for a folder name: `ep 1 (v2).yaml` -> `ep-1-v2`,
    `épisode.yaml` -> `episode` (accents dropped, as NFKD decomposes them)."""
    ascii_stem = unicodedata.normalize("NFKD", path.stem).encode("ascii", "ignore").decode()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", ascii_stem).lstrip("-_.").rstrip("-")[:64]
    if not name:
        raise ctx.fail(line, None, None, f"the file name {path.name!r} cannot name the output folder: "
                       f"add a top-level 'name:' ({SAFE_NAME_RULE})")
    return name


def named_files(path: Path) -> list[str]:
    """The files a job names (its LoRA files, then each conditioning kind's: `Kind.job_files`, then per key of the
    defaults and each shot, `Kind.shot_files`), as it writes them, in file order, without validating the rest: what
    `bcg submit` uploads. Raises JobError for a file that is not YAML."""
    doc = read_yaml(Path(path))
    if not isinstance(doc, dict):
        return []
    names: list = []
    loras = doc.get("loras")
    if isinstance(loras, dict):
        names += loras.values()
    for kind in KINDS:
        names += kind.job_files(doc)
    defaults = doc.get("defaults")
    shots = doc.get("shots")
    for holder in ([defaults] if isinstance(defaults, dict) else []) + (shots if isinstance(shots, list) else []):
        for key, value in holder.items() if isinstance(holder, dict) else ():
            for kind in KINDS:
                names += kind.shot_files(key, value)
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n.strip()))
