"""Writing the output folder: atomic writes, PNG metadata, the manifest, skip-what-exists, and the writer
thread. Its names and readers are layout.py."""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from storyboard_cli.job.file import Job

from storyboard_cli.errors import BadInput, RenderFailure
from storyboard_cli.folder.layout import (MANIFEST, REPLACED, manifest_records, parse_output_name, read_fingerprint,
                                          read_report)
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.hires import a1111_fields
from storyboard_cli.job.lora_files import a1111_lora_hashes, lora_tags
from storyboard_cli.job.plan import WorkItem, base_item, work_items
from storyboard_cli.samplers import SAMPLERS


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Write to a temp name in the same folder, fsync, rename: a reader sees all or nothing. `durable=False` leaves
    out the fsyncs (a file whose durable record is written elsewhere, after it: the served job's, whose queue row
    commits with synchronous=FULL); a full disk still fails the write, and the file is still all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # the thread in the name too: two threads may write one file at once (a thumbnail, by the encoder that wrote its
    # PNG and by the sheet's update); each renames its own whole temp file, and neither fails
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def owner(item: WorkItem, path: str) -> WorkItem:
    """The item as output `path` asks for it: a deduplicated image is one item for several shots, but
    each file's metadata and manifest line name its own shot and candidate."""
    parsed = parse_output_name(path)
    if parsed is None:
        return replace(item, outputs=(path,))
    return replace(item, shot=parsed[0], k=parsed[1], outputs=(path,))


def parameters_text(item: WorkItem, settings: dict, model: str) -> str:
    """The A1111-style `parameters` chunk that image tools read (LoRAs as A1111 writes them)."""
    loras = settings.get("loras") or []
    prompt = item.prompt
    if loras:
        prompt = f"{prompt} {lora_tags({l['name']: l['scale'] for l in loras})}".strip()
    lines = [prompt]
    if item.negative:
        lines.append(f"Negative prompt: {item.negative}")
    units = control_units(settings)
    fields = [f"Steps: {item.steps}", f"Sampler: {SAMPLERS[item.sampler].label}", f"CFG scale: {item.guidance:g}",
              f"Seed: {item.seed}", f"Size: {item.width}x{item.height}", f"Model: {model}", *units]
    if not units:  # an image's one unit as its kind's plain field (the `controlnet:` shorthand's `ControlNet:`)
        fields += [plain for kind in KINDS if (plain := kind.plain(settings))]
    fields += [field for kind in KINDS for field in kind.a1111(settings)]  # `Denoising strength`, an inpainting's
    if loras:
        # quoted as A1111's infotext_utils.quote: the value holds ':' and ','
        fields.append(f"Lora hashes: {json.dumps(a1111_lora_hashes({l['name']: l['shorthash'] for l in loras}))}")
    if item.cfg_cutoff < 1:
        fields.append(f"CFG cutoff: {item.cfg_cutoff:g}")
    if item.deepcache:
        fields.append(f"DeepCache: interval {item.deepcache.interval} branch {item.deepcache.branch}")
    if item.draft:
        fields.append("Draft: true")
    if "hires" in settings:
        fields += [f"{name}: {value:g}" if isinstance(value, float) else f"{name}: {value}"
                   for name, value in a1111_fields(settings["hires"])
                   if not any(f.startswith(f"{name}:") for f in fields)]  # a refinement's own strength stays first
    lines.append(", ".join(fields))
    return "\n".join(lines)


def control_units(settings: dict) -> list[str]:
    """An image's conditioning as sd-webui-controlnet writes its units (`ControlNet 0: "Module: none, Model: ...,
    Weight: ..., Guidance Start: 0, Guidance End: ..."`: only fields its parser knows, so A1111 and Forge paste them
    back): each kind's units (`Kind.units`: the nets in the job's order, then one IP-Adapter unit per reference).
    [] where an image's only unit has a plain field of its own (`Kind.plain`: the `controlnet:` shorthand's one net
    stays the `ControlNet:` field it always was)."""
    units = [unit for kind in KINDS for unit in kind.units(settings)]
    if len(units) == 1 and any(kind.plain(settings) for kind in KINDS):
        return []
    # a unit's values hold no ',' or ':' (its parser splits on them): a model is named by its file or folder
    return [f"ControlNet {i}: " + json.dumps(f"Module: {module}, Model: {re.sub('[,:]', '_', Path(str(spec)).name)}, "
                                             f"Weight: {scale:g}, Guidance Start: 0, Guidance End: {end:g}")
            for i, (module, spec, scale, end) in enumerate(units)]


def png_text(item: WorkItem, model: str) -> dict[str, str]:
    """The text chunks of an output PNG, keyword -> text, in the order they are written."""
    settings = item.settings(model)
    meta = {"fingerprint": item.fingerprint(model), **settings, "shot": item.shot, "candidate": item.k}
    return {"parameters": parameters_text(item.recorded, settings, model), "bcg": json.dumps(meta, sort_keys=True)}


def _png_info(text: dict[str, str]):
    """The PngInfo PIL writes `text` from: tEXt where the text is latin-1, iTXt otherwise."""
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    return info


def png_bytes(pixels, item: WorkItem, model: str) -> bytes:
    """pixels: uint8 [H, W, 3] (numpy or torch on CPU); `item` as `owner` gives it for one output."""
    from PIL import Image

    array = pixels.numpy() if hasattr(pixels, "numpy") else pixels
    image = Image.fromarray(array, "RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=_png_info(png_text(item, model)), compress_level=4)
    return buf.getvalue()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TEXT_CHUNKS = (b"tEXt", b"zTXt", b"iTXt")


class RetagError(RenderFailure):
    """A PNG that is not as png_bytes writes it (damaged, or another layout): its pixels must be re-encoded."""


def _chunk(cid: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC of type and data (as PIL's putchunk)."""
    return len(data).to_bytes(4, "big") + cid + data + zlib.crc32(data, zlib.crc32(cid)).to_bytes(4, "big")


def _chunk_spans(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, start, end) of each chunk, every CRC checked (the pixel data's too: no decompression); raises
    RetagError for a bad signature, a bad CRC, a file cut short or bytes after IEND."""
    if data[:8] != PNG_SIGNATURE:
        raise RetagError("not a PNG (no PNG signature)")
    view, spans, pos = memoryview(data), [], 8
    while not spans or spans[-1][0] != b"IEND":
        if pos + 12 > len(data):
            raise RetagError(f"PNG cut short at byte {pos} (no IEND)")
        end = pos + 12 + int.from_bytes(view[pos:pos + 4], "big")
        if end > len(data):
            raise RetagError(f"PNG cut short in a chunk at byte {pos}")
        cid = bytes(view[pos + 4:pos + 8])
        if zlib.crc32(view[pos + 4:end - 4]) != int.from_bytes(view[end - 4:end], "big"):
            raise RetagError(f"bad CRC in the {cid!r} chunk at byte {pos}")
        spans.append((cid, pos, end))
        pos = end
    if pos != len(data):
        raise RetagError(f"{len(data) - pos} bytes after IEND")
    return spans


def retag_png(data: bytes, item: WorkItem, model: str) -> bytes:
    """A PNG that png_bytes wrote (a deduplicated twin's), carrying `item`'s text chunks instead of its own: the
    same bytes png_bytes(its pixels, item, ...) gives, without decoding or re-encoding the pixels (IHDR, IDAT
    and IEND are copied as they are). Raises RetagError where the input is damaged or laid out otherwise
    (other chunks than IHDR, text, IDAT, IEND; not 8-bit RGB at the item's size); the caller then re-encodes."""
    from PIL import Image

    spans = _chunk_spans(data)
    kinds = [cid for cid, _, _ in spans]
    first_idat = kinds.index(b"IDAT") if b"IDAT" in kinds else -1
    odd = [k for k in kinds[1:first_idat] if k not in TEXT_CHUNKS] + [k for k in kinds[first_idat:-1] if k != b"IDAT"]
    if kinds[0] != b"IHDR" or first_idat < 0 or odd:
        raise RetagError(f"PNG chunks {b' '.join(kinds[:12]).decode('latin-1')}: not as bcg writes them")
    ihdr = data[spans[0][1] + 8:spans[0][2] - 4]
    want = item.width.to_bytes(4, "big") + item.height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    if ihdr != want:
        size = f"{int.from_bytes(ihdr[:4], 'big')}x{int.from_bytes(ihdr[4:8], 'big')}" if len(ihdr) == 13 else "?"
        raise RetagError(f"PNG header {size} {ihdr[8:].hex()}: not the {item.width}x{item.height} 8-bit RGB of "
                         f"{item.outputs[0]}")
    text = png_text(item, model)
    chunks = [_chunk(cid, body) for cid, body, *_ in _png_info(text).chunks]
    out = b"".join([PNG_SIGNATURE, data[spans[0][1]:spans[0][2]], *chunks, data[spans[first_idat][1]:]])
    # read back as every reader will: the text chunks (CRC-checked by PIL) without decoding the pixels
    with Image.open(io.BytesIO(out)) as im:
        if im.mode != "RGB" or im.size != (item.width, item.height) or dict(im.info) != text:
            raise RetagError(f"retagged PNG for {item.outputs[0]} does not read back as written")
    return out


def sha256_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def manifest_record(item: WorkItem, path: str, fingerprint: str, sha256: str | None = None,
                    run: str | None = None, settings: dict | None = None) -> dict:
    """The one manifest line format. A file bcg wrote carries its `sha256` (a file whose bytes differ
    was edited by someone else) and the time it landed; `settings` (the item's) adds its LoRAs and references."""
    it = owner(item, path)
    record = {"path": path, "shot": it.shot, "candidate": it.k, "seed": it.seed, "fingerprint": fingerprint}
    for key in ("loras", *(key for kind in KINDS for key in kind.manifest_keys)):
        if (settings or {}).get(key):
            record[key] = settings[key]
    for lever in ("cfg_cutoff", "deepcache", "draft", "hires", "refine"):  # draft renders: what made the image cheaper
        if lever in (settings or {}):
            record[lever] = settings[lever]
    if sha256 is not None:
        record |= {"sha256": sha256, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if run is not None:
        record["run"] = run
    return record


class Manifest:
    """manifest.jsonl: one line per image bcg wrote, appended and fsynced as each image lands. Rewritten whole
    (atomically, never truncated first) at the start and the end of a render, to one line per file still on disk,
    whatever job wrote it, and whenever an image replaces one it has a line for (a re-render, --force): the file
    holds one line per image at every moment, so a run killed at any point leaves no second line for a path. A
    later line for a path replaces an earlier one (what an older version's killed run could leave)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.path = folder / MANIFEST
        self.records: dict[str, dict] = {r["path"]: r for r in manifest_records(folder)}

    def reconcile(self, found: dict[str, dict]) -> list[str]:
        """Keeps the lines whose file is still on disk (other jobs', other shots'), adds `found` (images
        verified done) that it had no line for: a crash between an image's rename and its line. Returns those
        added."""
        kept = {p: r for p, r in self.records.items() if (self.folder / p).is_file()}
        added = [p for p in found if p not in kept]
        self.records = kept | {p: found[p] for p in added}
        self.compact()
        return added

    def compact(self) -> None:
        atomic_write(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records.values()).encode())

    def append(self, record: dict) -> None:
        replaced = record["path"] in self.records
        self.records[record["path"]] = record
        if replaced:
            self.compact()
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def remove_stale_temps(folder: Path) -> int:
    """Deletes temp files left by a killed writer (`.<name>.<thread>.<pid>.tmp` whose pid is gone)."""
    removed = 0
    for tmp in folder.glob("**/.*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[-2])
        except (ValueError, IndexError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def select_shots(job: Job, patterns: tuple[str, ...]) -> set[str] | None:
    """`--shot` patterns (ids or globs) -> the shot ids they name; None when there are none."""
    if not patterns:
        return None
    ids = [s.id for s in job.shots]
    chosen = set()
    for pattern in patterns:
        hits = fnmatch.filter(ids, pattern)
        if not hits:
            raise BadInput(f"--shot {pattern}: no shot of {job.path} matches (shots: {', '.join(ids[:12])}"
                           f"{', ...' if len(ids) > 12 else ''})")
        chosen.update(hits)
    return chosen


@dataclass
class Pending:
    """What a render finds in its folder before it starts."""

    items: list[WorkItem] = field(default_factory=list)  # to render, with only the outputs still to write
    skipped: int = 0  # outputs already done (a PNG with the same fingerprint)
    found: dict[str, dict] = field(default_factory=dict)  # manifest records of the done outputs
    kept: list[str] = field(default_factory=list)  # edited by someone else: left alone (no --force)
    moved: set[str] = field(default_factory=set)  # edited and --force: set aside, then rendered again

    @property
    def outputs(self) -> int:
        return sum(len(i.outputs) for i in self.items)

    def edited_notes(self, aside: Path) -> list[str]:
        """What the run says, once, about the edited files (`aside`: where --force moves them)."""
        kept, moved = len(self.kept), len(self.moved)
        notes = []
        if kept:
            notes.append(f"kept {kept} edited image{'s' * (kept != 1)}; --force re-renders them, moving the edited "
                         f"files to {aside}/")
        if moved:
            notes.append(f"{moved} edited image{'s' * (moved != 1)} rendered again; the edited files are moved to "
                         f"{aside}/")
        return notes


def _written_by_us(path: Path, record: dict | None, fingerprint: str | None) -> bool:
    """True when the file is as bcg wrote it: its bytes hash to the manifest's sha256 (a manifest from
    before hashes were recorded: its bcg chunk still holds the recorded fingerprint)."""
    if record is None:
        return False
    if "sha256" in record:
        return sha256_of(path) == record["sha256"]
    return fingerprint is not None and fingerprint == record.get("fingerprint")


def pending_items(job: Job, out_dir: Path, force: bool, only: set[str] | None = None,
                  shots: set[str] | None = None, records: dict[str, dict] | None = None) -> Pending:
    """Sorts every output of the job: done (skipped), to render, or edited by someone else (kept, or with
    `force` set aside and rendered again). `only` limits the render to those paths, `shots` to those
    shots; `records` is the manifest's (path -> record)."""
    records = records or {}
    p = Pending()
    for item in work_items(job):
        fp = item.fingerprint(job.model)
        todo = []
        for path in item.outputs:
            chosen = shots is None or owner(item, path).shot in shots  # --shot: the others are not this run's
            wanted = (only is None or path in only) and chosen
            file, record = out_dir / path, records.get(path)
            if not file.exists():
                if wanted:
                    todo.append(path)
                continue
            on_disk = read_fingerprint(file)
            if on_disk == fp and not (force and wanted):
                p.skipped += chosen
                # no line for it: a crash between its rename and its line (the bcg chunk is intact)
                p.found[path] = record or manifest_record(item, path, fp, sha256_of(file),
                                                          settings=item.settings(job.model))
            elif not wanted:
                continue
            elif _written_by_us(file, record, on_disk):  # hashed only here: a done file is not read twice
                todo.append(path)
            elif force:
                p.moved.add(path)
                todo.append(path)
            else:
                p.kept.append(path)
        if todo:
            p.items.append(replace(item, outputs=tuple(todo)))
    p.items = with_bases(p.items, out_dir, job.model, force)
    return p


def with_bases(items: list[WorkItem], out_dir: Path, model: str, force: bool = False) -> list[WorkItem]:
    """The items, after the first passes their hires passes still need: a base that is not on disk as the
    item asks for it (job/plan.py `base_item`), or every one with `force`, is rendered first."""
    bases = [b for b in (base_item(i) for i in items if i.hires is not None)
             if force or read_fingerprint(out_dir / b.outputs[0]) != b.fingerprint(model)]
    return bases + items


def set_aside(out_dir: Path, path: str, stamp: str) -> Path:
    """Keeps an edited file at `<out>/.replaced/<stamp>/<path>` before its new rendering replaces it (never deleted):
    a hard link (a copy where the file system has none), so the file stays at its path until the new one's atomic
    rename, and a render killed in between leaves no manifest line without its file."""
    src, dst = out_dir / path, out_dir / REPLACED / stamp / path
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except FileExistsError:
        pass  # kept already
    except OSError:  # no hard links here (some network and FUSE file systems)
        shutil.copy2(src, dst)
    _fsync_dir(dst.parent)
    return dst


def previous_failures(out_dir: Path) -> set[str]:
    """The image paths the last report lists as failed (none when there is no readable report)."""
    try:
        return {f["path"] for f in (read_report(out_dir) or {}).get("failures", [])}
    except (TypeError, KeyError):
        return set()


class Writer:
    """One background thread that writes PNGs in order; errors surface on the next submit or at close."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcg-writer")
        self.futures: list = []

    def submit(self, fn, *args) -> None:
        self._reap()
        if len(self.futures) > 16:  # bound the pixels held in memory
            self.futures[0].result()
        self.futures.append(self.pool.submit(fn, *args))

    def _reap(self) -> None:
        while self.futures and self.futures[0].done():
            self.futures.pop(0).result()

    def drain(self) -> None:
        """Waits for everything submitted (a hires pass reads the files its first pass wrote)."""
        while self.futures:
            self.futures.pop(0).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for f in self.futures:
            f.result()
        self.futures = []
