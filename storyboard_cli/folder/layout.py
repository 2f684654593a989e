"""The output folder's layout: the names of what bcg keeps in it, the readers of its files, and the one
check that keeps bcg from replacing a file it did not write. No torch, no job: every stage may read it.

    <out>/<shot>/<shot>_c<k>_s<seed>.png   a candidate (its `bcg` PNG chunk: settings, fingerprint)
    <out>/<shot>/<shot>_c<k>_s<seed>.<tag>_c<j>_s<seed'>.png   a refinement of that candidate (`bcg refine`)
    <out>/<shot>/<shot>_c<k>_s<seed>.base.png   a hires candidate's first pass, at the shot's size
    <out>/<shot>/thumbs/<name>.jpg         the contact sheet's thumbnails
    <out>/manifest.jsonl                   one line per image bcg wrote (outputs.Manifest)
    <out>/report.json, report.md           the last render's report (report.py)
    <out>/index.html                       the contact sheet (sheet.py)
    <out>/picks.json, selects/NNN_<shot>.png   the picks applied (picks.py)
    <out>/.replaced/<run>/<path>           edited files that --force rendered again
    <out>/.shards/rank<N>/manifest.jsonl   a multi-GPU worker's manifest lines (shards.py)
    <out>/.bcg.lock                        held by the render writing here (lock.py)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from storyboard_cli.errors import BadInput

REPORT_JSON, REPORT_MD = "report.json", "report.md"
MANIFEST = "manifest.jsonl"
INDEX = "index.html"
PICKS_JSON, PICKS_YAML = "picks.json", "picks.yaml"
SELECTS = "selects"
THUMBS = "thumbs"  # inside each shot's folder: a shot id cannot name a nested folder there
REPLACED = ".replaced"  # edited files that --force rendered again, by run: <out>/.replaced/<stamp>/<path>
SHARDS = ".shards"
LOCK = ".bcg.lock"
REROLLS = "rerolls.json"  # every `--reroll` request and the candidates it asked for: a retry asks for the same
# the names a shot's folder must not take (compared case-folded: case-insensitive file systems)
DRAFT = "draft"  # `bcg render --draft` writes to <out>/draft/ (unless --draft-out says where)
RESERVED = (REPORT_JSON, REPORT_MD, MANIFEST, INDEX, SELECTS, THUMBS, PICKS_JSON, PICKS_YAML, REROLLS, DRAFT)

# what marks the files bcg wrote: index.html's meta and the thumbnails' JPEG comment; picks.json's
# `generator`; a candidate or a select by its `bcg` PNG chunk
SHEET_GENERATOR = "bcg contact sheet"
PICKS_GENERATOR = "bcg pick"
INDEX_MARK = f'<meta name="generator" content="{SHEET_GENERATOR}">'

OUTPUT_NAME = re.compile(r"(?P<folder>[^/]+)/(?P<shot>[^/]+)_c(?P<k>[0-9]+)_s(?P<seed>[0-9]+)\.png")
# a refinement: its source candidate's stem, the entry's tag (no '_' or '.': the name parses one way), its own
# candidate and seed; never a candidate's name (OUTPUT_NAME's shot would have to equal the folder)
REFINE_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,31}")
REFINE_NAME = re.compile(r"(?P<folder>[^/]+)/(?P<source>(?P<shot>[^/]+)_c(?P<k>[0-9]+)_s(?P<seed>[0-9]+))"
                         rf"\.(?P<tag>{REFINE_TAG.pattern})_c(?P<j>[0-9]+)_s(?P<rseed>[0-9]+)\.png")
BASE_SUFFIX = ".base.png"
SELECT_NAME = re.compile(r"^\d{3,}_(?P<shot>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.png$")


# ---------------------------------------------------------------- names


def output_name(shot: str, k: int, seed: int) -> str:
    return f"{shot}/{shot}_c{k}_s{seed}.png"


def parse_output_name(path: str) -> tuple[str, int, int] | None:
    """The inverse of output_name: 'shot/shot_c3_s1004.png' -> ('shot', 3, 1004); None for other names."""
    m = OUTPUT_NAME.fullmatch(path)
    if not m or m["shot"] != m["folder"]:
        return None
    return m["shot"], int(m["k"]), int(m["seed"])


def refine_name(source: str, tag: str, j: int, seed: int) -> str:
    """`<shot>/<shot>_c1_s1002.<tag>_c<j>_s<seed>.png`: refinement j of the candidate at `source` (its path)."""
    return f"{source[:-len('.png')]}.{tag}_c{j}_s{seed}.png"


def base_name(path: str) -> str:
    """Where a hires candidate's first pass is kept: `<shot>/<shot>_c1_s1002.base.png` (never a candidate's or a
    refinement's name: the hires frame is the candidate)."""
    return f"{path[:-len('.png')]}{BASE_SUFFIX}"


def parse_refine_name(path: str) -> tuple[str, str, str, int, int] | None:
    """The inverse of refine_name: (shot, source path, tag, j, seed); None for other names."""
    m = REFINE_NAME.fullmatch(path)
    if not m or m["shot"] != m["folder"]:
        return None
    return m["shot"], f"{m['folder']}/{m['source']}.png", m["tag"], int(m["j"]), int(m["rseed"])


def thumb_name(shot: str, image: str) -> str:
    """Where the thumbnail of `image` (a candidate's path, or an input's thumbnail name) goes:
    `<shot>/thumbs/<stem>.jpg`."""
    return f"{shot}/{THUMBS}/{Path(image).stem}.jpg"


def select_name(index: int, shot: str, count: int) -> str:
    """`selects/003_<shot>.png`: numbered by the shot's place in the job, so a name stays put when a
    shot picked later fills a gap."""
    return f"{SELECTS}/{index:0{max(3, len(str(count)))}d}_{shot}.png"


# ---------------------------------------------------------------- readers


def read_json(path: Path) -> dict | None:
    """A JSON object from a file; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_report(out_dir: Path) -> dict | None:
    """The last render's report.json, or None."""
    return read_json(out_dir / REPORT_JSON)


def read_chunk(path: Path, verify: bool = False) -> dict | None:
    """The `bcg` JSON chunk of a PNG (the chunks before the pixels: no pixel decode); None when absent,
    foreign or unreadable. `verify`: also None for a file cut short (it reads the whole file)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            meta = json.loads(im.info.get("bcg", "null") or "null")  # .text would decode the pixels
            if verify:
                im.verify()  # a truncated file fails here
    except Exception:  # noqa: BLE001 - a foreign or broken file is simply "not a bcg image"
        return None
    return meta if isinstance(meta, dict) else None


def read_fingerprint(path: Path) -> str | None:
    """The fingerprint in a finished PNG, or None if the file is missing, foreign or broken."""
    return (read_chunk(path, verify=True) or {}).get("fingerprint")


def manifest_records(folder: Path) -> list[dict]:
    """manifest.jsonl's records (each names its file in `path`) in file order; a line cut short by a crash
    is skipped. None without a manifest; raises OSError for one it cannot read."""
    path = folder / MANIFEST
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("path"), str):
            records.append(rec)
    return records


def _named_files(out_dir: Path, shot: str, parse) -> list[tuple]:
    """(rel path, *what `parse` read of its name after the shot, stat) of every file in `<out>/<shot>/` it reads."""
    try:
        entries = list(os.scandir(out_dir / shot))
    except OSError:
        return []
    return [(f"{shot}/{e.name}", *parsed[1:], e.stat()) for e in entries
            if (parsed := parse(f"{shot}/{e.name}")) and e.is_file()]


def candidate_files(out_dir: Path, shot: str) -> list[tuple[str, int, int, os.stat_result]]:
    """(rel path, k, seed, stat) of every file in `<out>/<shot>/` named as a candidate of `shot`."""
    return sorted(_named_files(out_dir, shot, parse_output_name), key=lambda f: f[1])


def refinement_files(out_dir: Path, shot: str) -> list[tuple[str, str, str, int, int, os.stat_result]]:
    """(rel path, source path, tag, j, seed, stat) of every file in `<out>/<shot>/` named as a refinement of one of
    `shot`'s candidates."""
    return sorted(_named_files(out_dir, shot, parse_refine_name), key=lambda f: (f[1], f[2], f[3]))


def shot_order(out_dir: Path, first: Iterable[str] = ()) -> list[str]:
    """Shot ids: `first` (the job's, in its order), then manifest order, then any other folder holding
    candidate images (sorted)."""
    ids = list(dict.fromkeys(first))
    try:
        ids += [r["shot"] for r in manifest_records(out_dir) if isinstance(r.get("shot"), str)]
    except OSError:
        pass
    try:
        folders = sorted(e.name for e in os.scandir(out_dir) if e.is_dir() and e.name != SELECTS)
    except OSError:
        folders = []
    ids += [f for f in folders if candidate_files(out_dir, f)]
    return list(dict.fromkeys(ids))


def recorded_picks(out_dir: Path) -> dict:
    """picks.json (written by `bcg pick`) as {"picks": {shot: path}, "reroll": [shot]}."""
    data = read_json(out_dir / PICKS_JSON) or {}
    picks = {p["shot"]: p["path"] for p in data.get("picks", []) if isinstance(p, dict) and "shot" in p}
    return {"picks": picks, "reroll": [s for s in data.get("reroll", []) if isinstance(s, str)]}


# ---------------------------------------------------------------- whose file is it


def written_by_bcg(path: Path) -> bool:
    """Whether bcg wrote the file at `path`, by the mark each kind of file carries."""
    if path.name == INDEX:
        with open(path, "rb") as f:
            return INDEX_MARK.encode() in f.read(2048)
    if path.name in (PICKS_JSON, REROLLS):
        return (read_json(path) or {}).get("generator") == PICKS_GENERATOR
    if path.suffix == ".png":
        return read_fingerprint(path) is not None
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.info.get("comment") == SHEET_GENERATOR.encode()
    except Exception:  # noqa: BLE001 - unreadable: not ours
        return False


def refuse_foreign(path: Path, remedy: str) -> None:
    """The one ownership check: raises BadInput when `path` exists and bcg did not write it (bcg never
    replaces such a file). `remedy`: what moving it away allows, e.g. "before picking"."""
    if path.exists() and not written_by_bcg(path):
        raise BadInput(f"{path}: exists and was not written by bcg; move it away {remedy}")
