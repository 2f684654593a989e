"""Where a render's images go: PNG + manifest line per output file on the writer thread, failures, the
edited files --force sets aside, and the contact sheet after each shot completes. No torch, no policy.

The PNGs are encoded and written (fsync included) on a small pool of threads (zlib releases the GIL: a 1024x1024
PNG takes about 0.1 s of one core), each followed by its contact-sheet thumbnail from the same pixels; their
manifest lines are recorded and announced in order on the writer thread, each once its file has landed."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from storyboard_cli.errors import write_error
from storyboard_cli.folder.outputs import (Manifest, Pending, RetagError, Writer, atomic_write, manifest_record, owner,
                                           png_bytes, retag_png, set_aside)
from storyboard_cli.folder.report import Timings
from storyboard_cli.job.file import Job
from storyboard_cli.job.plan import WorkItem

Emit = Callable[[str, int, str, str], None]  # (event kind, images done, shot, message)

log = logging.getLogger(__name__)
ENCODERS = max(1, min(8, (os.cpu_count() or 1) - 1))  # PNG threads per render; one core for the loop


class ContactSheet:
    """index.html kept up to date during a render. Never fails the render: the first error becomes a
    note and the sheet is left as it was. Call it from one thread at a time (the writer thread while
    the render runs)."""

    def __init__(self, out_dir: Path, job: Job, notes: list[str]):
        self.out_dir, self.job, self.notes = out_dir, job, notes
        self.writer = None
        self.path: Path | None = None
        self.broken = False

    def update(self, failures: list[dict], running: bool = False, final: bool = True) -> None:
        if self.broken:
            return
        try:
            if self.writer is None:
                from storyboard_cli.folder.sheet import SheetWriter

                self.writer = SheetWriter(self.out_dir, self.job)
            if final:
                self.path = self.writer.update(failures=list(failures), running=running)
            else:
                self.writer.shot_done(list(failures))
        except Exception as e:  # noqa: BLE001 - the page is a view of the folder; the images are what matters
            log.debug("contact sheet not updated", exc_info=True)  # the note says it in one line
            self.notes.append(f"contact sheet not updated: {e}")
            self.broken = True

    def thumb(self, shot: str, path: str, pixels) -> None:
        """An encoder thread, once output `path` of `shot` has landed: its thumbnail from its pixels, beside the
        render, where the sheet's next update would have read the PNG back and made it on the writer thread (after
        the last batch, with the GPU done). Never fails the render: whatever goes wrong here, the sheet's update
        meets again and says."""
        if self.broken:
            return
        from storyboard_cli.folder.layout import thumb_name
        from storyboard_cli.folder.sheet import write_thumb

        try:
            write_thumb(pixels, self.out_dir / thumb_name(shot, path))
        except Exception:  # noqa: BLE001 - the page is a view of the folder; the images are what matters
            log.debug("thumbnail of %s not written", path, exc_info=True)


class OutputSink:
    def __init__(self, job: Job, out_dir: Path, manifest: Manifest, pending: Pending, run_id: str,
                 sheet: ContactSheet, timings: Timings, emit: Emit):
        self.job, self.out_dir, self.manifest, self.sheet, self.timings = job, out_dir, manifest, sheet, timings
        self.run_id = run_id  # in each manifest line; also names the folder edited files are set aside in
        self.moved = set(pending.moved)  # edited files to set aside just before their replacement lands
        self.remaining = Counter(owner(i, p).shot for i in pending.items for p in i.outputs)
        self.emit = emit
        self.failed: list[dict] = []
        self.rendered = 0  # files landed (writer thread)
        self.delivered = 0  # outputs handed over or failed (main thread)
        self.writer = Writer()
        self.encoder = ThreadPoolExecutor(max_workers=ENCODERS, thread_name_prefix="bcg-png")

    def fail(self, items: list[WorkItem], reason: str) -> None:
        for item in items:
            for path in item.outputs:
                self.failed.append({"path": path, "shot": owner(item, path).shot, "reason": reason})
            self.delivered += len(item.outputs)
            self.emit("failed", self.rendered, item.shot, f"{item.outputs[0]}: {reason}")
            self.writer.submit(self._shots_done, item)

    def submit(self, item: WorkItem, pixels, bucket: str) -> None:
        """Hands the pixels to the encoders (each output file encoded and written on one of them) and the writer
        thread (its manifest lines, in order); they overlap the next batch's denoising."""
        self.delivered += len(item.outputs)
        landing = []
        for path in item.outputs:
            aside = path in self.moved
            self.moved.discard(path)
            landing.append(self.encoder.submit(self._land, pixels, item, path, aside))
        self.writer.submit(self._save, item, landing, bucket)

    def copy(self, item: WorkItem, png: bytes, bucket: str) -> None:
        """Like `submit`, from a PNG of the same image made for another job (a dedup twin): each output gets
        the twin's pixel data as it is, with its own metadata (no decode, no zlib)."""
        self.submit(item, _Twin(png), bucket)

    def _land(self, pixels, item: WorkItem, path: str, aside: bool) -> str:
        """An encoder thread: one output file (its own shot and candidate in the metadata) as an atomic PNG write,
        after setting aside the edited file it replaces; returns the bytes' sha256."""
        own = owner(item, path)
        data = _encoded(pixels, own, self.job.model)
        target = self.out_dir / path
        try:
            if aside:
                set_aside(self.out_dir, path, self.run_id)
            atomic_write(target, data)
        except OSError as e:
            raise write_error(target, e) from e
        if not isinstance(pixels, _Twin):  # a twin's thumbnail: the sheet's, from its PNG
            self.sheet.thumb(own.shot, path, pixels)
        return hashlib.sha256(data).hexdigest()

    def _save(self, item: WorkItem, landing: list[Future], bucket: str) -> None:
        """Runs on the writer thread: per output file, once it has landed, its manifest line (in order)."""
        t0 = time.perf_counter()
        model = self.job.model
        fingerprint, settings = item.fingerprint(model), item.settings(model)
        for path, landed in zip(item.outputs, landing):
            if landed.cancelled():  # a stop now dropped it before its encode began: no file, so no line
                continue
            sha256 = landed.result()
            try:
                self.manifest.append(manifest_record(item, path, fingerprint, sha256, self.run_id, settings))
            except OSError as e:
                raise write_error(self.manifest.path, e) from e
            self.rendered += 1
            self.timings.bucket(bucket).images += 1
            self.emit("image", self.rendered, owner(item, path).shot, path)
        self.timings.stages["save"] += time.perf_counter() - t0
        self._shots_done(item)

    def _shots_done(self, item: WorkItem) -> None:
        """Writer thread: a shot whose every output has landed or failed updates the sheet."""
        for path in item.outputs:
            shot = owner(item, path).shot
            self.remaining[shot] -= 1
            if self.remaining[shot] == 0:
                self.sheet.update(self.failed, final=False)

    def drain(self) -> None:
        """Every file handed over so far on disk, its manifest line recorded."""
        self.writer.drain()

    def close(self, cancel: bool = False) -> None:
        """Every file handed over on disk with its manifest line. `cancel` (a stop now: a second Ctrl-C, an error): the
        encodes not yet begun are dropped first, the ones running land, and then the writer records a line for each
        file that landed: none is left on disk without one (a line dropped with its file already landed would be)."""
        if cancel:
            try:
                self.encoder.shutdown(wait=True, cancel_futures=True)
            finally:
                self.writer.close()
            return
        try:
            self.writer.close()
        finally:
            self.encoder.shutdown(wait=True)


class _Twin:
    """A twin's PNG bytes, handed to the encoders in place of pixels."""

    def __init__(self, png: bytes):
        self.png = png


def _encoded(pixels, item: WorkItem, model: str) -> bytes:
    """The output file's bytes: pixels encoded, or a twin's PNG retagged with this item's metadata (decoded and
    encoded again only when it is not laid out as bcg writes its PNGs)."""
    if not isinstance(pixels, _Twin):
        return png_bytes(pixels, item, model)
    try:
        return retag_png(pixels.png, item, model)
    except RetagError:
        import io

        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(pixels.png)) as image:
            return png_bytes(np.asarray(image.convert("RGB")), item, model)
