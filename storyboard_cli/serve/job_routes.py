"""The job routes of the API: a job submitted (validated and planned as `bcg plan` does, without a model), its
view, cancel and priority, its events (server-sent), the files of its folder. Torch-free."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from storyboard_cli.errors import BadInput
from storyboard_cli.folder.layout import INDEX, REPORT_JSON
from storyboard_cli.serve import wire
from storyboard_cli.serve.api_state import ApiState, Id, State
from storyboard_cli.serve.blobs import BlobStoreFull
from storyboard_cli.serve.disk import FULL_TITLE, INSUFFICIENT_STORAGE
from storyboard_cli.serve.edge import JSONRoute, Refused
from storyboard_cli.serve.intake import SAFE_FILE, content_hash, plan_submission
from storyboard_cli.serve.openapi import (EVENT, EVENT_STREAM, FILE_TYPES, FILES, JOB_BODY, OCTETS, EventStream,
                                          JobFile, problems)
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, END, TIERS
from storyboard_cli.serve.store import JobFinal, QueueFull
from storyboard_cli.serve.wire import job_file_url

JSON_TYPES = ("application/json",)
DRAINING_RETRY_S = 30
EVENT_POLL_S = 0.2  # how often a stream looks for new events
KEEPALIVE_S = 15.0
RECONNECT_MS = 1000

IdempotencyKey = Annotated[str, Header(alias="Idempotency-Key", min_length=1, max_length=255,
                                       description="a retry with the same key and body answers the first job")]
JobFilename = Annotated[str, Header(alias="X-Job-Filename", pattern=f"^{SAFE_FILE.pattern}$",
                                    description="the job file's name: errors name it, and a job without `name:` "
                                                "is named after it")]
LastEventId = Annotated[int, Header(alias="Last-Event-ID", ge=0, le=wire.MAX_INT,
                                    description="the last event id this client saw: the stream resumes after it")]


router = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser


def view(state: ApiState, job_id: str, request: Request) -> wire.JobView:
    """The job as a client sees it: its images' URLs once done, its report's and sheet's. Raises the 404."""
    job = state.store.job(job_id, state.clock())
    if job is None:
        raise not_found(job_id)
    root = str(request.base_url).rstrip("/")

    def url(path: str) -> str:
        return root + job_file_url(job_id, path)

    runs = state.store.image_runs(job_id, state.clock())  # who rendered each image, for how long
    images = [wire.ImageView(**image, urls=[url(p) for p in image["outputs"]] if image["state"] == "done" else [],
                             **runs.get(image["id"], {})) for image in job.pop("images")]
    del job["out_dir"]
    return wire.JobView(**job, images=images, url=root + f"/v1/jobs/{job_id}", report_url=url(REPORT_JSON),
                        sheet_url=url(INDEX))


def not_found(job_id: str) -> Refused:
    return Refused(404, "no such job", f"no job {job_id}")


def final(e: JobFinal) -> Refused:
    return Refused(409, f"job {e.state}", str(e))


def _located(response: Response, job_id: str, status: int, **headers: str) -> None:
    response.status_code = status
    response.headers["Location"] = f"/v1/jobs/{job_id}"
    response.headers.update(headers)


@router.post("/v1/jobs", status_code=202, openapi_extra=JOB_BODY, responses={
    202: {"description": "accepted: every image queued (Location: the job)"},
    200: {"model": wire.JobView, "description": "the job first submitted with this Idempotency-Key "
                                                "(Idempotent-Replayed: true)"},
    **problems({422: "a job `bcg plan` refuses (file:line, shot, field), or an Idempotency-Key used for "
                     "another body", 503: "the queue is full, or the server is stopping (Retry-After)",
                507: "the server's disk is full, or under --min-free-mb: nothing of the job is kept"})})
async def submit(request: Request, response: Response, state: State, priority: wire.Priority = DEFAULT_PRIORITY,
                 idempotency_key: IdempotencyKey = None, x_job_filename: JobFilename = None) -> wire.JobView:
    """A job file (YAML or JSON, at most --max-job-kb), validated and planned as `bcg plan` does."""
    store, settings = state.store, state.settings
    if state.draining():
        raise Refused(503, "shutting down", "the server is stopping; submit to another or retry",
                      {"Retry-After": str(DRAINING_RETRY_S)})
    body = await request.body()
    json_body = request.headers.get("content-type", "").split(";")[0].strip() in JSON_TYPES
    filename = x_job_filename or ("job.json" if json_body else "job.yaml")
    if idempotency_key is not None:
        same_body = {p: content_hash(body, filename, p) for p in TIERS}
        try:  # the first job's answer, without planning again (a key retried in a loop)
            first = await run_in_threadpool(store.replay, idempotency_key, same_body[priority], same_body)
        except BadInput as e:
            raise Refused(422, "refused", str(e)) from None
        if first is not None:
            return replayed(state, first, request, response)
    job_id = uuid.uuid4().hex[:12]
    try:
        await run_in_threadpool(store.refuse_if_full, settings.max_queue_images, state.clock())
    except QueueFull as e:
        raise Refused(503, "queue full", str(e), {"Retry-After": str(e.retry_after)}) from None
    low = await run_in_threadpool(state.disk.low)
    if low is not None:
        raise state.disk.refuse(low)
    try:
        planned = await run_in_threadpool(plan_submission, settings.root, job_id, body, filename, priority,
                                          settings.inputs, state.blobs, settings.allow_models,
                                          settings.max_blob_mb << 20)
    except BadInput as e:
        raise Refused(422, "invalid job", str(e)) from None
    except BlobStoreFull as e:  # a file the job names by a server path, copied in
        raise Refused(INSUFFICIENT_STORAGE, FULL_TITLE, str(e)) from None
    try:
        new_id, created = await run_in_threadpool(store.submit, planned, idempotency_key,
                                                  settings.max_queue_images, state.clock())
    except QueueFull as e:
        _discard(planned.path.parent)
        raise Refused(503, "queue full", str(e), {"Retry-After": str(e.retry_after)}) from None
    except BadInput as e:  # an idempotency conflict, or larger than the queue
        _discard(planned.path.parent)
        raise Refused(422, "refused", str(e)) from None
    except BaseException:  # the queue's disk full (a 507, disk.py): nothing of the job is kept
        _discard(planned.path.parent)
        raise
    if not created:
        _discard(planned.path.parent)
        return replayed(state, new_id, request, response)
    job = view(state, new_id, request)
    _located(response, new_id, 202)
    return job


def replayed(state: ApiState, job_id: str, request: Request, response: Response) -> wire.JobView:
    job = view(state, job_id, request)
    _located(response, job_id, 200, **{"Idempotent-Replayed": "true"})
    return job


@router.get("/v1/jobs/{job_id}", responses=problems({404: "no such job"}))
def get_job(job_id: Id, request: Request, state: State) -> wire.JobView:
    return view(state, job_id, request)


@router.post("/v1/jobs/{job_id}/cancel", responses={
    200: {"description": "canceled: queued images at once, leased ones after their batch"},
    **problems({404: "no such job", 409: "the job is already succeeded, failed or canceled: nothing changed"})})
def cancel(job_id: Id, request: Request, state: State) -> wire.JobView:
    try:
        found = state.store.cancel(job_id, state.clock())
    except JobFinal as e:
        raise final(e) from None
    if not found:
        raise not_found(job_id)
    state.landed([job_id])
    return view(state, job_id, request)


@router.patch("/v1/jobs/{job_id}", responses={
    200: {"description": "its queued images move to the new priority"},
    **problems({404: "no such job", 409: "the job is already succeeded, failed or canceled: nothing changed"})})
def reprioritise(job_id: Id, change: wire.PriorityChange, request: Request, state: State) -> wire.JobView:
    try:
        found = state.store.set_priority(job_id, change.priority, state.clock())
    except JobFinal as e:
        raise final(e) from None
    if not found:
        raise not_found(job_id)
    return view(state, job_id, request)


@router.get("/v1/jobs/{job_id}/events", response_class=EventStream, responses={
    200: {"description": "the job's events, each as it happens; the stream ends after `end`",
          "content": {EVENT_STREAM: {"schema": EVENT}}}, **problems({404: "no such job"})})
def events(job_id: Id, state: State, last_event_id: LastEventId = 0) -> EventStream:
    """Server-sent events: each change of the job, `id:` its sequence number; a client that reconnects
    with `Last-Event-ID` gets the events after it. The stream ends after the `end` event."""
    if state.store.job(job_id, state.clock()) is None:
        raise not_found(job_id)
    return EventStream(_stream(state, job_id, last_event_id),
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(state: ApiState, job_id: str, after: int):
    yield f"retry: {RECONNECT_MS}\n\n"
    quiet = 0.0
    while not state.draining():
        rows, ended = await run_in_threadpool(state.store.events, job_id, after)
        if ended and not rows:
            return
        for seq, kind, data in rows:
            yield f"id: {seq}\nevent: {kind}\ndata: {data}\n\n"
            after = seq
            if kind == END and seq == rows[-1][0]:  # an `end` followed by more: the job was retried (queue_routes)
                return
        quiet = 0.0 if rows else quiet + EVENT_POLL_S
        if quiet >= KEEPALIVE_S:  # a comment line: proxies keep the connection, clients ignore it
            yield ": keep-alive\n\n"
            quiet = 0.0
        await asyncio.sleep(EVENT_POLL_S)


@router.get("/v1/jobs/{job_id}/files/{path:any}", response_class=JobFile, responses={
    200: {"description": "the file (PNG, the report, the contact sheet, a thumbnail, ...)", "content": FILES},
    **problems({404: "no such job, or no such file in its folder"})})
def job_file(job_id: Id, path: str, state: State) -> FileResponse:
    job = state.store.job(job_id, state.clock())
    if job is None:
        raise not_found(job_id)
    folder = Path(job["out_dir"]).resolve()
    try:
        target = (folder / path).resolve()
        found = target.is_relative_to(folder) and target.is_file()
    except (OSError, ValueError):  # a name too long, a NUL: no such file either
        found = False
    if not found:
        raise Refused(404, "no such file", f"{path} is not in the job's folder")
    return FileResponse(target, media_type=FILE_TYPES.get(target.suffix.lower(), OCTETS))


def _discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
