"""The studio's routes of the API, what the queue page (/ui) reads and does: the jobs a page at a time, the workers,
the queue's summary; a job's failed images retried, a job moved to the front; a worker drained or resumed, dispatch
paused or resumed (both kept in the queue file: they survive a restart); and the one global event stream, every
job's events and the queue's own, resumed after Last-Event-ID. The same client token as the job routes. Torch-free.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from starlette.concurrency import run_in_threadpool

from storyboard_cli.folder.layout import INDEX, REPORT_JSON, thumb_name
from storyboard_cli.serve import wire
from storyboard_cli.serve.api_state import ApiState, Id, State
from storyboard_cli.serve.edge import JSONRoute, Refused
from storyboard_cli.serve.job_routes import EVENT_POLL_S, KEEPALIVE_S, RECONNECT_MS, final, not_found, view
from storyboard_cli.serve.openapi import EVENT_STREAM, QUEUE_EVENT, EventStream, problems
from storyboard_cli.serve.queue_control import MAX_EVENTS
from storyboard_cli.serve.schedule import JobState
from storyboard_cli.serve.store import JobFinal, NothingToRetry
from storyboard_cli.serve.wire import job_file_url

DEFAULT_PAGE = 50  # jobs per page
MAX_PAGE = 500

StateFilter = Annotated[list[Literal[JobState.ALL]], Query(
    alias="state", max_length=len(JobState.ALL), description="only jobs in these states (repeated: "
                                                             "`state=queued&state=running`)")]
Cursor = Annotated[str, Query(pattern=r"^[0-9]{1,18}$", description="the `next` of the page before")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="jobs on the page")]
After = Annotated[int, Query(ge=0, le=wire.MAX_INT, description="the stream starts after this id (a page opens it "
                                                                "after the `last_event` it read)")]
LastEventId = Annotated[int, Header(alias="Last-Event-ID", ge=0, le=wire.MAX_INT,
                                    description="the last id this client saw (an EventSource sends it when it "
                                                "reconnects): the stream resumes after the later of it and `after`")]
JobFilter = Annotated[str, Query(pattern=wire.NAME_PATTERN, description="only this job's events (a page's "
                                                                          "log of one job: with `follow=false`)")]
Follow = Annotated[bool, Query(description="false: the events after `after` until now, then the stream ends")]

router = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser
NO_WORKER = "no worker registered with this id (or no longer: not seen within --lease-s)"


@router.get("/v1/jobs")
def jobs(request: Request, state: State, status: StateFilter = None, cursor: Cursor = None,
         limit: Limit = DEFAULT_PAGE) -> wire.JobPage:
    """The jobs, newest first, a page at a time (`limit`, default 50): `next` is the next page's `cursor` until the
    last page. No cap on the total: the pages walk every job the queue keeps."""
    store, now = state.store, state.clock()
    last = store.last_event()  # read first: an event after it may be in the page too, but none is in neither
    page = store.jobs_page(frozenset(status) if status else None, None if cursor is None else int(cursor), limit)
    extras = store.job_rows(page.ids)
    root = str(request.base_url).rstrip("/")
    rows = [_row(root, job, extras[job_id]) for job_id in page.ids if (job := store.job(job_id, now)) is not None]
    return wire.JobPage(jobs=rows, next=None if page.next is None else str(page.next), last_event=last)


def _row(root: str, job: dict, extra: dict) -> wire.JobRow:
    job_id = job["id"]
    latest = thumbnail = None
    if extra["latest"] is not None:
        shot, path = extra["latest"]
        thumb = thumb_name(shot, path)  # the contact sheet's, once its refresh has written it
        latest = root + job_file_url(job_id, path)
        thumbnail = root + job_file_url(job_id, thumb) if (Path(job["out_dir"]) / thumb).is_file() else latest
    return wire.JobRow(
        id=job_id, name=job["name"], state=job["state"], priority=job["priority"], front=extra["front"],
        submitted=job["submitted"], finished=job["finished"], images=len(job["images"]),
        images_by_state=job["images_by_state"], queue_position=job["queue_position"], eta_s=job["eta_s"],
        workers=extra["workers"], latest_url=latest, thumbnail_url=thumbnail, url=root + f"/v1/jobs/{job_id}",
        report_url=root + job_file_url(job_id, REPORT_JSON), sheet_url=root + job_file_url(job_id, INDEX))


JOB_CHANGE = problems({404: "no such job", 409: "the job is already succeeded, failed or canceled: nothing changed"})


@router.post("/v1/jobs/{job_id}/retry", responses={
    200: {"description": "its failed images are queued again (a failed job runs again)"},
    **problems({404: "no such job", 409: "the job is canceled, or none of its images failed: nothing changed"})})
def retry(job_id: Id, request: Request, state: State) -> wire.JobView:
    """The job's failed images queued again, their attempts and reasons cleared. A failed job is open again: its
    event stream goes on after its `end` with `retried`."""
    try:
        found = state.store.retry(job_id, state.clock())
    except JobFinal as e:
        raise final(e) from None
    except NothingToRetry as e:
        raise Refused(409, "nothing to retry", str(e)) from None
    if found is None:
        raise not_found(job_id)
    return view(state, job_id, request)


@router.post("/v1/jobs/{job_id}/front", responses={
    200: {"description": "the job ranks ahead of every open job: its images are leased next"}, **JOB_CHANGE})
def to_front(job_id: Id, request: Request, state: State) -> wire.JobView:
    """Moved to the front of the queue, ahead of every job open now, whatever their priorities; a later priority
    change (PATCH) ranks it by its priority again."""
    try:
        found = state.store.to_front(job_id, state.clock())
    except JobFinal as e:
        raise final(e) from None
    if not found:
        raise not_found(job_id)
    return view(state, job_id, request)


@router.get("/v1/workers")
def workers(state: State) -> wire.WorkersView:
    """Every registered worker: its state, current batch, warm mixes, last heartbeat, images per second, GPU."""
    last = state.store.last_event()
    return wire.WorkersView(workers=_workers(state), last_event=last)


def _workers(state: ApiState) -> list[wire.WorkerView]:
    return [wire.WorkerView(**w) for w in state.store.workers_table(state.clock(), state.settings.lease_s)]


def _drain(state: ApiState, worker_id: str, draining: bool) -> wire.WorkerView:
    if state.store.drain(worker_id, state.clock(), draining) is None:
        raise Refused(404, "unknown worker", f"no worker {worker_id} is registered here")
    return next(w for w in _workers(state) if w.id == worker_id)


@router.post("/v1/workers/{worker_id}/drain", responses={
    200: {"description": "the worker is leased nothing more; its current batch finishes"},
    **problems({404: NO_WORKER})})
def drain(worker_id: Id, state: State) -> wire.WorkerView:
    """No new lease for this worker after its current batch (kept in the queue: a restart keeps it drained while its
    registration lives)."""
    return _drain(state, worker_id, True)


@router.post("/v1/workers/{worker_id}/resume", responses={
    200: {"description": "the worker is leased batches again"}, **problems({404: NO_WORKER})})
def resume_worker(worker_id: Id, state: State) -> wire.WorkerView:
    return _drain(state, worker_id, False)


@router.get("/v1/queue")
def queue(state: State) -> wire.QueueView:
    """The queue per priority (images queued and rendering, jobs, the oldest waiting image's age), whether it
    dispatches, its drain rate, its workers."""
    return _queue(state)


def _queue(state: ApiState) -> wire.QueueView:
    store, now = state.store, state.clock()
    summary, dispatch = store.summary(now), store.dispatch()
    seen, ready = store.readiness(now, state.settings.lease_s)
    return wire.QueueView(tiers=summary["tiers"], paused=dispatch.paused is not None, paused_since=dispatch.paused,
                          leases=summary["leases"], images_per_s=summary["images_per_s"], workers=seen,
                          workers_ready=ready, drained=sorted(dispatch.drained), last_event=summary["last_event"])


@router.post("/v1/queue/pause", responses={200: {"description": "no batch is leased until resumed; running ones "
                                                                "finish (kept in the queue: it survives a restart)"}})
def pause(state: State) -> wire.QueueView:
    state.store.pause(state.clock())
    return _queue(state)


@router.post("/v1/queue/resume", responses={200: {"description": "batches are leased again"}})
def resume(state: State) -> wire.QueueView:
    state.store.resume(state.clock())
    return _queue(state)


@router.get("/v1/events", response_class=EventStream, responses={
    200: {"description": "every job's events and the queue's own, each as it happens, oldest first",
          "content": {EVENT_STREAM: {"schema": QUEUE_EVENT}}}})
def events(state: State, after: After = 0, follow: Follow = True, job: JobFilter = None,
           last_event_id: LastEventId = 0) -> EventStream:
    """One stream for the whole queue (a browser allows 6 streams per host over HTTP/1.1: a page follows every job
    on this one). `id:` is monotonic; a client that reconnects with `Last-Event-ID` gets exactly the events after
    it. `retry:` says how long to wait before reconnecting; a comment line every 15 s keeps proxies from closing
    it. It ends when the server stops (or, with `follow=false`, once it has sent the events until now)."""
    return EventStream(_stream(state, max(after, last_event_id), follow, job),
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(state: ApiState, after: int, follow: bool, job: str | None):
    yield f"retry: {RECONNECT_MS}\n\n"
    quiet = 0.0
    while not state.draining():
        rows = await run_in_threadpool(state.store.events_after, after, MAX_EVENTS, job)
        for seq, _, kind, data in rows:
            yield f"id: {seq}\nevent: {kind}\ndata: {data}\n\n"
            after = seq
        if rows:
            quiet = 0.0
            continue  # a stream far behind catches up page after page
        if not follow:
            return
        quiet += EVENT_POLL_S
        if quiet >= KEEPALIVE_S:  # a comment line: proxies keep the connection, clients ignore it
            yield ": keep-alive\n\n"
            quiet = 0.0
        await asyncio.sleep(EVENT_POLL_S)
