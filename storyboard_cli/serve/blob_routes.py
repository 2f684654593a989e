"""The blob routes of the API (blobs.py is the store): which inputs the server lacks, an upload streamed and
checked against its digest, a download for workers without the server's filesystem. Torch-free."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from storyboard_cli.job.inputs import DIGEST
from storyboard_cli.serve import wire
from storyboard_cli.serve.api_state import State
from storyboard_cli.serve.blobs import CHUNK, BlobStoreFull, BlobTooLarge, BlobWriter, DigestMismatch
from storyboard_cli.serve.disk import FULL_TITLE, INSUFFICIENT_STORAGE
from storyboard_cli.serve.edge import PROBLEM, Refused

PROBLEM_DOC = {"content": {PROBLEM: {}}}
Digest = Annotated[str, PathParam(pattern=f"^{DIGEST.pattern}$", min_length=64, max_length=64,
                                  description="sha256 of the file, 64 lowercase hex digits")]

router = APIRouter(prefix="/v1/blobs", tags=["inputs"])


class Octets(Response):
    media_type = "application/octet-stream"


@router.post("/missing", responses={422: PROBLEM_DOC, 401: PROBLEM_DOC})
def missing(query: wire.BlobQuery, state: State) -> wire.BlobsMissing:
    """Which of these input files (by sha256) the server lacks: upload those, then submit the job."""
    return wire.BlobsMissing(missing=state.blobs.missing(query.digests))


@router.put("/{sha256}", status_code=201,
            responses={200: {"model": wire.BlobStored, "description": "already stored"}, 413: PROBLEM_DOC,
                       422: PROBLEM_DOC, 401: PROBLEM_DOC, 507: PROBLEM_DOC},
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def put(sha256: Digest, request: Request, response: Response, state: State) -> wire.BlobStored:
    """One input file, streamed; stored read-only once its bytes hash to `sha256`."""
    store, limit = state.blobs, state.settings.max_blob_mb << 20
    if store.has(sha256):
        store.touch(sha256)  # the client relies on it from now on
        response.status_code = 200
        return wire.BlobStored(sha256=sha256, size=store.size(sha256), created=False)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(413, "input too large", f"{int(declared)} bytes, more than this server's limit of "
                      f"{limit // (1 << 20)} MB (--max-blob-mb)")
    low = await run_in_threadpool(state.disk.low)
    if low is not None:
        raise state.disk.refuse(low)
    try:
        await run_in_threadpool(store.room_for, int(declared) if declared.isdigit() else 0)
    except BlobStoreFull as e:
        raise Refused(INSUFFICIENT_STORAGE, FULL_TITLE, str(e)) from None
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
        raise Refused(413, "input too large", str(e)) from None
    except DigestMismatch as e:
        raise Refused(422, "digest mismatch", str(e)) from None
    except BlobStoreFull as e:
        raise Refused(INSUFFICIENT_STORAGE, FULL_TITLE, str(e)) from None
    except BaseException:
        w.abort()
        raise
    return wire.BlobStored(sha256=sha256, size=w.n, created=True)


@router.get("/{sha256}", response_class=Octets, responses={200: {"description": "the file's bytes"},
                                                            404: PROBLEM_DOC, 401: PROBLEM_DOC, 422: PROBLEM_DOC})
def get(sha256: Digest, state: State) -> FileResponse:
    """An input file by its sha256 (what a worker without the server's filesystem downloads)."""
    if not state.blobs.has(sha256):
        raise Refused(404, "no such input", f"no input with sha256 {sha256}")
    return FileResponse(state.blobs.path(sha256), media_type="application/octet-stream")


def _feed(w: BlobWriter, chunks: list[bytes]) -> None:
    for chunk in chunks:
        w.write(chunk)
