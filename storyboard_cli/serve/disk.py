"""The server's disk: what is free under --root, the floor below which it takes no new job or input file and is
not ready (--min-free-mb), and a write refused for want of space (ENOSPC, EDQUOT, SQLite's "disk is full") or because
the job folders cannot be written (EROFS: a file system remounted read-only after an I/O error, an NFS export turned
read-only; EACCES, EPERM: their permissions changed) answered as one 507 problem. Torch-free.

A write into the job folders refused for want of space (an uploaded PNG, a completion's manifest lines, or a PNG a
worker that shares the folders could not write) means the floor's room is spent: the server then leases no batch
(`holding`) until space is freed, RESUME_MB more than it had then (the floor, where that is less; 1 MB at least). A
batch leased meanwhile would only be rendered to be thrown away, its images spending their attempts; those whose PNGs
did not land go back to the queue with theirs. An input file or a job refused for its size holds nothing: a smaller
write may still fit. A job folder that cannot be written holds the leases the same way, until the server can write
there again (`unwritable`), whatever the free space.

507 Insufficient Storage, not 503 with a Retry-After: space comes back when an operator frees it, not after a
wait a client could be told, and a client that retried would only fill the log. Whatever was half-written is
removed by the writer that failed (a job's folder, a blob's temporary file, an uploaded PNG's temporary name).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from storyboard_cli.job.preflight import unwritable
from storyboard_cli.serve.edge import Refused

log = logging.getLogger(__name__)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
INSUFFICIENT_STORAGE = 507
FULL_TITLE = "insufficient storage"
FULL = "the server's disk is full"
UNWRITABLE = "the server cannot write its job folders"
MB = 1 << 20
RESUME_MB = 64


def is_full(e: BaseException) -> bool:
    """Whether an error is a write refused for want of space (the disk or the user's quota)."""
    if isinstance(e, OSError):
        return e.errno in FULL_ERRNOS
    return isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL


def is_unwritable(e: BaseException) -> bool:
    """Whether an error is a write refused by the file system itself: read-only, or not permitted."""
    return isinstance(e, OSError) and e.errno in UNWRITABLE_ERRNOS


class Disk:
    """The filesystem under the server's root: its free bytes, the floor, and the writes refused for want of space
    since the server started (`refused`, what /metrics counts)."""

    def __init__(self, root: Path, min_free_mb: int):
        self.root, self.floor = Path(root), min_free_mb * MB
        self.refused = 0
        self._lock = threading.Lock()
        # the free bytes when a write was refused, what it was, and the job folder it could not write (None: full)
        self._spent: tuple[int, str, Path | None] | None = None

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def low(self) -> str | None:
        """Why the server takes no new job or input file now (its free bytes under the floor); None when it does."""
        free = self.free()
        if free >= self.floor:
            return None
        return (f"{FULL}: {free / MB:.1f} MB free, under the {self.floor // MB} MB it keeps for the jobs it accepted "
                "(--min-free-mb); free space on the server, or submit to another")

    def spent(self, what: str, folder: Path | None = None) -> None:
        """A write under the root was refused (`what`: which, one line): for want of space, no batch is leased until
        space is freed; by the file system (`folder`: the job folder it could not write), until the server can
        write there (`holding`). Said once, when the hold starts."""
        free = self.free()
        with self._lock:
            started, self._spent = self._spent is None, (free, what, folder)
        if started and folder is not None:
            log.warning("%s (%s: %s): no batch is leased until it can; the images not written go back to the "
                        "queue, their attempts kept", UNWRITABLE, what, unwritable(folder) or "refused")
        elif started:
            log.warning("%s (%s): no batch is leased until %.0f MB are free; the images it failed to write go back "
                        "to the queue, their attempts kept", FULL, what, (free + self._resume()) / MB)

    def _resume(self) -> int:
        return min(RESUME_MB * MB, max(self.floor, MB))

    def holding(self) -> str | None:
        """Why no batch is leased now (a write refused, and not enough space freed since, or the job folder still
        not writable); None when batches are leased. The hold ends, said once, when that passes."""
        spent = self._spent
        if spent is None:
            return None
        then, what, folder = spent
        free = self.free()
        if folder is not None:
            why = unwritable(folder)
            if why:
                return (f"{UNWRITABLE} ({why}): no batch is leased until it can: make it writable again; a write "
                        f"was refused: {what}")
        elif free < then + self._resume():
            return (f"{FULL}: no batch is leased until {(then + self._resume()) / MB:.0f} MB are free "
                    f"({free / MB:.1f} MB free now): free space on the server; a write was refused: {what}")
        with self._lock:
            ended = self._spent is spent  # else another refusal since: its own hold
            if ended:
                self._spent = None
        if not ended:
            return self.holding()
        if folder is not None:
            log.warning("batches are leased again: the server can write %s again", folder)
        else:
            log.warning("batches are leased again: %.1f MB free on the server's disk", free / MB)
        return None

    def refuse(self, why: str) -> Refused:
        """The 507 of a request refused for want of space (counted), for the route to raise."""
        with self._lock:
            self.refused += 1
        return Refused(INSUFFICIENT_STORAGE, FULL_TITLE, why)

    async def answer(self, request: Request, e: Exception) -> JSONResponse:
        """The app's handler of OSError and SQLite's errors: a write refused for want of space, or by a read-only or
        forbidding file system, is a 507 (counted, one log line); anything else is raised again, as before."""
        if is_unwritable(e):
            why = f"the server cannot write under its root ({e.strerror or e.__class__.__name__})"
            log.warning("%s %s: %s", request.method, request.url.path, why)
            return self.refuse(f"{why}: nothing of this request was kept; make it writable again, then "
                               "retry").answer()
        if not is_full(e):
            raise e
        log.warning("%s %s: %s", request.method, request.url.path, FULL)
        return self.refuse(f"{FULL}: nothing of this request was kept; free space on the server, then retry").answer()
