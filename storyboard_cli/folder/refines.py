"""`bcg refine OUT_DIR REFINES.yaml`: refinements of a render's candidates, read and checked (`load_refines`), and
the job that renders them beside their sources (`refine_job`). No torch.

    refine:
      - shot: s01-cold-open
        candidate: s01-cold-open/s01-cold-open_c1_s1002.png   # left out: the shot's pick
        name: hand            # the files' tag (left out: r1, r2, ... in the file's order)
        mask: {box: [40, 96, 64, 64], blur: 4, padding: 32}   # or {image: hand-mask.png}: the job's `mask:`
        prompt: a hand holding a red umbrella                   # left out: the shot's
        strength: 0.6
        candidates: 2
        seed: 7               # left out: the source's seed
        hires: {scale: 1.5, strength: 0.35, steps: 12}

The same `refine:` list may sit in the contact sheet's picks file, whose `picks:` then name the candidates the
entries without `candidate` refine (else picks.json's, from `bcg pick`). A refinement is the shot again, started
from the candidate's pixels (`init: {image, strength}`) and repainted where its mask is white (`mask:`): the init
and mask kinds' keys (job/conditions/), read here from the entry so their errors name REFINES.yaml's lines. Its
files are `<source stem>.<tag>_c<j>_s<seed>.png` beside the source (folder/layout.py `refine_name`): never a
candidate's name, and bcg replaces only files it wrote there."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from storyboard_cli.errors import BadInput, JobError, did_you_mean
from storyboard_cli.folder.layout import REFINE_TAG, REPORT_JSON, read_chunk, recorded_picks
from storyboard_cli.folder.picks import PICK_KEYS, picked
from storyboard_cli.folder.report import job_of_folder
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.file import MAX_CANDIDATES, MAX_SEED, Job, Shot, as_draft
from storyboard_cli.job.hires import Hires, read_hires
from storyboard_cli.job.plan import started_from
from storyboard_cli.job.refinement import Refinement
from storyboard_cli.job.values import Context, as_float, as_int, as_str, check_keys, given, line_of
from storyboard_cli.job.yaml_loader import Located, clip, read_yaml

# the area a refinement repaints is written as a shot's (the key of the kind a picture starts from: Kind.start_keys)
REPAINT = next((kind.start_keys[1] for kind in KINDS if kind.start_keys), "")
ENTRY_KEYS = ("shot", "candidate", "name", REPAINT, "prompt", "negative", "strength", "candidates", "seed", "hires")
DEFAULT_STRENGTH = 0.75  # A1111's inpaint default


@dataclass(frozen=True)
class Entry:
    """One refinement asked for, checked."""

    shot: Shot  # the source's shot, as the job has it, at the source's size (a hires frame is refined at its own)
    source: str  # the candidate refined, relative to the output folder
    tag: str
    line: int
    area: Located | None  # the area it repaints as written (`mask:`): the kind a picture starts from reads it
    area_folder: Path  # what the area's image path is read from (REFINES.yaml's folder)
    outline: tuple[int, int, int, int] | None
    prompt: str
    negative: str
    strength: float
    candidates: int
    seed: int
    hires: Hires | None


def load_refines(path: str | Path, out_dir: str | Path, job: Job | None = None) -> list[Entry]:
    """Reads and checks REFINES.yaml against the output folder and its job (report.json's, when not given). Raises
    JobError (exit 2) naming file:line, the entry's shot and the field."""
    path, out_dir = Path(path), Path(out_dir)
    file = str(path)
    ctx = Context(file)
    job = job or job_of_folder(out_dir)
    if job is None:
        raise BadInput(f"{out_dir}: no job to refine (its {REPORT_JSON} names none that loads); render it first")
    doc = read_yaml(path)
    if not isinstance(doc, Located):
        raise JobError(file, 1, None, None, "the top level must be a mapping with a 'refine' list")
    check_keys(ctx, doc, PICK_KEYS, None)
    raw = doc.get("refine")
    if not isinstance(raw, list) or not raw:
        raise ctx.fail(line_of(doc, "refine", doc.line), None, "refine",
                       f"must be a list of refinements, got {given(raw)}")
    picks = _picks(ctx, doc, out_dir)
    shots = {s.id: s for s in reversed(job.shots)}  # the job's first shot of each id
    entries: list[Entry] = []
    tags: dict[tuple[str, str], int] = {}
    for index, value in enumerate(raw):
        entry = _entry(ctx, value, index, line_of(doc, "refine", doc.line), shots, picks, out_dir, tags)
        entries.append(entry)
    return entries


def _picks(ctx: Context, doc: Located, out_dir: Path) -> dict[str, str]:
    """The picks entries without a candidate refine: this file's `picks:`, else picks.json's."""
    own = doc.get("picks")
    if isinstance(own, Located):
        return {str(k): v for k, v in own.items() if isinstance(v, str)}
    return recorded_picks(out_dir)["picks"]


def _entry(ctx: Context, raw: Any, index: int, list_line: int | None, shots: dict[str, Shot], picks: dict[str, str],
           out_dir: Path, tags: dict[tuple[str, str], int]) -> Entry:
    label = f"#{index + 1}"
    if not isinstance(raw, Located):
        raise ctx.fail(list_line, label, None, f"a refinement must be a mapping, got {given(raw)}")
    shot_id = raw.get("shot")
    if shot_id is None:
        raise ctx.fail(raw.line, label, "shot", "missing")
    shot_id = as_str(ctx, shot_id, line_of(raw, "shot"), label, "shot", empty_ok=False)
    if shot_id not in shots:
        raise ctx.fail(line_of(raw, "shot"), clip(shot_id), "shot",
                       f"unknown shot (not in the folder's job){did_you_mean(shot_id, shots)}")
    shot = shots[shot_id]
    check_keys(ctx, raw, ENTRY_KEYS, shot_id)
    source, line = raw.get("candidate"), line_of(raw, "candidate", raw.line)
    if source is None:
        source = picks.get(shot_id)
        if source is None:
            raise ctx.fail(raw.line, shot_id, "candidate", "missing, and the shot has no pick (pick it on the "
                           "contact sheet, or name the candidate)")
    source = _source(ctx, as_str(ctx, source, line, shot_id, "candidate", empty_ok=False), line, shot_id, out_dir)
    name_line = line_of(raw, "name", raw.line)
    n = tags.get((source, ""), 0) + 1
    tag = as_str(ctx, raw["name"], name_line, shot_id, "name", empty_ok=False) if "name" in raw else f"r{n}"
    if not REFINE_TAG.fullmatch(tag):
        raise ctx.fail(name_line, shot_id, "name", f"must be 1-32 letters, digits or '-' (it names the files), "
                       f"got {clip(tag)!r}")
    if (source, tag) in tags:
        raise ctx.fail(name_line, shot_id, "name", f"{tag!r} names two refinements of {source}; give each its own "
                       f"`name`")
    tags[(source, tag)] = 1
    tags[(source, "")] = n
    width, height = _size(out_dir / source)
    shot = replace(shot, width=width, height=height)
    area, outline = _area(ctx, raw, shot_id, width, height)
    prompt = as_str(ctx, raw["prompt"], line_of(raw, "prompt"), shot_id, "prompt", empty_ok=False) \
        if "prompt" in raw else shot.prompt
    negative = as_str(ctx, raw["negative"], line_of(raw, "negative"), shot_id, "negative", empty_ok=True) \
        if raw.get("negative") is not None else shot.negative
    strength_line = line_of(raw, "strength", raw.line)
    strength = as_float(ctx, raw.get("strength", DEFAULT_STRENGTH), strength_line, shot_id, "strength", 0.0, 1.0)
    if strength == 0:
        raise ctx.fail(strength_line, shot_id, "strength", "must be in (0, 1], got 0 (nothing would change)")
    candidates = as_int(ctx, raw.get("candidates", 1), line_of(raw, "candidates", raw.line), shot_id, "candidates",
                        1, MAX_CANDIDATES)
    seed = as_int(ctx, raw["seed"], line_of(raw, "seed"), shot_id, "seed", 0, MAX_SEED) if "seed" in raw else \
        picked(source)[2]
    hires = read_hires(ctx, raw.get("hires"), line_of(raw, "hires", raw.line), shot_id, shot.width, shot.height,
                       shot.steps)
    return Entry(shot, source, tag, raw.line, area, ctx.folder, outline, prompt, negative, strength, candidates, seed, hires)


def _source(ctx: Context, rel: str, line: int | None, shot: str, out_dir: Path) -> str:
    """`rel` must name a candidate bcg rendered for `shot`, on disk in the output folder."""
    p = PurePosixPath(rel.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts:
        raise ctx.fail(line, shot, "candidate", f"{clip(rel)!r}: give the path relative to the output folder "
                       f"{out_dir}")
    rel = p.as_posix()
    if not (out_dir / rel).is_file():
        raise ctx.fail(line, shot, "candidate", f"missing file: {out_dir / rel}")
    found = picked(rel)
    meta = read_chunk(out_dir / rel)
    if found is None or found[0] != shot or meta is None or meta.get("shot") != shot:
        raise ctx.fail(line, shot, "candidate", f"{rel} is not an image bcg rendered for this shot")
    return rel


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def _area(ctx: Context, raw: Located, shot: str, width: int, height: int
          ) -> tuple[Located | None, tuple[int, int, int, int] | None]:
    """The area the entry repaints (`mask:`, read again by its kind as a shot's), and the box the sheet outlines: a
    `box`'s, or the white area's of an `image` (its kind checks the image itself). None: the whole frame (img2img)."""
    area = raw.get(REPAINT)
    if area is None:
        return None, None
    line = line_of(raw, REPAINT)
    if not isinstance(area, Located):
        raise ctx.fail(line, shot, REPAINT, f"must be a mapping like {{box: [x, y, w, h]}} or {{image: file}}, got "
                       f"{given(area)}")
    box = area.get("box")
    if box is not None:
        box_line = line_of(area, "box")
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  for v in box)):
            raise ctx.fail(box_line, shot, f"{REPAINT}.box", f"must be [x, y, w, h] in pixels, got {given(box)}")
        x, y, w, h = box
        if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > width or y + h > height:
            raise ctx.fail(box_line, shot, f"{REPAINT}.box", f"[{x}, {y}, {w}, {h}] is outside the {width}x{height} "
                           f"image (or empty)")
        return area, (x, y, w, h)
    image = area.get("image")
    if isinstance(image, str) and image.strip():
        try:
            from PIL import Image

            with Image.open((ctx.folder / image).resolve()) as im:
                white = im.convert("L").resize((width, height)).point(lambda v: 255 if v > 127 else 0)
                bbox = white.getbbox()
        except OSError:
            return area, None  # its kind says what is wrong with the file, at its line
        if bbox is not None:
            return area, (bbox[0], bbox[1], bbox[2] - bbox[0], bbox[3] - bbox[1])
    return area, None


def refine_job(job: Job, out_dir: Path, entries: list[Entry], refines_path: Path, draft: bool = False) -> Job:
    """The job that renders the refinements: per entry its shot again, started from the source's pixels and
    repainted under its mask (the init and mask kinds' keys, read by their rows from the entry), with the entry's
    prompt, seed, candidates and hires pass, named as refinements of the source. `draft`: with the draft levers."""
    ctx = Context(str(refines_path))
    shots = []
    for e in entries:
        part = started_from(ctx, job, e.shot, (out_dir / e.source).resolve(), e.strength, e.line, e.area)
        shots.append(replace(e.shot, prompt=e.prompt, negative=e.negative, candidates=e.candidates, seed=e.seed,
                             first_candidate=0, hires=e.hires, refine=Refinement(e.source, e.tag, e.outline),
                             **part))
    refined = replace(job, shots=tuple(shots))
    return as_draft(refined) if draft else refined


JOB_MARK = "# written by bcg refine"  # the first line of a refine job file: bcg replaces only such a file


def refine_job_text(job: Job, out_dir: Path, entries: list[Entry]) -> str:
    """The refinements as a job file of their own, for `bcg submit` (a server, and a worker without this machine's
    files: the sources and masks travel as the job's files): the folder's job file with its shots replaced by one
    shot per refinement, `<shot>.<tag>`, each its shot's keys plus where it starts (the source's `init:`) and what
    it repaints, its prompt, seed, size, candidates and hires pass. Paths stay as the job wrote them (read from the
    job file's folder: write it there); the sources and masks are absolute."""
    import yaml

    doc = yaml.safe_load(job.path.read_text(encoding="utf-8"))
    raw = {s.get("id"): s for s in doc.get("shots", []) if isinstance(s, dict)}
    kind = next(k for k in KINDS if k.start_keys)
    start, repaint = kind.start_keys
    shots = []
    for e in entries:
        shot = {k: v for k, v in raw.get(e.shot.id, {}).items() if k not in ("candidates", "seed", "size")}
        shot.update({"id": f"{e.shot.id}.{e.tag}", "prompt": e.prompt, "negative": e.negative,
                     "candidates": e.candidates, "seed": e.seed, "size": f"{e.shot.width}x{e.shot.height}",
                     start: {"image": str((out_dir / e.source).resolve()), "strength": e.strength}})
        if e.area is not None:
            area = dict(e.area)
            if isinstance(area.get("image"), str):
                area["image"] = str((Path(e.area_folder) / area["image"]).resolve())
            shot[repaint] = area
        shot["hires"] = e.hires.settings(e.shot.width, e.shot.height, e.shot.steps) if e.hires else False
        for key in ("width", "height"):
            if isinstance(shot["hires"], dict):
                shot["hires"].pop(key)
        shots.append(shot)
    doc["shots"] = shots
    doc.pop("inputs", None)
    return f"{JOB_MARK} from {out_dir}\n" + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def write_refine_job(path: Path, text: str) -> None:
    """Writes the refine job file, replacing only one bcg refine wrote."""
    from storyboard_cli.folder.outputs import atomic_write

    if path.exists() and not path.read_text(encoding="utf-8", errors="replace").startswith(JOB_MARK):
        raise BadInput(f"{path}: exists and was not written by bcg refine; choose another --job-out")
    atomic_write(path, text.encode("utf-8"))


def refine_job_file(out_dir: Path, refines: Path, job_out: Path) -> Path:
    """`bcg refine OUT_DIR REFINES.yaml --job-out FILE`: the refinements checked and written as a job file."""
    job = job_of_folder(out_dir)
    if job is None:
        raise BadInput(f"{out_dir}: no job to refine (its {REPORT_JSON} names none that loads); render it first")
    write_refine_job(job_out, refine_job_text(job, out_dir, load_refines(refines, out_dir, job)))
    return job_out
