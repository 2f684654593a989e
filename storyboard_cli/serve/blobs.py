"""Input files as content-addressed blobs: the control images and LoRA files a job names, stored once under
`<root>/blobs/` by their sha256, read-only, whatever the number of jobs that use them. Torch-free.

A client uploads what the server lacks (`POST /v1/blobs/missing`, then `PUT /v1/blobs/{sha256}` per file,
the digest checked while the bytes arrive); a file the job names by a path under the server's folders is
copied in at submission, after its one confinement check. From then on every reader (the server's contact
sheet, the workers) opens a blob by its digest, never a path a client chose: a file swapped after submission
reaches nothing. A worker without the server's filesystem downloads a blob once (`GET /v1/blobs/{sha256}`)
into its own BlobStore.

The server's store is bounded (`max_bytes`, --max-blobs-gb: BlobStoreFull past it), and a blob no job names is
removed `grace_s` after it was last stored or used (`collect`; asking whether the server has it, or a job naming
it, counts as a use, so a client between its upload and its submission keeps it). A server killed mid-upload
leaves a temporary file that its next start removes (`clear_tmp`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable

from storyboard_cli.errors import BadInput
from storyboard_cli.job.inputs import DIGEST_RULE, is_digest

BLOBS = "blobs"
TMP = "tmp"
CHUNK = 1 << 20


class BlobTooLarge(BadInput):
    """More bytes than the server's --max-blob-mb."""


class DigestMismatch(BadInput):
    """The bytes do not hash to the digest they were sent as."""


class BlobStoreFull(Exception):
    """The stored blobs would pass the server's --max-blobs-gb: a 507."""


class BlobStore:
    """`<root>/blobs/<2 hex>/<sha256>`: each written once (temporary file, fsync, rename), mode 0444. `max_bytes`: the
    most all of them may hold (None: no bound)."""

    def __init__(self, root: Path, max_bytes: int | None = None):
        self.dir = Path(root) / BLOBS
        self.max_bytes = max_bytes
        self._total: int | None = None  # bytes stored, counted on first need, then kept up to date
        self.collected = 0  # blobs removed by `collect` since the store was opened
        self._lock = threading.Lock()

    def _file(self, digest: str) -> Path:
        if not is_digest(digest):
            raise BadInput(f"not {DIGEST_RULE}: {digest[:80]!r}")
        return self.dir / digest[:2] / digest

    def has(self, digest: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._file(digest)).st_mode)
        except OSError:
            return False

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The digests the store lacks; those it has count as used now (a client relies on them)."""
        lacking = []
        for d in dict.fromkeys(digests):
            if self.has(d):
                self.touch(d)
            else:
                lacking.append(d)
        return lacking

    def touch(self, digest: str) -> None:
        """The blob counts as used now: `collect` keeps it for its grace period from here."""
        try:
            os.utime(self._file(digest))
        except OSError:  # gone meanwhile, or a filesystem that refuses: the upload time counts
            pass

    def size(self, digest: str) -> int | None:
        try:
            st = os.lstat(self._file(digest))
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def path(self, digest: str, suffix: str = "") -> Path:
        """The file holding the blob, named with `suffix` (a hard link to the blob made once: readers that
        check a file's type by its name, as the LoRA reader does, see the job's). Raises BadInput when the
        store lacks it."""
        blob = self._file(digest)
        if not self.has(digest):
            raise BadInput(f"input sha256 {digest[:12]}... has not been uploaded")
        self.touch(digest)
        if not suffix:
            return blob
        named = blob.with_name(digest + suffix)
        if not named.exists():
            try:
                os.link(blob, named)
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links: a read-only copy
                self._write(named, [blob.read_bytes()], None, None)
        return named

    def writer(self, digest: str, limit: int | None) -> BlobWriter:
        """A writer for the blob `digest` (at most `limit` bytes): feed it chunks, then `close()`; the blob lands
        only if the bytes hash to the digest."""
        self._file(digest)
        return BlobWriter(self, digest, limit)

    def put(self, data: bytes) -> str:
        """Stores bytes already in memory; their digest."""
        digest = hashlib.sha256(data).hexdigest()
        if not self.has(digest):
            self._write(self._file(digest), [data], digest, None)
        return digest

    def adopt(self, source: Path, limit: int | None = None) -> str:
        """Copies a file of the server's folders into the store (the path was confined by the caller; the
        file is opened once, without following a last-component symlink, and hashed as it is copied); its
        digest."""
        try:
            fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise BadInput(f"cannot read: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            return self._write(None, iter(lambda: f.read(CHUNK), b""), None, limit)

    def used(self) -> int:
        """Bytes the stored blobs hold (each once, whatever its named links)."""
        with self._lock:
            if self._total is None:
                self._total = sum(size for _, size, _ in self._blobs())
            return self._total

    def _added(self, n: int) -> None:
        with self._lock:
            if self._total is not None:
                self._total += n

    def room_for(self, n: int) -> None:
        """Raises BlobStoreFull when `n` more bytes would pass max_bytes."""
        if self.max_bytes is not None and self.used() + n > self.max_bytes:
            raise BlobStoreFull(f"the server's store of input files is full ({self.used() / (1 << 20):.1f} MB of "
                                f"{self.max_bytes / (1 << 30):g} GB, --max-blobs-gb): unused ones are removed after "
                                "--blob-grace-s; retry later or ask its operator")

    def _blobs(self) -> Iterable[tuple[str, int, float]]:
        """(digest, size, last stored or used) of each stored blob."""
        try:
            shards = [d for d in os.scandir(self.dir) if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for shard in shards:
            for entry in os.scandir(shard.path):
                if is_digest(entry.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    yield entry.name, st.st_size, st.st_mtime

    def collect(self, named: set[str], grace_s: float, now: float | None = None) -> tuple[int, int]:
        """Removes every blob that no digest in `named` (the jobs the server keeps) names and that was not stored
        or used in the last `grace_s` seconds, with its named links. Returns (blobs, bytes) removed."""
        now = time.time() if now is None else now
        drop = [(d, size) for d, size, used in self._blobs() if d not in named and now - used >= grace_s]
        gone = set(self._remove(drop))
        return len(gone), sum(size for d, size in drop if d in gone)

    def trim(self, max_bytes: int, keep: set[str], grace_s: float = 0.0,
             now: float | None = None) -> tuple[list[str], int]:
        """Removes the least recently stored or used blobs that `keep` does not name, and that were not stored or
        used in the last `grace_s` seconds, until the store holds at most `max_bytes` (a worker's copies of the
        server's blobs: a cache, which other workers on the same folder may be reading). Returns (the digests, the
        bytes) removed."""
        now = time.time() if now is None else now
        over = self.used() - max_bytes
        if over <= 0:
            return [], 0
        drop = []
        for digest, size, used in sorted(self._blobs(), key=lambda b: b[2]):
            if over <= 0 or now - used < grace_s:
                break
            if digest not in keep:
                drop.append((digest, size))
                over -= size
        gone = self._remove(drop)
        return gone, sum(size for digest, size in drop if digest in gone)

    def _remove(self, blobs: list[tuple[str, int]]) -> list[str]:
        """Removes each (digest, size) with its named links; the digests removed."""
        removed, freed = [], 0
        for digest, size in blobs:
            blob = self._file(digest)
            for link in blob.parent.glob(digest + ".*"):  # the named links (path(digest, suffix))
                link.unlink(missing_ok=True)
            try:
                blob.unlink()
            except FileNotFoundError:
                continue
            removed.append(digest)
            freed += size
        self._added(-freed)
        self.collected += len(removed)
        return removed

    def clear_tmp(self) -> int:
        """Removes the temporary files of uploads cut short (a server killed mid-upload); how many. Only at start:
        a running server's uploads write there."""
        n = 0
        for f in (self.dir / TMP).glob("*"):
            f.unlink(missing_ok=True)
            n += 1
        return n

    def _write(self, target: Path | None, chunks: Iterable[bytes], digest: str | None, limit: int | None) -> str:
        w = BlobWriter(self, digest, limit, target)
        try:
            for chunk in chunks:
                w.write(chunk)
        except BaseException:  # a full disk, a read error: no temporary file left
            w.abort()
            raise
        return w.close()


class BlobWriter:
    """Streams one blob into a temporary file of the store, hashing as it goes; `close()` checks the digest (when
    one was announced), makes the file read-only and renames it into place. `abort()` leaves nothing."""

    def __init__(self, store: BlobStore, digest: str | None, limit: int | None, target: Path | None = None):
        self.store, self.digest, self.limit, self.target = store, digest, limit, target
        tmp = store.dir / TMP
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp / uuid.uuid4().hex
        self.f = open(self.tmp, "wb")
        self.hash, self.n = hashlib.sha256(), 0

    def write(self, chunk: bytes) -> None:
        self.n += len(chunk)
        if self.limit is not None and self.n > self.limit:
            self.abort()
            raise BlobTooLarge(f"larger than this server's limit of {self.limit // (1 << 20)} MB (--max-blob-mb)")
        try:
            self.store.room_for(self.n)
        except BlobStoreFull:
            self.abort()
            raise
        self.hash.update(chunk)
        self.f.write(chunk)

    def close(self) -> str:
        got = self.hash.hexdigest()
        if self.digest is not None and got != self.digest:
            self.abort()
            raise DigestMismatch(f"the {self.n} bytes sent hash to {got}, not {self.digest}")
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.chmod(self.tmp, 0o444)
            target = self.target or self.store._file(got)
            target.parent.mkdir(parents=True, exist_ok=True)
            new = is_digest(target.name) and not target.exists()  # a named copy adds no blob
            os.replace(self.tmp, target)  # the same bytes: a concurrent upload of the blob lands the same file
        except BaseException:  # a full disk: no temporary file left
            self.abort()
            raise
        if new:
            self.store._added(self.n)
        return got

    def abort(self) -> None:
        try:
            self.f.close()  # flushes what is buffered: on a full disk, that fails too
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)
