"""The HTTP API (FastAPI): jobs in, their state out, the workers' lease protocol, /metrics. Torch-free:
validation and planning run here without a model; rendering happens in the workers (worker.py).

Errors are RFC 9457 problem+json, and whatever a client or a worker sends gets a 4xx, never a 500 (edge.py:
tokens, body caps, JSON that cannot surprise the parser). A bad job is a 422 whose `detail` is the line
`bcg plan` prints (file:line, shot, field); a malformed body, header or query a 422 naming the field; a full
queue a 503 with an integer Retry-After from the measured drain rate. /openapi.json describes every answer of
every route (wire.py's models, the job body's schema, the tokens each route needs).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Callable

from fastapi import FastAPI, Header, Path as PathParam, Request, Response
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from storyboard_cli.errors import BadInput
from storyboard_cli.folder.layout import INDEX, REPORT_JSON
from storyboard_cli.serve import blob_routes, blobs, edge, folders, metrics, wire
from storyboard_cli.serve.edge import PROBLEM, problem
from storyboard_cli.serve.openapi import (DESCRIPTION, EVENT, EVENT_STREAM, FILE_BODY, FILE_TYPES, FILES, JOB_BODY,
                                          LEASE_GONE, OCTETS, UNKNOWN_WORKER, EventStream, JobFile, problems, schema)
from storyboard_cli.serve.settings import Settings
from storyboard_cli.serve.intake import SAFE_FILE, content_hash, plan_submission, stored_inputs
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, END, TIERS, JobState
from storyboard_cli.serve.store import LATE, JobFinal, QueueFull, Store, TooManyWorkers, UnknownWorker, Work

__all__ = ["PROBLEM", "Settings", "create_app", "problem"]
JSON_TYPES = ("application/json",)
DRAINING_RETRY_S = 30
EVENT_POLL_S = 0.2  # how often a stream looks for new events
KEEPALIVE_S = 15.0
RECONNECT_MS = 1000
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger(__name__)

Id = Annotated[str, PathParam(pattern=wire.NAME_PATTERN, description="an id this server issued")]
IdempotencyKey = Annotated[str, Header(alias="Idempotency-Key", min_length=1, max_length=255,
                                       description="a retry with the same key and body answers the first job")]
JobFilename = Annotated[str, Header(alias="X-Job-Filename", pattern=f"^{SAFE_FILE.pattern}$",
                                    description="the job file's name: errors name it, and a job without `name:` "
                                                "is named after it")]
LastEventId = Annotated[int, Header(alias="Last-Event-ID", ge=0, le=wire.MAX_INT,
                                    description="the last event id this client saw: the stream resumes after it")]


def create_app(settings: Settings, store: Store | None = None, clock: Callable[[], float] = time.time) -> FastAPI:
    store = store or Store(settings.root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def sweep():  # a lease lost with no worker left to ask would otherwise look held forever
            while True:
                await asyncio.sleep(settings.sweep_s or settings.lease_s / 4)
                try:
                    await run_in_threadpool(store.sweep, clock())
                except sqlite3.Error as e:  # busy for longer than the store waits: the next sweep does it
                    log.warning("lease sweep: %s", e)

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()
            await run_in_threadpool(refresher.close)  # the last reports and sheets written

    app = FastAPI(title="bcg serve", version="1", description=DESCRIPTION, lifespan=lifespan)
    app.state.store, app.state.draining, app.state.settings = store, False, settings
    refresher = app.state.refresher = folders.Refresher(lambda job_id: _served(store, job_id, clock()), clock)

    def landed(job_ids) -> None:
        """Batches of these jobs landed (or they ended): their reports and sheets are rebuilt."""
        for job_id in job_ids:
            state = store.job_state(job_id)
            refresher.touch(job_id, now=state is None or state in JobState.FINAL)
    edge.install(app, settings)
    app.openapi = lambda: app.openapi_schema or schema(app, settings)
    registry = metrics.registry(store, settings.lease_s, clock)
    app.state.blobs = blobs.BlobStore(settings.root)
    app.include_router(blob_routes.router(lambda r: r.app.state.blobs, lambda r: settings.max_blob_mb << 20))

    def view(job_id: str, request: Request) -> dict | None:
        job = store.job(job_id, clock())
        if job is None:
            return None
        base = str(request.base_url).rstrip("/") + f"/v1/jobs/{job_id}"
        job["url"] = base
        files = base + "/files/"
        for image in job["images"]:
            image["urls"] = [files + p for p in image["outputs"]] if image["state"] == "done" else []
        job["report_url"], job["sheet_url"] = files + REPORT_JSON, files + INDEX
        del job["out_dir"]
        return job

    def not_found(job_id: str) -> JSONResponse:
        return problem(404, "no such job", f"no job {job_id}")

    def final(e: JobFinal) -> JSONResponse:
        return problem(409, f"job {e.state}", str(e))

    def as_view(job_id: str, request: Request, status: int = 200, headers: dict | None = None) -> JSONResponse:
        job = view(job_id, request)
        return JSONResponse(job, status_code=status, headers=headers) if job is not None else not_found(job_id)

    @app.post("/v1/jobs", status_code=202, response_model=None, openapi_extra=JOB_BODY, responses={
        202: {"model": wire.JobView, "description": "accepted: every image queued (Location: the job)"},
        200: {"model": wire.JobView, "description": "the job first submitted with this Idempotency-Key "
                                                    "(Idempotent-Replayed: true)"},
        **problems({422: "a job `bcg plan` refuses (file:line, shot, field), or an Idempotency-Key used for "
                          "another body", 503: "the queue is full, or the server is stopping (Retry-After)"})})
    async def submit(request: Request, priority: wire.Priority = DEFAULT_PRIORITY,
                     idempotency_key: IdempotencyKey = None, x_job_filename: JobFilename = None):
        """A job file (YAML or JSON, at most --max-job-kb), validated and planned as `bcg plan` does."""
        if app.state.draining:
            return problem(503, "shutting down", "the server is stopping; submit to another or retry",
                           {"Retry-After": str(DRAINING_RETRY_S)})
        body = await request.body()
        json_body = request.headers.get("content-type", "").split(";")[0].strip() in JSON_TYPES
        filename = x_job_filename or ("job.json" if json_body else "job.yaml")
        if idempotency_key is not None:
            same_body = {p: content_hash(body, filename, p) for p in TIERS}
            try:  # the first job's answer, without planning again (a key retried in a loop)
                first = await run_in_threadpool(store.replay, idempotency_key, same_body[priority], same_body)
            except BadInput as e:
                return problem(422, "refused", str(e))
            if first is not None:
                return replayed(first, request)
        job_id = uuid.uuid4().hex[:12]
        try:
            await run_in_threadpool(store.refuse_if_full, settings.max_queue_images, clock())
        except QueueFull as e:
            return problem(503, "queue full", str(e), {"Retry-After": str(e.retry_after)})
        try:
            planned = await run_in_threadpool(plan_submission, settings.root, job_id, body, filename, priority,
                                              settings.inputs, app.state.blobs, settings.allow_models,
                                              settings.max_blob_mb << 20)
        except BadInput as e:
            return problem(422, "invalid job", str(e))
        try:
            new_id, created = await run_in_threadpool(store.submit, planned, idempotency_key,
                                                      settings.max_queue_images, clock())
        except QueueFull as e:
            _discard(planned.path.parent)
            return problem(503, "queue full", str(e), {"Retry-After": str(e.retry_after)})
        except BadInput as e:  # an idempotency conflict, or larger than the queue
            _discard(planned.path.parent)
            return problem(422, "refused", str(e))
        if not created:
            _discard(planned.path.parent)
            return replayed(new_id, request)
        return as_view(new_id, request, 202, {"Location": f"/v1/jobs/{new_id}"})

    def replayed(job_id: str, request: Request) -> JSONResponse:
        return as_view(job_id, request, 200, {"Location": f"/v1/jobs/{job_id}", "Idempotent-Replayed": "true"})

    @app.get("/v1/jobs/{job_id}", response_model=None, responses={200: {"model": wire.JobView},
                                                                   **problems({404: "no such job"})})
    def get_job(job_id: Id, request: Request):
        return as_view(job_id, request)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=None, responses={
        200: {"model": wire.JobView, "description": "canceled: queued images at once, leased ones after their batch"},
        **problems({404: "no such job", 409: "the job is already succeeded, failed or canceled: nothing changed"})})
    def cancel(job_id: Id, request: Request):
        try:
            found = store.cancel(job_id, clock())
        except JobFinal as e:
            return final(e)
        if found:
            landed([job_id])
        return as_view(job_id, request) if found else not_found(job_id)

    @app.patch("/v1/jobs/{job_id}", response_model=None, responses={
        200: {"model": wire.JobView, "description": "its queued images move to the new priority"},
        **problems({404: "no such job", 409: "the job is already succeeded, failed or canceled: nothing changed"})})
    def reprioritise(job_id: Id, change: wire.PriorityChange, request: Request):
        try:
            found = store.set_priority(job_id, change.priority, clock())
        except JobFinal as e:
            return final(e)
        return as_view(job_id, request) if found else not_found(job_id)

    @app.get("/v1/jobs/{job_id}/events", response_class=EventStream, responses={
        200: {"description": "the job's events, each as it happens; the stream ends after `end`",
              "content": {EVENT_STREAM: {"schema": EVENT}}}, **problems({404: "no such job"})})
    def events(job_id: Id, last_event_id: LastEventId = 0):
        """Server-sent events: each change of the job, `id:` its sequence number; a client that reconnects
        with `Last-Event-ID` gets the events after it. The stream ends after the `end` event."""
        if store.job(job_id, clock()) is None:
            return not_found(job_id)
        return EventStream(_stream(job_id, last_event_id),
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _stream(job_id: str, after: int):
        yield f"retry: {RECONNECT_MS}\n\n"
        quiet = 0.0
        while not app.state.draining:
            rows, ended = await run_in_threadpool(store.events, job_id, after)
            if ended and not rows:
                return
            for seq, kind, data in rows:
                yield f"id: {seq}\nevent: {kind}\ndata: {data}\n\n"
                after = seq
                if kind == END:
                    return
            quiet = 0.0 if rows else quiet + EVENT_POLL_S
            if quiet >= KEEPALIVE_S:  # a comment line: proxies keep the connection, clients ignore it
                yield ": keep-alive\n\n"
                quiet = 0.0
            await asyncio.sleep(EVENT_POLL_S)

    @app.get("/v1/jobs/{job_id}/files/{path:path}", response_class=JobFile, responses={
        200: {"description": "the file (PNG, the report, the contact sheet, a thumbnail, ...)", "content": FILES},
        **problems({404: "no such job, or no such file in its folder"})})
    def job_file(job_id: Id, path: str):
        job = store.job(job_id, clock())
        if job is None:
            return not_found(job_id)
        folder = Path(job["out_dir"]).resolve()
        try:
            target = (folder / path).resolve()
            found = target.is_relative_to(folder) and target.is_file()
        except (OSError, ValueError):  # a name too long, a NUL: no such file either
            found = False
        if not found:
            return problem(404, "no such file", f"{path} is not in the job's folder")
        return FileResponse(target, media_type=FILE_TYPES.get(target.suffix.lower(), OCTETS))

    # the workers' protocol: register, lease a batch, heartbeat while rendering it, complete it

    @app.post("/v1/workers", status_code=201, response_model=None, responses={
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

    @app.post("/v1/leases", response_model=wire.Lease, responses={
        200: {"description": "a batch: its images, their jobs, the lease's time to live"},
        204: {"description": "no work now (or the server is stopping): ask again later"},
        **problems({404: UNKNOWN_WORKER})})
    async def lease(report: wire.WorkerReport):
        if app.state.draining:
            return Response(status_code=204)
        try:
            got = await run_in_threadpool(_lease, store, report, clock(), settings.lease_s)
        except UnknownWorker as e:
            return unknown(e)
        return got if got is not None else Response(status_code=204)

    @app.put("/v1/leases/{lease_id}/files/{job_id}/{path:path}", response_model=None, openapi_extra=FILE_BODY,
             responses={200: {"model": wire.StoredOutput}, **problems({
                 410: LEASE_GONE, 415: f"the body is not sent as {OCTETS}",
                 422: "not an output of this lease"})})
    async def upload(lease_id: Id, job_id: Id, path: str, request: Request):
        """A worker without the server's filesystem sends a PNG of its lease."""
        if request.headers.get("content-type", "").split(";")[0].strip() != OCTETS:
            return problem(415, "unsupported media type", f"send the file's bytes as {OCTETS}")
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

    @app.post("/v1/leases/{lease_id}/heartbeat", response_model=None, responses={
        200: {"model": wire.LeaseAck, "description": "the lease runs for its ttl from now"},
        **problems({404: UNKNOWN_WORKER, 410: LEASE_GONE})})
    async def heartbeat(lease_id: Id, report: wire.WorkerReport):
        try:
            held = await run_in_threadpool(store.heartbeat, lease_id, clock(), settings.lease_s, report.worker,
                                           report.gpu, report.ready)
        except UnknownWorker as e:
            return unknown(e)
        return JSONResponse({"lease": lease_id}) if held else lost()

    @app.post("/v1/leases/{lease_id}/complete", response_model=None, responses={
        200: {"model": wire.LeaseAck, "description": "recorded: the images done, failed, or queued again"},
        **problems({410: LEASE_GONE + " (this completion is ignored)",
                     422: "a manifest line for an output this lease did not upload"})})
    async def complete(lease_id: Id, body: wire.Completion):
        """The lease's results. Each done image's files are checked (in the job's folder, their sha256 the one
        their manifest line names) and their lines recorded in the transaction that marks them done: the server
        is the one writer of the job's manifest, report and sheet."""
        work = Work(tuple((b.shape, b.images, b.seconds, b.bucket) for b in body.batches), body.out_of_memory,
                    body.model_loads)
        held = await run_in_threadpool(store.lease_outputs, lease_id, clock())
        worker = await run_in_threadpool(store.lease_worker, lease_id)
        if held is None:
            store.count(LATE)
            return lost(" before this completion")
        try:
            checked = await run_in_threadpool(folders.check, held, {j: [line.model_dump() for line in lines]
                                                                    for j, lines in body.manifest.items()})
            ok = await run_in_threadpool(store.complete, lease_id, body.done, body.cached,
                                         {int(k): v for k, v in body.failed.items()}, clock(), work,
                                         lambda done: folders.record(held, checked, done))
        except BadInput as e:
            return problem(422, "bad manifest", str(e))
        if not ok:
            return lost(" before this completion")
        await run_in_threadpool(folders.keep_reports, held, lease_id, worker, body.reports)
        landed(held)
        return JSONResponse({"lease": lease_id})

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text (version 0.0.4)"}})
    def scrape():
        return Response(metrics.exposition(registry), media_type=METRICS_TYPE)

    @app.get("/healthz", response_model=None, responses={
        200: {"model": wire.Health}, **problems({503: "the server is stopping: it admits no job"})})
    def healthz():
        """Liveness and admission: 200 while the server accepts jobs (with or without workers), 503 while it
        drains. What a load balancer routes submissions on."""
        if app.state.draining:
            return problem(503, "draining", "the server is stopping: it admits no job")
        return JSONResponse({"ok": True})

    @app.get("/readyz", response_model=None, responses={
        200: {"model": wire.Ready}, **problems({503: "by design, until a worker is ready: no registered worker "
                                                      "seen within --lease-s has its graphs captured (or the "
                                                      "server is stopping)"})})
    def readyz():
        """Ready: at least one registered worker seen within --lease-s has its model loaded and its graphs
        captured (it says so with each lease request and heartbeat)."""
        if app.state.draining:
            return problem(503, "draining", "the server is stopping")
        seen, ready = store.readiness(clock(), settings.lease_s)
        if not ready:
            reason = (f"{seen} worker(s) seen in the last {settings.lease_s:g} s, none has its graphs captured yet "
                      "(a worker loads its model and captures them with its first batch)" if seen else
                      f"no worker seen in the last {settings.lease_s:g} s")
            return problem(503, "no ready worker", reason)
        return JSONResponse({"ready": True, "workers": seen, "workers_ready": ready})

    return app


def _lease(store: Store, report: wire.WorkerReport, now: float, ttl: float) -> wire.Lease | None:
    """The next batch for the worker, with what a worker that does not share the server's filesystem needs:
    each job's text and its files' digests."""
    got = store.lease(report.worker, now, ttl, report.gpu, report.ready, frozenset(report.warm), report.uptime_s)
    if got is None:
        return None
    return got.model_copy(update={"jobs": {job_id: job.model_copy(update={
        "job_text": Path(job.path).read_text(encoding="utf-8"),
        "inputs": stored_inputs(Path(job.path))})  # the job's files by sha256: GET /v1/blobs/{sha256}
        for job_id, job in got.jobs.items()}})


def _served(store: Store, job_id: str, now: float) -> dict | None:
    """A job as the folder writer needs it: its view in the store and its job file."""
    job = store.job(job_id, now)
    if job is not None:
        job["path"] = str(store.job_file(job_id))
    return job


def _discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
