"""The HTTP API (FastAPI): jobs in, their state out, the workers' lease protocol, /metrics. Torch-free:
validation and planning run here without a model; rendering happens in the workers (worker.py).

Errors are RFC 9457 problem+json. A bad job is a 422 whose `detail` is the line `bcg plan` prints
(file:line, shot, field); a full queue a 503 with an integer Retry-After from the measured drain rate.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from storyboard_cli.errors import BadInput
from storyboard_cli.folder.layout import INDEX, REPORT_JSON
from storyboard_cli.serve import blobs, metrics, uploads
from storyboard_cli.serve.intake import content_hash, plan_submission, stored_inputs
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, END
from storyboard_cli.serve.store import LATE, QueueFull, Store, Work

PROBLEM = "application/problem+json"
JSON_TYPES = ("application/json",)
DRAINING_RETRY_S = 30
EVENT_STREAM = "text/event-stream"
EVENT_POLL_S = 0.2  # how often a stream looks for new events
KEEPALIVE_S = 15.0
RECONNECT_MS = 1000
log = logging.getLogger(__name__)


@dataclass
class Settings:
    root: Path
    max_queue_images: int = 1000
    lease_s: float = 60.0
    token: str | None = None  # required as `Authorization: Bearer <token>` when set
    inputs: tuple[Path, ...] = ()  # folders besides root that jobs may read (control images, LoRAs, models)
    sweep_s: float | None = None  # how often expired leases are ended without a worker's call (None: lease_s / 4)
    worker_token: str | None = None  # guards the worker routes (registration, leases); None: the client token
    max_job_kb: int = 1024  # a larger job body is a 413, refused before it is parsed
    max_blob_mb: int = 2048  # a larger input file (PUT /v1/blobs/{sha256}) is a 413
    max_workers: int = 64  # registered workers at once (each has its own metric series)
    allow_models: tuple[str, ...] = ()  # hub ids (owner/name) jobs may name; none by default


def problem(status: int, title: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"type": "about:blank", "title": title, "status": status, "detail": detail},
                        status_code=status, media_type=PROBLEM, headers=headers)


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

    app = FastAPI(title="bcg serve", version="1", description="SDXL storyboard jobs: queue, state, outputs.",
                  lifespan=lifespan)
    app.state.store, app.state.draining, app.state.settings = store, False, settings
    registry = metrics.registry(store, settings.lease_s, clock)
    app.state.blobs = blobs.BlobStore(settings.root)
    app.include_router(blobs.router(lambda r: r.app.state.blobs, lambda r: settings.max_blob_mb << 20))

    @app.middleware("http")
    async def auth(request: Request, call_next):
        open_paths = ("/healthz", "/readyz", "/metrics")
        if settings.token and request.url.path not in open_paths \
                and request.headers.get("authorization") != f"Bearer {settings.token}":
            return problem(401, "unauthorized", "this server needs `Authorization: Bearer <token>`")
        return await call_next(request)

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
        return problem(404, "no such job", f"no job {job_id!r}")

    @app.post("/v1/jobs", status_code=202)
    async def submit(request: Request, priority: str = DEFAULT_PRIORITY,
                     idempotency_key: str | None = Header(None),
                     x_job_filename: str | None = Header(None)):
        if app.state.draining:
            return problem(503, "shutting down", "the server is stopping; submit to another or retry",
                           {"Retry-After": str(DRAINING_RETRY_S)})
        body = await request.body()
        json_body = request.headers.get("content-type", "").split(";")[0].strip() in JSON_TYPES
        filename = x_job_filename or ("job.json" if json_body else "job.yaml")
        if idempotency_key is not None:
            try:  # the first job's answer, without planning again (a key retried in a loop)
                first = store.replay(idempotency_key, content_hash(body, filename, priority))
            except BadInput as e:
                return problem(422, "refused", str(e))
            if first is not None:
                return await _replay(first, request)
        job_id = uuid.uuid4().hex[:12]
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
            return await _replay(new_id, request)
        return JSONResponse(view(new_id, request), status_code=202, headers={"Location": f"/v1/jobs/{new_id}"})

    async def _replay(job_id: str, request: Request) -> JSONResponse:
        return JSONResponse(view(job_id, request), status_code=200,
                            headers={"Location": f"/v1/jobs/{job_id}", "Idempotent-Replayed": "true"})

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, request: Request):
        job = view(job_id, request)
        return job if job is not None else not_found(job_id)

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str, request: Request):
        if not store.cancel(job_id, clock()):
            return not_found(job_id)
        return view(job_id, request)

    @app.patch("/v1/jobs/{job_id}")
    async def reprioritise(job_id: str, request: Request):
        body = await request.json()
        try:
            found = store.set_priority(job_id, str(body.get("priority")) if isinstance(body, dict) else "", clock())
        except BadInput as e:
            return problem(422, "invalid priority", str(e))
        return view(job_id, request) if found else not_found(job_id)

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, last_event_id: str | None = Header(None)):
        """Server-sent events: each change of the job, `id:` its sequence number; a client that reconnects
        with `Last-Event-ID` gets the events after it. The stream ends after the `end` event."""
        if store.job(job_id, clock()) is None:
            return not_found(job_id)
        try:
            after = int(last_event_id or 0)
        except ValueError:
            return problem(422, "bad Last-Event-ID", f"Last-Event-ID must be an event id, got {last_event_id!r}")
        return StreamingResponse(_stream(job_id, after), media_type=EVENT_STREAM,
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

    @app.get("/v1/jobs/{job_id}/files/{path:path}")
    def job_file(job_id: str, path: str):
        job = store.job(job_id, clock())
        if job is None:
            return not_found(job_id)
        folder = Path(job["out_dir"]).resolve()
        target = (folder / path).resolve()
        if not target.is_relative_to(folder) or not target.is_file():
            return problem(404, "no such file", f"{path} is not in the job's folder")
        return FileResponse(target)

    # the workers' protocol: lease a batch, heartbeat while rendering it, complete it

    @app.post("/v1/leases")
    async def lease(request: Request):
        body = await request.json()
        if app.state.draining:
            return Response(status_code=204)
        got = store.lease(str(body.get("worker", "?")), clock(), settings.lease_s, _gpu(body), _ready(body))
        if got is None:
            return Response(status_code=204)
        for job in got["jobs"].values():  # for a worker that does not share the server's filesystem
            job["job_file"], job["job_text"] = Path(job["path"]).name, Path(job["path"]).read_text(encoding="utf-8")
            job["inputs"] = stored_inputs(Path(job["path"]))  # the job's files by sha256: GET /v1/blobs/{sha256}
        for image in got["images"]:
            image["twin_url"] = f"/v1/jobs/{image['twin_of'][0]}/files/{image['twin_of'][1]}" if image["twin_of"] \
                else None
        return got

    @app.put("/v1/leases/{lease_id}/files/{job_id}/{path:path}")
    async def upload(lease_id: str, job_id: str, path: str, request: Request):
        """A worker without the server's filesystem sends a PNG of its lease (or a job's report)."""
        held = store.lease_outputs(lease_id, clock())
        if held is None:
            return problem(410, "lease lost", "the lease expired; its images went back to the queue")
        if job_id not in held:
            return problem(422, "not this lease's job", f"the lease holds no image of job {job_id!r}")
        data = await request.body()
        try:
            await run_in_threadpool(uploads.store_file, held[job_id][1], held[job_id][2], path, data)
        except BadInput as e:
            return problem(422, "not this lease's file", str(e))
        return {"stored": path}

    @app.post("/v1/leases/{lease_id}/heartbeat")
    async def heartbeat(lease_id: str, request: Request):
        body = await request.json() if await request.body() else {}
        worker = str(body["worker"]) if "worker" in body else None
        if not store.heartbeat(lease_id, clock(), settings.lease_s, worker, _gpu(body), _ready(body)):
            return problem(410, "lease lost", "the lease expired; its images went back to the queue")
        return {"lease": lease_id}

    @app.post("/v1/leases/{lease_id}/complete")
    async def complete(lease_id: str, request: Request):
        body = await request.json()
        work = Work(tuple((str(b["shape"]), int(b["images"]), float(b["seconds"])) for b in body.get("batches", [])),
                    int(body.get("out_of_memory", 0)), int(body.get("model_loads", 0)))
        if body.get("manifest"):  # an uploading worker's images: their lines and the sheet, before they count
            held = store.lease_outputs(lease_id, clock())
            if held is None:
                store.count(LATE)
                return problem(410, "lease lost", "the lease expired before this completion; it is ignored")
            try:
                for job_id, lines in dict(body["manifest"]).items():
                    if job_id not in held:
                        raise BadInput(f"the lease holds no image of job {job_id!r}")
                    await run_in_threadpool(uploads.record, held[job_id][1], held[job_id][0], held[job_id][2],
                                            list(lines))
            except BadInput as e:
                return problem(422, "bad manifest", str(e))
        ok = store.complete(lease_id, [int(i) for i in body.get("done", [])], [int(i) for i in body.get("cached", [])],
                            {int(k): str(v) for k, v in body.get("failed", {}).items()}, clock(), work)
        if not ok:
            return problem(410, "lease lost", "the lease expired before this completion; it is ignored")
        return {"lease": lease_id}

    @app.get("/metrics")
    def scrape():
        return Response(metrics.exposition(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    def healthz():
        """Liveness and admission: 200 while the server accepts jobs (with or without workers), 503 while it
        drains. What a load balancer routes submissions on."""
        if app.state.draining:
            return problem(503, "draining", "the server is stopping: it admits no job")
        return {"ok": True}

    @app.get("/readyz")
    def readyz():
        """Ready: at least one worker seen within --lease-s has its model loaded and its graphs captured (it
        says so with each lease request and heartbeat)."""
        if app.state.draining:
            return problem(503, "draining", "the server is stopping")
        seen, ready = store.readiness(clock(), settings.lease_s)
        if not ready:
            reason = (f"{seen} worker(s) seen in the last {settings.lease_s:g} s, none has its graphs captured yet "
                      "(a worker loads its model and captures them with its first batch)" if seen else
                      f"no worker seen in the last {settings.lease_s:g} s")
            return problem(503, "no ready worker", reason)
        return {"ready": True, "workers": seen, "workers_ready": ready}

    return app


def _gpu(body: dict) -> dict | None:
    """The GPU figures a worker sent: numbers only (a CPU worker sends none)."""
    gpu = body.get("gpu")
    if not isinstance(gpu, dict):
        return None
    return {k: float(v) for k, v in gpu.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _ready(body: dict) -> bool:
    """Whether the worker has its model loaded and its graphs captured (a worker that does not say: no)."""
    return body.get("ready") is True


def _discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
