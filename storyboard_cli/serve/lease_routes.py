"""The workers' routes of the API: a worker registers, leases a batch, renews it by heartbeat while rendering
it, uploads its PNGs (a worker without the server's filesystem) and completes it, or gives it back for an error of
its own machine (a strike: MAX_STRIKES in a row and it is quarantined). Only a lease's holder may renew, complete
or give it back. Torch-free."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import suppress
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import folders, wire
from storyboard_cli.serve.api_state import ApiState, Id, State
from storyboard_cli.job.preflight import unwritable
from storyboard_cli.serve.disk import MB, is_full, is_unwritable
from storyboard_cli.serve.edge import JSONRoute, Refused
from storyboard_cli.serve.intake import stored_inputs
from storyboard_cli.serve.openapi import (FILE_BODY, LEASE_GONE, NOT_HOLDER, OCTETS, QUARANTINED, UNKNOWN_WORKER,
                                          problems)
from storyboard_cli.serve.store import (LATE, MAX_STRIKES, NotHolder, Quarantined, Store, TooManyWorkers,
                                        UnknownWorker, Work)

log = logging.getLogger(__name__)
Holder = Annotated[str, Query(pattern=wire.NAME_PATTERN, description="the id POST /v1/workers issued: the lease's "
                                                                     "holder")]  # a request whose body is a file


router = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser


def unknown(e: UnknownWorker) -> Refused:
    return Refused(404, "unknown worker", str(e))


def lost(when: str = "") -> Refused:
    return Refused(410, "lease lost", f"the lease expired{when}; its images went back to the queue")


def not_holder(e: NotHolder) -> Refused:
    return Refused(403, "not the lease's holder", str(e))


@router.post("/v1/workers", status_code=201, responses={
    201: {"description": "the id this worker names in its leases and heartbeats"},
    **problems({503: "--max-workers registrations are live (Retry-After: until the first can expire)"})})
async def register(body: wire.Registration, state: State) -> wire.Registered:
    """A worker's id, issued by the server. An id not seen within --lease-s (and holding no lease) is
    forgotten: its leases and heartbeats then answer 404, and the worker registers again."""
    settings = state.settings
    try:
        worker = await run_in_threadpool(state.store.register_worker, body.name, state.clock(), settings.max_workers,
                                         settings.lease_s)
    except BadInput as e:
        raise Refused(422, "invalid worker name", str(e)) from None
    except TooManyWorkers as e:
        raise Refused(503, "too many workers", str(e), {"Retry-After": str(e.retry_after)}) from None
    return wire.Registered(worker=worker, name=body.name, lease_s=settings.lease_s)


# no return annotation: its 204 (no work) is a bare Response, not a Lease
@router.post("/v1/leases", response_model=wire.Lease, responses={
    200: {"description": "a batch: its images, their jobs, the lease's time to live"},
    204: {"description": "no work now (or the server is stopping): ask again later"},
    **problems({403: QUARANTINED, 404: UNKNOWN_WORKER})})
async def lease(report: wire.WorkerReport, state: State):
    if state.draining():
        return Response(status_code=204)
    held = await run_in_threadpool(state.disk.holding)  # a write into the job folders refused for want of space
    try:
        got = await run_in_threadpool(_lease, state.store, report, state.clock(), state.settings.lease_s,
                                      held is not None)
    except UnknownWorker as e:
        raise unknown(e) from None
    except Quarantined as e:
        raise Refused(403, "worker quarantined", str(e)) from None
    return got if got is not None else Response(status_code=204)


@router.put("/v1/leases/{lease_id}/files/{job_id}/{path:any}", openapi_extra=FILE_BODY, responses=problems({
    403: NOT_HOLDER, 404: "no route takes this path", 410: LEASE_GONE, 415: f"the body is not sent as {OCTETS}",
    422: "not an output of this lease"}))
async def upload(lease_id: Id, job_id: Id, path: str, request: Request, worker: Holder,
                 state: State) -> wire.StoredOutput:
    """A worker without the server's filesystem sends a PNG of its lease (the lease's holder alone)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != OCTETS:
        raise Refused(415, "unsupported media type", f"send the file's bytes as {OCTETS}")
    store = state.store
    holder = await run_in_threadpool(store.lease_worker, lease_id)
    if holder is not None and holder != worker:
        raise not_holder(NotHolder(lease_id, worker))
    held = await run_in_threadpool(store.lease_outputs, lease_id, state.clock())
    if held is None:
        raise lost()
    if job_id not in held:
        raise Refused(422, "not this lease's job", f"the lease holds no image of job {job_id}")
    data = await request.body()
    try:
        await run_in_threadpool(folders.store_upload, held[job_id][1], held[job_id][2], path, data)
    except BadInput as e:
        raise Refused(422, "not this lease's file", str(e)) from None
    except OSError as e:  # a full or read-only disk: a 507 (disk.py), and no batch leased until that passes
        if is_full(e) or is_unwritable(e):
            state.disk.spent(f"{path} of job {job_id}, uploaded by worker {worker}",
                             held[job_id][1] if is_unwritable(e) else None)
        raise
    return wire.StoredOutput(stored=path)


@router.post("/v1/leases/{lease_id}/heartbeat", responses={
    200: {"description": "the lease runs for its ttl from now"},
    **problems({403: NOT_HOLDER, 404: UNKNOWN_WORKER, 410: LEASE_GONE})})
async def heartbeat(lease_id: Id, report: wire.WorkerReport, state: State) -> wire.LeaseAck:
    try:
        held = await run_in_threadpool(state.store.heartbeat, lease_id, state.clock(), state.settings.lease_s,
                                       report.worker, report.gpu, report.ready)
    except UnknownWorker as e:
        raise unknown(e) from None
    except NotHolder as e:
        raise not_holder(e) from None
    if not held:
        raise lost()
    return wire.LeaseAck(lease=lease_id)


@router.post("/v1/leases/{lease_id}/fail", responses={
    200: {"description": "its images are queued again, their attempts kept"},
    **problems({403: NOT_HOLDER, 410: LEASE_GONE})})
async def fail(lease_id: Id, body: wire.LeaseFailure, state: State) -> wire.LeaseAck:
    """The holder gives the lease back: it could not render it for an error of its own machine (its device
    unusable, a CUDA error), not of the images. A strike against the worker: after MAX_STRIKES in a row it is
    quarantined (403 on its next lease request). A completion ends its strikes."""
    try:
        strike = await run_in_threadpool(state.store.give_back, lease_id, body.worker, body.reason, state.clock())
    except NotHolder as e:
        raise not_holder(e) from None
    if strike is None:
        raise lost()
    if strike.quarantined:
        log.warning("worker %s quarantined: %d leases in a row failed on its machine (last: %s); it gets no "
                    "more leases", body.worker, strike.strikes, body.reason)
    else:
        log.warning("worker %s gave back lease %s: %s (strike %d of %d); its images are queued again",
                    body.worker, lease_id, body.reason, strike.strikes, MAX_STRIKES)
    return wire.LeaseAck(lease=lease_id)


@router.post("/v1/leases/{lease_id}/complete", responses={
    200: {"description": "recorded: the images done, failed, or queued again"},
    **problems({403: NOT_HOLDER, 410: LEASE_GONE + " (this completion is ignored)",
                422: "a manifest line for an output this lease did not upload, or a report the server "
                     "cannot read (`detail` names the field)"})})
async def complete(lease_id: Id, body: wire.Completion, state: State) -> wire.LeaseAck:
    """The lease's results, from its holder. Each done image's files are checked (in the job's folder, their
    sha256 the one their manifest line names) and their lines recorded in the transaction that marks them done:
    the server is the one writer of the job's manifest, report and sheet."""
    store = state.store
    work = Work(tuple((b.shape, b.images, b.seconds, b.bucket) for b in body.batches), body.out_of_memory,
                body.model_loads)
    holder = await run_in_threadpool(store.lease_worker, lease_id)
    if holder is not None and holder != body.worker:
        raise not_holder(NotHolder(lease_id, body.worker))
    held = await run_in_threadpool(store.lease_outputs, lease_id, state.clock())
    if held is None:
        await run_in_threadpool(store.count, LATE)
        raise lost(" before this completion")
    try:
        checked = await run_in_threadpool(folders.check, held, body.manifest)

        def record(done: dict[str, set[str]]) -> None:
            """Inside the transaction that marks the images done: their manifest lines, then the lease's reports, so
            a job's report rebuilt once its images are done always has their batches (a rebuild between the commit
            and a later write dropped a lease's batches from a finished job's report)."""
            folders.record(held, checked, done)
            folders.keep_reports(held, lease_id, body.worker, body.reports)

        strike = None if body.disk_full is None else await run_in_threadpool(_disk_full, state, body, held)
        ok = await run_in_threadpool(store.complete, lease_id, body.done, body.cached,
                                     {int(k): v for k, v in body.failed.items()}, state.clock(), work, record,
                                     body.worker, strike)
    except BadInput as e:
        raise Refused(422, "bad manifest", str(e)) from None
    except NotHolder as e:
        raise not_holder(e) from None
    except (OSError, sqlite3.OperationalError) as e:  # the job folders' disk full or read-only: a 507 (disk.py)
        if not (is_full(e) or is_unwritable(e)):
            raise
        folder = (_unwritable_folder(held) or next(iter(held.values()))[1]) if is_unwritable(e) else None
        await run_in_threadpool(state.disk.spent, f"the manifest lines of lease {lease_id}", folder)
        with suppress(OSError, sqlite3.OperationalError):  # nothing was recorded: its images go back to the queue,
            # their attempts kept, rendered again once space is freed (the queue's own disk full too: it expires)
            await run_in_threadpool(store.complete, lease_id, [], [], {}, state.clock(), None, None, body.worker)
        raise
    if not ok:
        raise lost(" before this completion")
    await run_in_threadpool(state.landed, held)  # the queue read off the event loop, as every call above
    return wire.LeaseAck(lease=lease_id)


def _disk_full(state: ApiState, body: wire.Completion, held: dict) -> str | None:
    """A worker on the shared folders could not write a PNG (its images not named go back to the queue with their
    attempts): for want of space, or its job folder read-only or not permitted. Where the server cannot write there
    either (its disk under --min-free-mb, or the folder read-only for it too), no batch is leased until that passes
    (disk.py). Where it can, what the worker met is of its own machine (a quota of its user, another filesystem or
    mount at that path): the reason of its strike, returned, and the farm goes on."""
    if state.disk.holding() is not None:  # the server saw it too (an upload refused, or another worker's report)
        return None
    what = f"worker {body.worker}: {body.disk_full}"
    folder = _unwritable_folder(held)
    if folder is not None or state.disk.low() is not None:
        state.disk.spent(what, folder)
        return None
    log.warning("%s, though the server can write its job folders (%.0f MB free): a strike against the worker", what,
                state.disk.free() / MB)
    return f"could not write into the job folders: {body.disk_full}"


def _unwritable_folder(held: dict) -> Path | None:
    """The first of a lease's job folders (`Store.lease_outputs`) that the server cannot write; None when it can
    write them all."""
    return next((out for _, out, _ in held.values() if unwritable(out)), None)


def _lease(store: Store, report: wire.WorkerReport, now: float, ttl: float, held: bool) -> wire.Lease | None:
    """The next batch for the worker (None while `held`: the server's disk full), with what a worker that does not
    share the server's filesystem needs: each job's text and its files' digests."""
    got = store.lease(report.worker, now, ttl, report.gpu, report.ready, frozenset(report.warm), report.uptime_s,
                      held)
    if got is None:
        return None
    jobs = {job_id: job.model_copy(update={"job_text": Path(job.path).read_text(encoding="utf-8"),
                                           "inputs": stored_inputs(Path(job.path))})  # GET /v1/blobs/{sha256}
            for job_id, job in got.jobs.items()}
    return got.model_copy(update={"jobs": jobs})
