"""The blob routes of the API (blobs.py is the store): which inputs the server lacks, an upload streamed and
checked against its digest, a download for workers without the server's filesystem."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from storyboard_cli.job.inputs import DIGEST
from storyboard_cli.serve.blobs import (CHUNK, MAX_QUERY, BlobStore, BlobStoreFull, BlobTooLarge, BlobWriter,
                                        DigestMismatch)
from storyboard_cli.serve.disk import FULL_TITLE, INSUFFICIENT_STORAGE, Disk
from storyboard_cli.serve.edge import PROBLEM, problem

PROBLEM_DOC = {"content": {PROBLEM: {}}}
Digest = Annotated[str, PathParam(pattern=f"^{DIGEST.pattern}$", min_length=64, max_length=64,
                                  description="sha256 of the file, 64 lowercase hex digits")]


class Octets(Response):
    media_type = "application/octet-stream"


class BlobQuery(BaseModel):
    digests: list[Annotated[str, Field(pattern=f"^{DIGEST.pattern}$")]] = Field(max_length=MAX_QUERY)


class BlobsMissing(BaseModel):
    missing: list[str]


class BlobStored(BaseModel):
    sha256: str
    size: int
    created: bool


def router(store_of: Callable[[Request], BlobStore], limit_of: Callable[[Request], int],
           disk: Disk | None = None) -> APIRouter:
    """The blob routes; `store_of(request)` gives the BlobStore, `limit_of(request)` the byte limit of one blob;
    `disk`: the server's (disk.py), below whose floor no file is taken."""
    api = APIRouter(prefix="/v1/blobs", tags=["inputs"])

    @api.post("/missing", response_model=BlobsMissing, responses={422: PROBLEM_DOC, 401: PROBLEM_DOC})
    def missing(query: BlobQuery, request: Request):
        """Which of these input files (by sha256) the server lacks: upload those, then submit the job."""
        return {"missing": store_of(request).missing(query.digests)}

    @api.put("/{sha256}", status_code=201, response_model=BlobStored,
             responses={200: {"model": BlobStored, "description": "already stored"}, 413: PROBLEM_DOC,
                        422: PROBLEM_DOC, 401: PROBLEM_DOC, 507: PROBLEM_DOC},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def put(sha256: Digest, request: Request):
        """One input file, streamed; stored read-only once its bytes hash to `sha256`."""
        store, limit = store_of(request), limit_of(request)
        if store.has(sha256):
            store.touch(sha256)  # the client relies on it from now on
            return JSONResponse({"sha256": sha256, "size": store.size(sha256), "created": False}, status_code=200)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return problem(413, "input too large", f"{int(declared)} bytes, more than this server's limit of "
                           f"{limit // (1 << 20)} MB (--max-blob-mb)")
        low = None if disk is None else await run_in_threadpool(disk.low)
        if low is not None:
            return disk.refuse(low)
        try:
            await run_in_threadpool(store.room_for, int(declared) if declared.isdigit() else 0)
        except BlobStoreFull as e:
            return problem(INSUFFICIENT_STORAGE, FULL_TITLE, str(e))
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
        except BlobStoreFull as e:
            return problem(INSUFFICIENT_STORAGE, FULL_TITLE, str(e))
        except BaseException:
            w.abort()
            raise
        return JSONResponse({"sha256": sha256, "size": w.n, "created": True}, status_code=201)

    @api.get("/{sha256}", response_class=Octets, responses={200: {"description": "the file's bytes"},
                                                             404: PROBLEM_DOC, 401: PROBLEM_DOC, 422: PROBLEM_DOC})
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
