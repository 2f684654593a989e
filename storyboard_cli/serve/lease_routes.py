"""The workers' routes of the API: a worker registers, leases a batch, renews it by heartbeat while rendering
it, uploads its PNGs (a worker without the server's filesystem) and completes it, or gives it back for an error of
its own machine (a strike: MAX_STRIKES in a row and it is quarantined). Only a lease's holder may renew, complete
or give it back. Torch-free."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import folders, wire
from storyboard_cli.serve.api_state import ApiState, Id
from storyboard_cli.serve.edge import JSONRoute, problem
from storyboard_cli.serve.intake import stored_inputs
from storyboard_cli.serve.openapi import (FILE_BODY, LEASE_GONE, NOT_HOLDER, OCTETS, QUARANTINED, UNKNOWN_WORKER,
                                          problems)
from storyboard_cli.serve.store import (LATE, MAX_STRIKES, NotHolder, Quarantined, Store, TooManyWorkers,
                                        UnknownWorker, Work)

log = logging.getLogger(__name__)
Holder = Annotated[str, Query(pattern=wire.NAME_PATTERN, description="the id POST /v1/workers issued: the lease's "
                                                                     "holder")]  # a request whose body is a file


def router(state: ApiState) -> APIRouter:
    """/v1/workers and /v1/leases: register, lease a batch, heartbeat while rendering it, complete it."""
    api = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser
    store, settings, clock = state.store, state.settings, state.clock

    @api.post("/v1/workers", status_code=201, response_model=None, responses={
        201: {"model": wire.Registered, "description": "the id this worker names in its leases and heartbeats"},
        **problems({503: "--max-workers registrations are live (Retry-After: until the first can expire)"})})
    async def register(body: wire.Registration):
        """A worker's id, issued by the server. An id not seen within --lease-s (and holding no lease) is
        forgotten: its leases and heartbeats then answer 404, and the worker registers again."""
        try:
            worker = await run_in_threadpool(store.register_worker, body.name, clock(), settings.max_workers,
                                             settings.lease_s)
        except BadInput as e:
            return problem(422, "invalid worker name", str(e))
        except TooManyWorkers as e:
            return problem(503, "too many workers", str(e), {"Retry-After": str(e.retry_after)})
        return JSONResponse({"worker": worker, "name": body.name, "lease_s": settings.lease_s}, status_code=201)

    def unknown(e: UnknownWorker) -> JSONResponse:
        return problem(404, "unknown worker", str(e))

    def lost(when: str = "") -> JSONResponse:
        return problem(410, "lease lost", f"the lease expired{when}; its images went back to the queue")

    def not_holder(e: NotHolder) -> JSONResponse:
        return problem(403, "not the lease's holder", str(e))

    @api.post("/v1/leases", response_model=wire.Lease, responses={
        200: {"description": "a batch: its images, their jobs, the lease's time to live"},
        204: {"description": "no work now (or the server is stopping): ask again later"},
        **problems({403: QUARANTINED, 404: UNKNOWN_WORKER})})
    async def lease(report: wire.WorkerReport):
        if state.draining():
            return Response(status_code=204)
        try:
            got = await run_in_threadpool(_lease, store, report, clock(), settings.lease_s)
        except UnknownWorker as e:
            return unknown(e)
        except Quarantined as e:
            return problem(403, "worker quarantined", str(e))
        return got if got is not None else Response(status_code=204)

    @api.put("/v1/leases/{lease_id}/files/{job_id}/{path:any}", response_model=None, openapi_extra=FILE_BODY,
             responses={200: {"model": wire.StoredOutput}, **problems({
                 403: NOT_HOLDER,
                 404: "no route takes this path",
                 410: LEASE_GONE, 415: f"the body is not sent as {OCTETS}",
                 422: "not an output of this lease"})})
    async def upload(lease_id: Id, job_id: Id, path: str, request: Request, worker: Holder):
        """A worker without the server's filesystem sends a PNG of its lease (the lease's holder alone)."""
        if request.headers.get("content-type", "").split(";")[0].strip() != OCTETS:
            return problem(415, "unsupported media type", f"send the file's bytes as {OCTETS}")
        holder = await run_in_threadpool(store.lease_worker, lease_id)
        if holder is not None and holder != worker:
            return not_holder(NotHolder(lease_id, worker))
        held = await run_in_threadpool(store.lease_outputs, lease_id, clock())
        if held is None:
            return lost()
        if job_id not in held:
            return problem(422, "not this lease's job", f"the lease holds no image of job {job_id}")
        data = await request.body()
        try:
            await run_in_threadpool(folders.store_upload, held[job_id][1], held[job_id][2], path, data)
        except BadInput as e:
            return problem(422, "not this lease's file", str(e))
        return JSONResponse({"stored": path})

    @api.post("/v1/leases/{lease_id}/heartbeat", response_model=None, responses={
        200: {"model": wire.LeaseAck, "description": "the lease runs for its ttl from now"},
        **problems({403: NOT_HOLDER, 404: UNKNOWN_WORKER, 410: LEASE_GONE})})
    async def heartbeat(lease_id: Id, report: wire.WorkerReport):
        try:
            held = await run_in_threadpool(store.heartbeat, lease_id, clock(), settings.lease_s, report.worker,
                                           report.gpu, report.ready)
        except UnknownWorker as e:
            return unknown(e)
        except NotHolder as e:
            return not_holder(e)
        return JSONResponse({"lease": lease_id}) if held else lost()

    @api.post("/v1/leases/{lease_id}/fail", response_model=None, responses={
        200: {"model": wire.LeaseAck, "description": "its images are queued again, their attempts kept"},
        **problems({403: NOT_HOLDER, 410: LEASE_GONE})})
    async def fail(lease_id: Id, body: wire.LeaseFailure):
        """The holder gives the lease back: it could not render it for an error of its own machine (its device
        unusable, a CUDA error), not of the images. A strike against the worker: after MAX_STRIKES in a row it is
        quarantined (403 on its next lease request). A completion ends its strikes."""
        try:
            strike = await run_in_threadpool(store.give_back, lease_id, body.worker, body.reason, clock())
        except NotHolder as e:
            return not_holder(e)
        if strike is None:
            return lost()
        if strike.quarantined:
            log.warning("worker %s quarantined: %d leases in a row failed on its machine (last: %s); it gets no "
                        "more leases", body.worker, strike.strikes, body.reason)
        else:
            log.warning("worker %s gave back lease %s: %s (strike %d of %d); its images are queued again",
                        body.worker, lease_id, body.reason, strike.strikes, MAX_STRIKES)
        return JSONResponse({"lease": lease_id})

    @api.post("/v1/leases/{lease_id}/complete", response_model=None, responses={
        200: {"model": wire.LeaseAck, "description": "recorded: the images done, failed, or queued again"},
        **problems({403: NOT_HOLDER, 410: LEASE_GONE + " (this completion is ignored)",
                     422: "a manifest line for an output this lease did not upload, or a report the server "
                          "cannot read (`detail` names the field)"})})
    async def complete(lease_id: Id, body: wire.Completion):
        """The lease's results, from its holder. Each done image's files are checked (in the job's folder, their
        sha256 the one their manifest line names) and their lines recorded in the transaction that marks them done:
        the server is the one writer of the job's manifest, report and sheet."""
        work = Work(tuple((b.shape, b.images, b.seconds, b.bucket) for b in body.batches), body.out_of_memory,
                    body.model_loads)
        holder = await run_in_threadpool(store.lease_worker, lease_id)
        if holder is not None and holder != body.worker:
            return not_holder(NotHolder(lease_id, body.worker))
        held = await run_in_threadpool(store.lease_outputs, lease_id, clock())
        if held is None:
            await run_in_threadpool(store.count, LATE)
            return lost(" before this completion")
        try:
            checked = await run_in_threadpool(folders.check, held, {j: [line.model_dump() for line in lines]
                                                                    for j, lines in body.manifest.items()})
            ok = await run_in_threadpool(store.complete, lease_id, body.done, body.cached,
                                         {int(k): v for k, v in body.failed.items()}, clock(), work,
                                         lambda done: folders.record(held, checked, done), body.worker)
        except BadInput as e:
            return problem(422, "bad manifest", str(e))
        except NotHolder as e:
            return not_holder(e)
        if not ok:
            return lost(" before this completion")
        await run_in_threadpool(folders.keep_reports, held, lease_id, body.worker,
                                {j: r.model_dump(exclude_unset=True) for j, r in body.reports.items()})
        await run_in_threadpool(state.landed, held)  # the queue read off the event loop, as every call above
        return JSONResponse({"lease": lease_id})

    return api


def _lease(store: Store, report: wire.WorkerReport, now: float, ttl: float) -> wire.Lease | None:
    """The next batch for the worker, with what a worker that does not share the server's filesystem needs:
    each job's text and its files' digests."""
    got = store.lease(report.worker, now, ttl, report.gpu, report.ready, frozenset(report.warm), report.uptime_s)
    if got is None:
        return None
    jobs = {job_id: job.model_copy(update={"job_text": Path(job.path).read_text(encoding="utf-8"),
                                           "inputs": stored_inputs(Path(job.path))})  # GET /v1/blobs/{sha256}
            for job_id, job in got.jobs.items()}
    return got.model_copy(update={"jobs": jobs})
