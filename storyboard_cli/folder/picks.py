"""Picks: the candidate chosen for each shot (and the shots to reroll), from the contact sheet's picks.yaml.

    picks:
      "s01-cold-open": "s01-cold-open/s01-cold-open_c1_s1002.png"
    reroll:
      - "s03-stairs"
    round: 2          # optional: the same reroll list again asks for new candidates only with a new round

`load_picks` validates it (one-line errors naming file:line, shot and field); `apply_picks` copies the
picks, in shot order, to `<out>/selects/NNN_<shot>.png` and records them in `<out>/picks.json`;
`reroll_shots` / `with_rerolls` turn the reroll list into new candidates for `bcg render --reroll`.
`render_target` is what `bcg render --draft` / `--final` render, and where.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Iterable

import yaml

from storyboard_cli.errors import BadInput, JobError, did_you_mean, folder_error
from storyboard_cli.folder.layout import (DRAFT, INDEX, PICKS_GENERATOR, PICKS_JSON, REROLLS, SELECT_NAME, SELECTS,
                                          candidate_files, parse_output_name, parse_refine_name, read_chunk,
                                          read_fingerprint, read_json, refuse_foreign, select_name, shot_order,
                                          written_by_bcg)
from storyboard_cli.folder.outputs import atomic_write
from storyboard_cli.folder.report import job_of_folder
from storyboard_cli.job.file import Job, Shot, as_draft
from storyboard_cli.job.yaml_loader import read_text

PICK_KEYS = ("picks", "reroll", "round", "refine")  # `refine`: what `bcg refine` reads of it (folder/refines.py)


@dataclass(frozen=True)
class Picks:
    path: Path
    picks: dict[str, str]  # shot -> candidate PNG, relative to the output folder (posix), in file order
    reroll: tuple[str, ...]
    round: int = 1  # the reroll request's round: the same list and round give the same candidates


# ---------------------------------------------------------------- reading picks.yaml


def _compose(path: Path):
    """The YAML node tree (nodes carry their line numbers; scalars stay text, so `001` is a shot id)."""
    file = str(path)
    text = read_text(path, "picks")
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise JobError(file, mark.line + 1 if mark else None, None, None,
                       f"YAML syntax error: {(e.problem or 'invalid YAML').strip()}") from None
    except yaml.YAMLError as e:
        raise JobError(file, None, None, None, f"YAML error: {e}") from None


def _line(node) -> int:
    return node.start_mark.line + 1


def _text(file: str, node, shot: str | None, field: str) -> str:
    if not isinstance(node, yaml.ScalarNode):
        kind = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
        what = "one candidate file, not several" if field == "picks" else "a shot id"
        raise JobError(file, _line(node), shot, field, f"must be {what}, got {kind}")
    if not node.value.strip():
        raise JobError(file, _line(node), shot, field, "empty")
    return node.value.strip()


def _unknown(file: str, line: int, shot: str, field: str, known: list[str], where: str) -> JobError:
    return JobError(file, line, shot, field, f"unknown shot (not in {where}){did_you_mean(shot, known)}")


def _check_file(file: str, line: int, shot: str, rel: str, out_dir: Path) -> str:
    """`rel` must name a bcg candidate image of `shot` inside the output folder. Returns it normalised."""
    p = PurePosixPath(rel.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts:
        raise JobError(file, line, shot, "picks", f"{rel!r}: give the path relative to the output folder {out_dir}")
    rel = p.as_posix()
    path = out_dir / rel
    if not path.is_file():
        raise JobError(file, line, shot, "picks", f"missing file: {path}")
    meta = read_chunk(path)  # None: an artist's edit of the candidate (its tool dropped bcg's chunk)
    if picked(rel) is None or picked(rel)[0] != shot or (meta is not None and meta.get("shot") != shot):
        raise JobError(file, line, shot, "picks", f"{rel} is not a candidate image bcg rendered for this shot")
    return rel


def picked(rel: str) -> tuple[str, int, int] | None:
    """(shot, candidate, seed) of a file a pick may name: a candidate, or a refinement of one (`bcg refine`: its own
    candidate and seed); None for any other name."""
    parsed = parse_output_name(rel)
    if parsed is not None:
        return parsed
    refined = parse_refine_name(rel)
    return (refined[0], refined[3], refined[4]) if refined is not None else None


def _shot_ids(job: Job | None) -> list[str]:
    return [s.id for s in job.shots] if job else []


def load_picks(path: str | Path, out_dir: str | Path, job: Job | None = None) -> Picks:
    """Reads and checks picks.yaml against the output folder (and the job, when given): every shot known,
    every picked file a candidate of its shot on disk, one pick per shot, no shot both picked and rerolled.
    Raises JobError (a BadInput: exit 2) naming file:line, shot and field."""
    path, out_dir = Path(path), Path(out_dir)
    file = str(path)
    root = _compose(path)
    if root is None:
        raise JobError(file, 1, None, None, "the picks file is empty")
    if not isinstance(root, yaml.MappingNode):
        raise JobError(file, _line(root), None, None, "the top level must be a mapping with 'picks' and 'reroll'")
    known = [s.id for s in job.shots] if job else shot_order(out_dir, _shot_ids(job_of_folder(out_dir)))
    where = f"the job {job.path}" if job else f"the output folder {out_dir}"
    sections: dict[str, object] = {}
    for key_node, value_node in root.value:
        key = _text(file, key_node, None, "key")
        if key not in PICK_KEYS:
            raise JobError(file, _line(key_node), None, key, f"unknown key{did_you_mean(key, PICK_KEYS, known=True)}")
        if key in sections:
            raise JobError(file, _line(key_node), None, key, "given twice")
        sections[key] = value_node

    picks: dict[str, str] = {}
    lines: dict[str, int] = {}
    node = sections.get("picks")
    if node is not None and not (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")):
        if not isinstance(node, yaml.MappingNode):
            raise JobError(file, _line(node), None, "picks", "must be a mapping of shot: candidate file")
        for key_node, value_node in node.value:
            shot = _text(file, key_node, None, "picks")
            line = _line(key_node)
            if shot in picks:
                raise JobError(file, line, shot, "picks",
                               f"two picks for one shot (first on line {lines[shot]}); keep one")
            if shot not in known:
                raise _unknown(file, line, shot, "picks", known, where)
            picks[shot] = _check_file(file, _line(value_node), shot, _text(file, value_node, shot, "picks"), out_dir)
            lines[shot] = line

    reroll: list[str] = []
    node = sections.get("reroll")
    if node is not None and not (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")):
        if not isinstance(node, yaml.SequenceNode):
            raise JobError(file, _line(node), None, "reroll", "must be a list of shot ids")
        for item in node.value:
            shot = _text(file, item, None, "reroll")
            if shot in reroll:
                raise JobError(file, _line(item), shot, "reroll", "listed twice")
            if shot not in known:
                raise _unknown(file, _line(item), shot, "reroll", known, where)
            if shot in picks:
                raise JobError(file, _line(item), shot, "reroll",
                               f"both picked (line {lines[shot]}) and marked reroll; choose one")
            reroll.append(shot)
    round_ = 1
    node = sections.get("round")
    if node is not None:
        text = _text(file, node, None, "round")
        if not text.isdigit() or int(text) < 1:
            raise JobError(file, _line(node), None, "round", f"must be a whole number from 1, got {text!r}")
        round_ = int(text)
    return Picks(path, picks, tuple(reroll), round_)


# ---------------------------------------------------------------- applying them


def apply_picks(out_dir: str | Path, picks: Picks, job: Job | None = None) -> list[Path]:
    """`_apply_picks`, with a folder that cannot be written as the one line a person can act on."""
    try:
        return _apply_picks(Path(out_dir), picks, job)
    except OSError as e:
        raise folder_error(Path(out_dir), e) from None


def _apply_picks(out_dir: Path, picks: Picks, job: Job | None = None) -> list[Path]:
    """Copies each pick, in shot order, to `<out>/selects/NNN_<shot>.png` (byte for byte: the PNG keeps its
    parameters), removes selects bcg wrote earlier that are no longer picked, and records the picks in
    `<out>/picks.json`. Never replaces a file bcg did not write: it checks every target before copying."""
    out_dir = Path(out_dir)
    order = shot_order(out_dir, _shot_ids(job or job_of_folder(out_dir)))
    missing = [s for s in picks.picks if s not in order]
    if missing:
        raise BadInput(f"{picks.path}: shot '{missing[0]}' is not in {out_dir}'s job")
    plan = [(out_dir / select_name(order.index(s) + 1, s, len(order)), s) for s in order if s in picks.picks]
    targets = {dst for dst, _ in plan}
    record_path = out_dir / PICKS_JSON
    # an edited pick's select has no bcg chunk: the last picks.json says it is ours
    copied = {out_dir / p["select"] for p in (read_json(record_path) or {}).get("picks", [])
              if isinstance(p, dict) and isinstance(p.get("select"), str)} if written_by_bcg(record_path) else set()
    stale = []
    sel_dir = out_dir / SELECTS
    if sel_dir.is_dir():
        for f in sorted(sel_dir.iterdir()):
            if f not in targets and SELECT_NAME.match(f.name) and (f in copied or read_fingerprint(f) is not None):
                stale.append(f)  # an earlier pick of ours
    for dst in [dst for dst, _ in plan if dst not in copied] + [record_path]:
        refuse_foreign(dst, "before picking")

    records, written = [], []
    for dst, shot in plan:
        src = out_dir / picks.picks[shot]
        data = src.read_bytes()
        if not (dst.is_file() and dst.stat().st_size == len(data) and dst.read_bytes() == data):
            atomic_write(dst, data)
        meta = read_chunk(src)
        _, k, seed = picked(picks.picks[shot])
        records.append({"shot": shot, "path": picks.picks[shot], "select": dst.relative_to(out_dir).as_posix(),
                        "candidate": k, "seed": seed, "fingerprint": (meta or {}).get("fingerprint"),
                        "edited": meta is None})
        written.append(dst)
    for f in stale:
        f.unlink(missing_ok=True)
    record = {"generator": PICKS_GENERATOR, "version": 1, "source": str(picks.path),
              "applied": time.strftime("%Y-%m-%dT%H:%M:%S"), "picks": records, "reroll": list(picks.reroll)}
    atomic_write(record_path, (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return written


# ---------------------------------------------------------------- reroll


def reroll_shots(job: Job, out_dir: str | Path, shots: tuple[str, ...] | list[str],
                 asked: Iterable[tuple[str, int, int, int]] = ()) -> tuple[Shot, ...]:
    """The extra work for `bcg render --reroll`: per rerolled shot, `candidates` new candidates whose
    indices continue after every candidate the job names or the folder holds, with seeds no image of
    that shot has used. `asked`: (shot, first candidate, seed, count) of earlier reroll rounds, used even
    where their images are not on disk yet. Pure apart from listing `<out>/<shot>/`; existing images are
    never touched.

    Candidate k of a Shot has seed `seed + k` (plan.work_items), so a new Shot with
    `first_candidate=k0` keeps the job's seeds running on (seed + k0, seed + k0 + 1, ...) unless one
    of those is taken (the job's seed was changed since), then it starts after the largest seed used."""
    out_dir = Path(out_dir)
    by_id: dict[str, list[Shot]] = {}
    for s in job.shots:
        by_id.setdefault(s.id, []).append(s)
    extra = []
    for shot_id in dict.fromkeys(shots):
        if shot_id not in by_id:
            raise BadInput(f"--reroll: shot '{shot_id}' is not in {job.path}{did_you_mean(shot_id, by_id)}")
        same = by_id[shot_id]
        base = same[0]
        on_disk = candidate_files(out_dir, shot_id)
        earlier = [(k0, seed0, n) for s, k0, seed0, n in asked if s == shot_id]
        first = max([s.first_candidate + s.candidates for s in same] + [k + 1 for _, k, _, _ in on_disk]
                    + [k0 + n for k0, _, n in earlier])
        used = {s.seed + k for s in same for k in range(s.first_candidate, s.first_candidate + s.candidates)}
        used |= {seed for _, _, seed, _ in on_disk} | {seed0 + k for k0, seed0, n in earlier
                                                        for k in range(k0, k0 + n)}
        seed = base.seed
        if any(seed + k in used for k in range(first, first + base.candidates)):
            seed = max(used) + 1 - first
        extra.append(replace(base, first_candidate=first, seed=seed))
    return tuple(extra)


def with_rerolls(job: Job, out_dir: str | Path, shots: tuple[str, ...] | list[str]) -> Job:
    """The job plus its rerolled shots' new candidates: rendering it skips every image already done and
    renders only the new ones."""
    return replace(job, shots=job.shots + reroll_shots(job, out_dir, shots))


def rerolled(job: Job, out_dir: str | Path, picks_path: str | Path) -> Job:
    """`bcg render JOB --reroll picks.yaml`: checks the picks file against the job and the folder, then
    returns the job with new candidates for every shot on its reroll list."""
    picks = load_picks(picks_path, out_dir, job)
    if not picks.reroll:
        raise BadInput(f"{picks_path}: --reroll: the file marks no shot to reroll")
    return replace(job, shots=job.shots + reroll_round(job, Path(out_dir), picks))


def reroll_round(job: Job, out_dir: Path, picks: Picks) -> tuple[Shot, ...]:
    """The new candidates of a reroll request, recorded in `<out>/rerolls.json` the first time it is seen:
    the same request (reroll list and round) gives the same candidates however often it runs (a retry,
    a killed reroll resumed); a new round asks for new ones."""
    record = read_json(out_dir / REROLLS) or {}
    rounds = [r for r in record.get("rounds", []) if isinstance(r, dict)]
    request = {"reroll": list(picks.reroll), "round": picks.round}
    by_id = {s.id: s for s in reversed(job.shots)}  # the job's first shot of each id
    for r in rounds:
        if r.get("request") == request and all(s in by_id for s in r.get("shots", {})):
            return tuple(replace(by_id[s], first_candidate=k0, seed=seed, candidates=n)
                         for s, (k0, seed, n) in r["shots"].items())
    asked = [(s, *v) for r in rounds for s, v in r.get("shots", {}).items()]
    extra = reroll_shots(job, out_dir, picks.reroll, asked)
    rounds.append({"request": request, "shots": {s.id: [s.first_candidate, s.seed, s.candidates] for s in extra},
                   "asked": time.strftime("%Y-%m-%dT%H:%M:%S")})
    refuse_foreign(out_dir / REROLLS, "before recording the reroll")
    atomic_write(out_dir / REROLLS, (json.dumps({"generator": PICKS_GENERATOR, "rounds": rounds}, indent=2,
                                                ensure_ascii=False) + "\n").encode("utf-8"))
    return extra


# ---------------------------------------------------------------- draft and final


def finals(job: Job, draft_dir: Path, picks_path: str | Path) -> Job:
    """`bcg render JOB --final picks.yaml`: the candidates picked on the draft sheet, one shot each, at full
    quality with the seed each was drafted with (the same noise: the final keeps the draft's composition as
    far as the levers left it). Every other shot of the job is left out."""
    picks = load_picks(picks_path, draft_dir, as_draft(job))
    if not picks.picks:
        raise BadInput(f"{picks_path}: --final: the file picks no candidate (pick on {draft_dir / INDEX})")
    shots = []
    for shot in job.shots:
        rel = picks.picks.get(shot.id)
        if rel is not None and shot.id not in {s.id for s in shots}:
            if parse_output_name(rel) is None:
                raise BadInput(f"{picks_path}: --final: {rel} is a refinement; refine the final's candidate with "
                               f"`bcg refine` instead")
            _, k, seed = parse_output_name(rel)
            shots.append(replace(shot, first_candidate=k, candidates=1, seed=seed - k))  # candidate k: seed + k
    return replace(job, shots=tuple(shots))


def render_folder(job: Job, out_dir: Path | None, draft: bool, draft_out: Path | None = None) -> Path:
    """The folder `bcg render` writes: `<out>/draft/` (or `draft_out`) for a draft, else `<out>`."""
    out = Path(out_dir) if out_dir else job.output_dir
    if not draft:
        return out
    return Path(draft_out) if draft_out else out / DRAFT


def render_target(job: Job, out_dir: Path | None, *, reroll: Path | None = None, draft: bool = False,
                  draft_out: Path | None = None, final: Path | None = None) -> tuple[Job, Path]:
    """What `bcg render` renders and into which folder: the job (with a picks file's rerolls), the job as a
    draft into `<out>/draft/` (or `draft_out`), or the draft's picks at full quality into `<out>`."""
    out = Path(out_dir) if out_dir else job.output_dir
    draft_dir = render_folder(job, out_dir, True, draft_out)
    if draft and final is not None:
        raise BadInput("--draft and --final: choose one (draft the candidates, then render the picks --final)")
    if final is not None and reroll is not None:
        raise BadInput("--final renders the picks, --reroll new candidates: choose one")
    if draft_out is not None and not draft and final is None:
        raise BadInput("--draft-out names the draft folder: give it with --draft or --final")
    if final is not None:
        return finals(job, draft_dir, final), out
    if draft:
        return as_draft(rerolled(job, draft_dir, reroll) if reroll else job), draft_dir
    return (rerolled(job, out, reroll) if reroll else job), out
