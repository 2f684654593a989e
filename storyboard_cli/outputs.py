"""File naming, atomic writes, PNG metadata, the manifest, the output-folder lock, skip-what-exists,
and the writer thread."""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from storyboard_cli.job import Job

from storyboard_cli.errors import BadInput, OutputLocked
from storyboard_cli.plan import WorkItem, work_items
from storyboard_cli.samplers import SAMPLERS

MANIFEST = "manifest.jsonl"
LOCK = ".bcg.lock"


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


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temp name in the same folder, fsync, rename: a reader sees all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def parameters_text(item: WorkItem, model: str) -> str:
    """The A1111-style `parameters` chunk that image tools read."""
    lines = [item.prompt]
    if item.negative:
        lines.append(f"Negative prompt: {item.negative}")
    fields = [f"Steps: {item.steps}", f"Sampler: {SAMPLERS[item.sampler].label}", f"CFG scale: {item.guidance:g}",
              f"Seed: {item.seed}", f"Size: {item.width}x{item.height}", f"Model: {model}"]
    if item.control_image is not None:
        fields.append(f"ControlNet: {item.control_image.name} (scale {item.control_scale:g})")
    lines.append(", ".join(fields))
    return "\n".join(lines)


def png_bytes(pixels, item: WorkItem, model: str, controlnet: str | None) -> bytes:
    """pixels: uint8 [H, W, 3] (numpy or torch on CPU)."""
    from PIL import Image, PngImagePlugin

    array = pixels.numpy() if hasattr(pixels, "numpy") else pixels
    image = Image.fromarray(array, "RGB")
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", parameters_text(item, model))
    meta = {"fingerprint": item.fingerprint(model, controlnet), **item.settings(model, controlnet),
            "shot": item.shot, "candidate": item.k}
    info.add_text("bcg", json.dumps(meta, sort_keys=True))
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info, compress_level=4)
    return buf.getvalue()


def read_fingerprint(path: Path) -> str | None:
    """The fingerprint in a finished PNG, or None if the file is missing, foreign or broken."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            meta = json.loads(im.info.get("bcg", "null") or "null")  # chunks before the pixels; .text would decode
            im.verify()  # a truncated file fails here
    except Exception:  # noqa: BLE001 - any unreadable file is simply "not done"
        return None
    return meta.get("fingerprint") if isinstance(meta, dict) else None


def manifest_record(item: WorkItem, path: str, fingerprint: str, finished: bool = False) -> dict:
    """The one manifest line format; `finished` stamps the time the file landed."""
    record = {"path": path, "shot": item.shot, "candidate": item.k, "seed": item.seed, "fingerprint": fingerprint}
    if finished:
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return record


class Manifest:
    """manifest.jsonl: one line per finished image, appended and fsynced as each image lands.

    On open it is rewritten (atomically) to the lines whose files still exist, one per path, so it
    agrees with the disk even after a crash between an image's rename and its manifest line.
    """

    def __init__(self, folder: Path):
        self.path = folder / MANIFEST
        self.records: dict[str, dict] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if isinstance(rec, dict) and isinstance(rec.get("path"), str):
                    self.records[rec["path"]] = rec

    def reconcile(self, found: dict[str, dict]) -> None:
        """Rewrites the manifest to exactly the images verified done on disk (`found`), keeping their
        earlier records where it has them: it then agrees with the disk even after a crash between an
        image's rename and its manifest line, and a re-rendered image never appears twice."""
        self.records = {p: self.records.get(p, r) for p, r in found.items()}
        atomic_write(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records.values()).encode())

    def append(self, record: dict) -> None:
        self.records[record["path"]] = record
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def remove_stale_temps(folder: Path) -> int:
    """Deletes temp files left by a killed writer (`.<name>.<pid>.tmp` whose pid is gone)."""
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


class OutputLock:
    """One render per output folder. A lock left by a dead process is taken over."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK
        self.held = False

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    pid = None
                if pid is not None and pid != os.getpid() and _pid_alive(pid):
                    raise OutputLocked(f"{self.path.parent}: another render (pid {pid}) is writing here; "
                                       f"wait for it or remove {self.path} if that process is gone") from None
                if pid is None and time.time() - self._mtime() < 5:
                    time.sleep(0.2)  # its owner is writing its pid right now
                    continue
                self.path.unlink(missing_ok=True)  # stale: its process is dead
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            return self
        raise OutputLocked(f"{self.path.parent}: could not take the lock {self.path}")

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def check_output_dir(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"output_dir: {folder} exists and is not a folder")


def pending_items(job: Job, out_dir: Path, force: bool, only: set[str] | None
                  ) -> tuple[list[WorkItem], int, dict[str, dict]]:
    """Items that still need rendering (only the paths in `only`, when given), how many outputs are
    already done (a PNG with the same fingerprint), and manifest records for those."""
    pending, skipped, found = [], 0, {}
    for item in work_items(job):
        fp = item.fingerprint(job.model, job.controlnet)
        todo = []
        for path in item.outputs:
            if not force and read_fingerprint(out_dir / path) == fp:
                skipped += 1
                found[path] = manifest_record(item, path, fp)
            elif only is None or path in only:
                todo.append(path)
        if todo:
            pending.append(replace(item, outputs=tuple(todo)))
    return pending, skipped, found


def previous_failures(out_dir: Path) -> set[str]:
    """The image paths the last report lists as failed (none when there is no readable report)."""
    try:
        report = json.loads((out_dir / "report.json").read_text())
        return {f["path"] for f in report.get("failures", [])}
    except (OSError, ValueError, TypeError, KeyError):
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

    def close(self, cancel: bool = False) -> None:
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        for f in self.futures:
            if not f.cancelled():
                f.result()
        self.futures = []
