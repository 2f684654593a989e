"""Input files as content-addressed blobs: the control images and LoRA files a job names, stored once under
`<root>/blobs/` by their sha256, read-only, whatever the number of jobs that use them. Torch-free.

A client uploads what the server lacks (`POST /v1/blobs/missing`, then `PUT /v1/blobs/{sha256}` per file,
the digest checked while the bytes arrive); a file the job names by a path under the server's folders is
copied in at submission, after its one confinement check. From then on every reader (the server's contact
sheet, the workers) opens a blob by its digest, never a path a client chose: a file swapped after submission
reaches nothing. A worker without the server's filesystem downloads a blob once (`GET /v1/blobs/{sha256}`)
into its own BlobStore.
"""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from pathlib import Path
from typing import Annotated, Iterable

from storyboard_cli.errors import BadInput
from storyboard_cli.job.inputs import DIGEST, DIGEST_RULE, is_digest

BLOBS = "blobs"
TMP = "tmp"
CHUNK = 1 << 20
MAX_QUERY = 10_000  # digests asked about in one POST /v1/blobs/missing


class BlobTooLarge(BadInput):
    """More bytes than the server's --max-blob-mb."""


class DigestMismatch(BadInput):
    """The bytes do not hash to the digest they were sent as."""


class BlobStore:
    """`<root>/blobs/<2 hex>/<sha256>`: each written once (temporary file, fsync, rename), mode 0444."""

    def __init__(self, root: Path):
        self.dir = Path(root) / BLOBS

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
        return [d for d in dict.fromkeys(digests) if not self.has(d)]

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
            w = BlobWriter(self, None, limit)
            for chunk in iter(lambda: f.read(CHUNK), b""):
                w.write(chunk)
            return w.close()

    def _write(self, target: Path, chunks: Iterable[bytes], digest: str | None, limit: int | None) -> str:
        w = BlobWriter(self, digest, limit, target)
        for chunk in chunks:
            w.write(chunk)
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
        self.hash.update(chunk)
        self.f.write(chunk)

    def close(self) -> str:
        got = self.hash.hexdigest()
        if self.digest is not None and got != self.digest:
            self.abort()
            raise DigestMismatch(f"the {self.n} bytes sent hash to {got}, not {self.digest}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.chmod(self.tmp, 0o444)
        target = self.target or self.store._file(got)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, target)  # the same bytes: a concurrent upload of the blob lands the same file
        return got

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- the HTTP routes

def router(store_of, limit_of):
    """The blob routes; `store_of(request)` gives the BlobStore, `limit_of(request)` the byte limit of one blob."""
    from fastapi import APIRouter, Path as PathParam, Request
    from fastapi.responses import FileResponse, JSONResponse
    from pydantic import BaseModel, Field
    from starlette.concurrency import run_in_threadpool

    from storyboard_cli.serve.api import PROBLEM, problem

    Digest = Annotated[str, PathParam(pattern=DIGEST.pattern, min_length=64, max_length=64,
                                      description="sha256 of the file, 64 lowercase hex digits")]
    problem_doc = {"content": {PROBLEM: {}}}

    class Query(BaseModel):
        digests: list[Annotated[str, Field(pattern=f"^{DIGEST.pattern}$")]] = Field(max_length=MAX_QUERY)

    class Missing(BaseModel):
        missing: list[str]

    class Stored(BaseModel):
        sha256: str
        size: int
        created: bool

    api = APIRouter(prefix="/v1/blobs", tags=["inputs"])

    @api.post("/missing", response_model=Missing, responses={422: problem_doc, 401: problem_doc})
    def missing(query: Query, request: Request):
        """Which of these input files (by sha256) the server lacks: upload those, then submit the job."""
        return {"missing": store_of(request).missing(query.digests)}

    @api.put("/{sha256}", status_code=201, response_model=Stored,
             responses={200: {"model": Stored, "description": "already stored"}, 413: problem_doc,
                        422: problem_doc, 401: problem_doc},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def put(sha256: Digest, request: Request):
        """One input file, streamed; stored read-only once its bytes hash to `sha256`."""
        store, limit = store_of(request), limit_of(request)
        if store.has(sha256):
            return JSONResponse({"sha256": sha256, "size": store.size(sha256), "created": False}, status_code=200)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return problem(413, "input too large", f"{int(declared)} bytes, more than this server's limit of "
                           f"{limit // (1 << 20)} MB (--max-blob-mb)")
        w = await run_in_threadpool(store.writer, sha256, limit)
        pending, size = [], 0
        try:
            async for chunk in request.stream():
                pending.append(chunk)
                size += len(chunk)
                if size >= 4 * CHUNK:  # hashed and written off the event loop, a few MB at a time
                    await run_in_threadpool(_feed, w, pending)
                    pending, size = [], 0
            await run_in_threadpool(_feed, w, pending)
            await run_in_threadpool(w.close)
        except BlobTooLarge as e:
            return problem(413, "input too large", str(e))
        except DigestMismatch as e:
            return problem(422, "digest mismatch", str(e))
        except BaseException:
            w.abort()
            raise
        return JSONResponse({"sha256": sha256, "size": w.n, "created": True}, status_code=201)

    @api.get("/{sha256}", responses={200: {"content": {"application/octet-stream": {}}}, 404: problem_doc,
                                     401: problem_doc, 422: problem_doc})
    def get(sha256: Digest, request: Request):
        """An input file by its sha256 (what a worker without the server's filesystem downloads)."""
        store = store_of(request)
        if not store.has(sha256):
            return problem(404, "no such input", f"no input with sha256 {sha256}")
        return FileResponse(store.path(sha256), media_type="application/octet-stream")

    return api


def _feed(w: BlobWriter, chunks: list[bytes]) -> None:
    for chunk in chunks:
        w.write(chunk)
