"""The contact sheet: `<out>/index.html`, one row per shot, its candidates side by side as thumbnails.

Built only from what is on disk (PNGs and their `bcg` chunk, manifest.jsonl, report.json, picks.json)
and, when given, the Job (for job order and for images that are missing or failed). One page, no
network, no library: thumbnails are small JPEGs next to the PNGs (`<shot>/thumbs/<name>.jpg`),
charts are hand-written SVG, picking is a few lines of inline JavaScript. Everything lands through
atomic_write, so a reader (a browser reloading during a long render) sees an old or a new page,
never half of one; and no file bcg did not write is replaced.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from storyboard_cli.errors import BadInput, folder_error
from storyboard_cli.folder.charts import esc, report_svgs
from storyboard_cli.folder.layout import (INDEX, INDEX_MARK, SHEET_GENERATOR, candidate_files,
                                          parse_output_name, read_chunk, read_report, recorded_picks, refinement_files,
                                          refuse_foreign, shot_order, thumb_name)
from storyboard_cli.folder.lock import held
from storyboard_cli.folder.outputs import atomic_write
from storyboard_cli.folder.report import job_of_folder
from storyboard_cli.folder.sheet_assets import CSP, SCRIPT, STYLE, json_island
from storyboard_cli.folder.sheet_refs import Guide, guides_html, href, meta_guides, shot_guides
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.file import Job
from storyboard_cli.job.kind import sortable
from storyboard_cli.job.lora_files import lora_set_label
from storyboard_cli.job.plan import shot_levers_label, work_items
from storyboard_cli.steps import DeepCache, levers_label

THUMB_PX = 256  # longest side of a thumbnail
EDITED = "edited outside bcg: kept as it is (render --force renders it again)"


@dataclass
class Candidate:
    path: str  # relative to the output folder, posix
    shot: str
    k: int
    seed: int
    mtime_ns: int = 0
    meta: dict | None = None  # the bcg chunk ({} for an edited file that lost it); None: not on disk
    thumb: str | None = None
    thumb_size: tuple[int, int] = (0, 0)
    state: str = "ok"  # ok | stale | edited | failed | missing
    reason: str = ""
    source: str = ""  # a refinement's: the candidate it refines (`bcg refine`), shown after it
    tag: str = ""

    @property
    def order(self) -> tuple:
        """A candidate by its index, each refinement right after its source."""
        src = parse_output_name(self.source) if self.source else None
        return (src[1], src[2], 1, self.tag, self.k) if src else (self.k, self.seed, 0, "", 0)


@dataclass
class ShotRow:
    id: str
    settings: dict  # prompt, negative, size, ... (from the Job, else from a candidate's bcg chunk)
    candidates: list[Candidate] = field(default_factory=list)
    guides: list[Guide] = field(default_factory=list)  # its references' and guides' thumbnails (sheet_refs.py)


# ---------------------------------------------------------------- thumbnails


def thumb_size(width: int, height: int, box: int = THUMB_PX) -> tuple[int, int]:
    scale = min(1.0, box / max(width, height, 1))
    return max(1, round(width * scale)), max(1, round(height * scale))


def _thumb_jpeg(im) -> bytes:
    """A thumbnail's JPEG, fitting THUMB_PX, of an RGB PIL image."""
    import io

    from PIL import Image

    small = im.resize(thumb_size(*im.size), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=82, optimize=True, comment=SHEET_GENERATOR)
    return buf.getvalue()


def make_thumb(src: Path, dst: Path, src_mtime_ns: int) -> tuple[int, int]:
    """A JPEG of `src` fitting THUMB_PX, written only when missing or older than `src`. Returns its size.
    Raises BadInput if `dst` exists and is not a thumbnail bcg wrote."""
    from PIL import Image

    try:
        st = dst.stat()
    except FileNotFoundError:
        st = None
    if st is not None and st.st_mtime_ns >= src_mtime_ns:
        with Image.open(dst) as im:
            return im.size
    refuse_foreign(dst, "so the contact sheet can write its thumbnail there")
    with Image.open(src) as im:
        im = im.convert("RGB")
        data = _thumb_jpeg(im)
    atomic_write(dst, data)
    return thumb_size(*im.size)


def write_thumb(pixels, dst: Path) -> None:
    """The thumbnail of an image a render is writing, from the pixels of its PNG (uint8 [H, W, 3], numpy or torch on
    the CPU): the bytes make_thumb makes from that PNG. Called once the PNG has landed, so the sheet finds it fresh
    and does not make it again. Raises BadInput where `dst` is a file bcg did not write."""
    from PIL import Image

    refuse_foreign(dst, "so the contact sheet can write its thumbnail there")
    array = pixels.numpy() if hasattr(pixels, "numpy") else pixels
    atomic_write(dst, _thumb_jpeg(Image.fromarray(array, "RGB")))


def _settings_of_shot(shot) -> dict:
    s = {"prompt": shot.prompt, "negative": shot.negative, "size": f"{shot.width}x{shot.height}",
         "steps": shot.steps, "sampler": shot.sampler, "guidance": f"{shot.guidance:g}", "seed": shot.seed,
         "candidates": shot.candidates}
    s["levers"] = shot_levers_label(shot)
    return s


def _settings_of_meta(meta: dict) -> dict:
    s = {"prompt": meta.get("prompt", ""), "negative": meta.get("negative", ""),
         "size": f"{meta.get('width', '?')}x{meta.get('height', '?')}", "steps": meta.get("steps", "?"),
         "sampler": meta.get("sampler", "?"), "guidance": meta.get("guidance", "?")}
    s["levers"] = _levers_of_meta(meta)
    return s


def _levers_of_meta(meta: dict) -> str:
    """The draft levers an image's settings record, as `bcg plan` names them ("" for a full render, or settings
    too damaged to tell)."""
    steps, guidance = meta.get("steps"), meta.get("guidance")
    sides = [kind.meta_side(meta) for kind in KINDS]
    side = any(runs for runs, _ in sides)
    cutoff, end = meta.get("cfg_cutoff", 1.0), max((end for runs, end in sides if runs), default=1.0, key=sortable)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (steps, guidance, cutoff, end))
    if not numbers or not isinstance(steps, int) or steps < 1:
        return ""
    return levers_label(steps, guidance > 1, cutoff, side, end, DeepCache.from_json(meta.get("deepcache")))


def _loras_text(loras: object) -> str:
    """The `loras` of a PNG's bcg chunk ([{"name", "scale", ...}]) as the one LoRA-set label; an entry
    without a name is shown by its file's name."""
    entries = [x for x in loras if isinstance(x, dict)] if isinstance(loras, list) else []
    return lora_set_label((str(x.get("name") or Path(str(x.get("path") or x.get("file") or "?")).name),
                           x["scale"] if isinstance(x.get("scale"), (int, float)) else None) for x in entries)


def _outline(meta: dict, w: int, h: int) -> str:
    """The area a refinement repainted, outlined over its thumbnail (its settings' `refine.outline`, in the
    source's pixels: the image's own width and height); "" for anything else."""
    refine = meta.get("refine")
    box = refine.get("outline") if isinstance(refine, dict) else None
    width, height = meta.get("width"), meta.get("height")
    if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, int) for v in box)
            and isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        return ""
    x, y, bw, bh = box
    return (f'<svg class="mask-outline" viewBox="0 0 {width} {height}" width="{w}" height="{h}" aria-hidden="true">'
            f'<rect x="{x}" y="{y}" width="{bw}" height="{bh}" vector-effect="non-scaling-stroke"></rect></svg>')


class SheetWriter:
    """Keeps what it has read (PNG chunks, thumbnail sizes, finished rows) between updates, so a call
    after each shot only opens the new files. One instance per output folder and process."""

    def __init__(self, out_dir: Path, job: Job | None = None, min_interval_s: float = 2.0):
        self.out_dir = Path(out_dir)
        self.job = job
        self.min_interval_s = min_interval_s
        self.path = self.out_dir / INDEX
        self._meta: dict[str, tuple[int, int, dict | None]] = {}  # rel -> (mtime_ns, size, chunk)
        self._thumbs: dict[str, tuple[int, tuple[int, int]]] = {}  # rel -> (png mtime_ns, thumb size)
        self._rows: dict[str, tuple[object, str]] = {}  # shot -> (inputs, html)
        self._written: str | None = None  # the last page written, to skip identical rewrites
        self._last = 0.0
        self._report_job: Job | bool | None = None  # without a job: report.json's, read once
        self.images_on_disk = 0  # the job's images on the last page written

    # -------------------------------------------------------- public

    def update(self, failures: list[dict] | None = None, running: bool | None = None) -> Path:
        """Rebuilds index.html from the disk now. `failures` (path, shot, reason) overrides report.json's
        list (a render passes its own while it runs); `running` marks the page as a render in progress
        (None: whether a live render holds the folder's lock, for `bcg sheet`)."""
        self._last = time.monotonic()
        self._check_index()
        page = self._page(failures, held(self.out_dir) if running is None else running)
        if page != self._written:
            atomic_write(self.path, page.encode("utf-8"))
            self._written = page
        return self.path

    def shot_done(self, failures: list[dict] | None = None) -> None:
        """For a render: after each shot completes. Rebuilds at most every `min_interval_s` seconds
        (the render's final update() catches up), so thousands of small shots cost little."""
        if time.monotonic() - self._last >= self.min_interval_s:
            self.update(failures, running=True)

    # -------------------------------------------------------- gathering

    def _check_index(self) -> None:
        if self._written is not None:
            return
        if self.path.is_dir():
            raise BadInput(f"{self.path}: is a folder; the contact sheet cannot be written there")
        refuse_foreign(self.path, "so the contact sheet can be written")

    def _chunk(self, rel: str, st: os.stat_result) -> dict | None:
        cached = self._meta.get(rel)
        if cached and cached[0] == st.st_mtime_ns and cached[1] == st.st_size:
            return cached[2]
        meta = read_chunk(self.out_dir / rel)
        self._meta[rel] = (st.st_mtime_ns, st.st_size, meta)
        return meta

    def _thumb(self, c: Candidate) -> None:
        cached = self._thumbs.get(c.path)
        rel = thumb_name(c.shot, c.path)
        if not cached or cached[0] != c.mtime_ns:
            size = make_thumb(self.out_dir / c.path, self.out_dir / rel, c.mtime_ns)
            self._thumbs[c.path] = cached = (c.mtime_ns, size)
        c.thumb, c.thumb_size = rel, cached[1]

    def _guide_thumb(self, shot: str, src: Path, name: str) -> tuple[str | None, tuple[int, int], str]:
        """(the thumbnail `<shot>/thumbs/<name>`, its size, "") of one of a shot's guides (a reference, a control
        image), wherever the image lives; (None, (0, 0), why not) where it is missing or unreadable."""
        try:
            mtime = src.stat().st_mtime_ns
        except OSError:
            return None, (0, 0), f"not found: {src}"
        rel = thumb_name(shot, name)
        key = f"input:{rel}:{src}"
        cached = self._thumbs.get(key)
        if not cached or cached[0] != mtime:
            try:
                size = make_thumb(src, self.out_dir / rel, mtime)
            except (OSError, ValueError) as e:
                return None, (0, 0), f"unreadable: {src.name} ({e.__class__.__name__})"
            self._thumbs[key] = cached = (mtime, size)
        return rel, cached[1], ""

    def _guide_thumbs(self, row: ShotRow) -> None:
        for g in row.guides:
            g.thumb, g.thumb_size, g.note = self._guide_thumb(row.id, g.image, g.thumb_file)

    def _gather(self, report: dict | None, job: Job | None, failures: list[dict] | None,
                running: bool) -> list[ShotRow]:
        if failures is None:
            failures = [f for f in (report or {}).get("failures", []) if isinstance(f, dict)]
        failed = {f["path"]: str(f.get("reason", "")) for f in failures if isinstance(f.get("path"), str)}
        expected: dict[str, str] = {}  # path -> fingerprint the job wants there
        settings: dict[str, dict] = {}
        guides: dict[str, list[Guide]] = {}
        if job:
            for item in work_items(job):
                fp = item.fingerprint(job.model)
                expected.update((p, fp) for p in item.outputs)
            for shot in job.shots:
                settings.setdefault(shot.id, _settings_of_shot(shot))
                guides.setdefault(shot.id, shot_guides(shot))
        job_dir = Path(str(report["job"])).parent if report and report.get("job") else None
        rows = []
        for shot_id in shot_order(self.out_dir, [s.id for s in job.shots] if job else ()):
            cands: dict[str, Candidate] = {}
            for rel, k, seed, st in candidate_files(self.out_dir, shot_id):
                meta = self._chunk(rel, st)
                if meta is not None and meta.get("shot") != shot_id:
                    continue  # an image bcg wrote for another shot
                c = Candidate(rel, shot_id, k, seed, st.st_mtime_ns, meta or {})
                if meta is None:  # painted over in another tool, which dropped bcg's chunk: the artist's frame
                    c.state, c.reason = "edited", EDITED
                elif rel in expected and meta.get("fingerprint") != expected[rel]:
                    c.state, c.reason = "stale", "settings changed since; bcg render redoes it"
                try:
                    self._thumb(c)
                except (OSError, ValueError):
                    continue  # not an image PIL reads: nothing to show
                cands[rel] = c
            for rel, source, tag, j, seed, st in refinement_files(self.out_dir, shot_id):
                meta = self._chunk(rel, st)
                if meta is None or meta.get("shot") != shot_id:
                    continue  # refinements are bcg's own files: one without its chunk is not shown
                c = Candidate(rel, shot_id, j, seed, st.st_mtime_ns, meta, source=source, tag=tag)
                if rel in expected and meta.get("fingerprint") != expected[rel]:
                    c.state, c.reason = "stale", "settings changed since; bcg refine redoes it"
                try:
                    self._thumb(c)
                except (OSError, ValueError):
                    continue
                cands[rel] = c
            for rel in [p for p in expected if p.startswith(f"{shot_id}/")] + list(failed):
                parsed = parse_output_name(rel)
                if rel in cands or not parsed or parsed[0] != shot_id:
                    continue
                if rel in failed:
                    cands[rel] = Candidate(rel, shot_id, parsed[1], parsed[2], state="failed", reason=failed[rel])
                else:
                    cands[rel] = Candidate(rel, shot_id, parsed[1], parsed[2], state="missing",
                                           reason="not rendered yet" if running else "not on disk")
            first = next((c.meta for c in sorted(cands.values(), key=lambda c: c.order) if c.meta and not c.source),
                         None)
            s = dict(settings.get(shot_id) or (_settings_of_meta(first) if first else {}))
            if first and first.get("loras"):
                s["loras"] = first["loras"]
            shown = guides[shot_id] if shot_id in guides else meta_guides(first, job_dir) if first else []
            row = ShotRow(shot_id, s, sorted(cands.values(), key=lambda c: c.order), guides=shown)
            self._guide_thumbs(row)
            rows.append(row)
        return rows

    # -------------------------------------------------------- rendering

    def _page(self, failures: list[dict] | None, running: bool) -> str:
        report = read_report(self.out_dir)
        if self.job is None and self._report_job is None:
            self._report_job = job_of_folder(self.out_dir) or False  # False: looked, none loads
        job = self.job or self._report_job or None
        rows = self._gather(report, job, failures, running)
        picks = recorded_picks(self.out_dir)
        title = job.name if job else (Path(str(report["job"])).stem if report and report.get("job")
                                      else self.out_dir.resolve().name)
        n_img = sum(1 for r in rows for c in r.candidates if c.meta is not None)
        n_bad = sum(1 for r in rows for c in r.candidates if c.state in ("failed", "missing"))
        ids = {s.id for s in job.shots} if job else None
        self.images_on_disk = sum(1 for r in rows if ids is None or r.id in ids for c in r.candidates
                                  if c.meta is not None)  # the job's, when there is one
        summary = f"{len(rows)} shots, {n_img} images on disk" + (f", {n_bad} missing or failed" if n_bad else "")
        if report:
            summary += (f"; last run: {report.get('status', '?')}, {report.get('images_rendered', 0)} rendered in "
                        f"{float(report.get('wall_s') or 0):.1f} s on {report.get('device', '?')} "
                        f"({report.get('engine', '?')})")
        parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
                 INDEX_MARK,
                 f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">',
                 '<meta name="viewport" content="width=device-width, initial-scale=1">',
                 '<link rel="icon" href="data:,">',
                 f"<title>{esc(title)}: contact sheet</title><style>{STYLE}</style></head><body>",
                 f"<header><h1>{esc(title)}</h1><span>{esc(summary)}</span>"]
        if running:
            parts.append('<span class="running">render in progress: reload to see new images</span>')
        drafts = any(c.meta.get("draft") for r in rows for c in r.candidates if c.meta)
        if drafts:
            parts.append('<span class="draft-mark">draft</span><span>draft renders (faster, lower quality): pick '
                         'here, then <code>bcg render JOB --final picks.yaml</code></span>')
        parts.append('<button id="save-picks" type="button">save picks</button>'
                     '<span id="picks-count"></span></header>')
        if report:
            parts.append('<section class="figures">' + "".join(report_svgs(report)) + "</section>")
        for i, row in enumerate(rows):
            parts.append(self._row_html(i, row, picks))
        parts.append('<section class="picks-out"><h2>picks.yaml</h2><p>"save picks" downloads this file; '
                     "or copy it from here.</p>"
                     '<textarea id="picks-yaml" readonly spellcheck="false"></textarea></section>')
        state = {"out": str(self.out_dir), "picks": picks["picks"], "reroll": picks["reroll"], "draft": drafts}
        parts.append(f'<script type="application/json" id="bcg-state">{json_island(state)}</script>')
        parts.append(f"<script>{SCRIPT}</script></body></html>\n")
        return "\n".join(parts)

    def _row_html(self, index: int, row: ShotRow, picks: dict) -> str:
        key = (repr(row), picks["picks"].get(row.id), row.id in picks["reroll"])
        cached = self._rows.get(row.id)
        if cached and cached[0] == key:
            return cached[1]
        s = row.settings
        group = f"pick-{index}"
        h = [f'<section class="shot" id="shot-{esc(row.id)}" data-shot="{esc(row.id)}"><div class="meta">',
             f"<h2>{esc(row.id)}</h2>"]
        if s.get("prompt"):
            h.append(f'<p class="prompt">{esc(s["prompt"])}</p>')
        if s.get("negative"):
            h.append(f'<p class="negative">negative: {esc(s["negative"])}</p>')
        h.append("<dl>")
        for name in ("size", "steps", "sampler", "guidance", "seed", "candidates", "levers"):
            if s.get(name) not in (None, ""):
                h.append(f"<dt>{name}</dt><dd>{esc(s[name])}</dd>")
        if s.get("loras"):
            h.append(f"<dt>LoRAs</dt><dd>{esc(_loras_text(s['loras']))}</dd>")
        h.append("</dl>")
        if row.guides:
            h.append(guides_html(row.id, row.guides))
        h.append(f'<div class="choice"><label><input type="radio" class="none" name="{group}" value="" checked> '
                 f'undecided</label><label><input type="radio" class="reroll" name="{group}" value=""> '
                 "reroll</label></div>")
        if picks["picks"].get(row.id):
            h.append(f'<p>picked: {esc(picks["picks"][row.id])}</p>')
        h.append('</div><div class="cands">')
        for c in row.candidates:
            label = f"{c.tag} c{c.k} · seed {c.seed}" if c.source else f"c{c.k} · seed {c.seed}"
            if c.meta is not None:
                w, ht = c.thumb_size
                draft = c.meta.get("draft") is True
                mark = '<span class="draft-mark" title="a draft render: bcg render --final for full quality">' \
                       'draft</span>' if draft else ""
                what = f"refinement {c.tag} {c.k} of {Path(c.source).name}" if c.source else f"candidate {c.k}"
                refine = " refine" if c.source else ""
                source = f' data-source="{esc(c.source)}" title="refines {esc(c.source)}"' if c.source else ""
                h.append(f'<figure class="cand {c.state}{refine}{" draft" if draft else ""}"{source}><div class="frame">'
                         f'<a href="{href(c.path)}" target="_blank"><img src="{href(c.thumb)}" width="{w}" '
                         f'height="{ht}" loading="lazy" alt="{esc(row.id)} {what}{" (draft)" if draft else ""}">'
                         f'{_outline(c.meta, w, ht)}</a>{boxes_svg(c.meta, w, ht)}</div><figcaption>'
                         f'<span>{esc(label)}</span>{mark}<label><input type="radio" class="pick" name="{group}" value="{esc(c.path)}"> pick'
                         "</label></figcaption>")
                if c.state in ("stale", "edited"):
                    h.append(f'<div class="stale">{esc(c.reason)}</div>')
                h.append("</figure>")
            else:
                h.append(f'<figure class="cand {c.state}"><div class="hole">'
                         f"{esc(c.state)}: {esc(c.reason)}</div><figcaption><span>{esc(label)}</span>"
                         "</figcaption></figure>")
        h.append("</div></section>")
        text = "".join(h)
        self._rows[row.id] = (key, text)
        return text


def boxes_svg(meta: dict, width: int, height: int) -> str:
    """The parts of the frame the kinds draw on a candidate (`Kind.boxes`: a region's box), each a rectangle with its
    caption, over its thumbnail ("" for none). SVG attributes, no inline style: the page's CSP allows none."""
    boxes = [b for kind in KINDS for b in kind.boxes(meta)]
    if not boxes or width <= 0 or height <= 0:
        return ""
    out = [f'<svg class="boxes" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{len(boxes)} region{"s" * (len(boxes) != 1)}">']
    for b in boxes:
        x, y, w, h = b.x * width, b.y * height, b.w * width, b.h * height
        out.append(f'<g><title>{esc(b.caption)}</title><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="{h:.1f}"></rect><text x="{x + 3:.1f}" y="{y + 13:.1f}">{esc(b.caption[:40])}</text></g>')
    return "".join(out) + "</svg>"


def write_sheet(out_dir: Path, job: Job | None = None, notes: list[str] | None = None) -> Path:
    """`bcg sheet OUT_DIR`: (re)builds `<out>/index.html` from what is on disk. Returns its path; `notes`
    gets a warning when the folder holds none of the job's images (an empty folder, another job's)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise BadInput(f"{out_dir}: no such output folder")
    writer = SheetWriter(out_dir, job)
    try:
        path = writer.update()
    except OSError as e:
        raise folder_error(out_dir, e) from None
    if notes is not None and not writer.images_on_disk:
        notes.append(f"{out_dir}: no image of {'this job' if job else 'a render'} is here" + (
            f"; is {job.path} the job that rendered this folder?" if job else "; is it a render's output folder?"))
    return path
