"""The HTTP API (FastAPI): jobs in, their state out, the workers' lease protocol, /metrics. Torch-free:
validation and planning run here without a model; rendering happens in the workers (worker.py). The app is
assembled here from its routers (blob_routes.py, job_routes.py, lease_routes.py, ops_routes.py, queue_routes.py and
ui_routes.py, the queue page): module-level
`APIRouter`s whose handlers take the one `ApiState` (api_state.py) through `Depends`, return their response model,
and raise their errors (edge.py's `Refused`).

Errors are RFC 9457 problem+json, and whatever a client or a worker sends gets a 4xx, never a 500 (edge.py:
tokens, body caps, JSON that cannot surprise the parser). A bad job is a 422 whose `detail` is the line
`bcg plan` prints (file:line, shot, field); a malformed body, header or query a 422 naming the field; a full
queue a 503 with an integer Retry-After from the measured drain rate. /openapi.json describes every answer of
every route (wire.py's models, the job body's schema, the tokens each route needs).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from storyboard_cli.serve import (blob_routes, blobs, edge, folders, intake, job_routes, lease_routes, metrics,
                                  ops_routes, queue_routes, ui_routes)
from storyboard_cli.serve.api_state import ApiState
from storyboard_cli.serve.disk import Disk
from storyboard_cli.serve.edge import PROBLEM, problem
from storyboard_cli.serve.openapi import DESCRIPTION, schema
from storyboard_cli.serve.settings import Settings
from storyboard_cli.serve.store import Store

__all__ = ["PROBLEM", "Settings", "create_app", "problem"]
log = logging.getLogger(__name__)
COLLECT_EVERY_S = 300.0  # the most seconds between two collections of unused input files


def steady_clock() -> Callable[[], float]:
    """The server's clock, in seconds since the epoch: the wall clock read once, then advanced by the monotonic one.
    A step of the machine's clock while it serves (NTP setting a freshly booted machine right, an operator) would
    otherwise expire every lease at once (forward: each image rendered twice, an attempt spent) or keep a dead
    worker's lease for the step's length (backward: its images stuck). A restart reads the wall clock again; the
    downtime counts against no lease (Store.restarted)."""
    wall, start = time.time(), time.monotonic()
    return lambda: wall + (time.monotonic() - start)


def create_app(settings: Settings, store: Store | None = None, clock: Callable[[], float] | None = None) -> FastAPI:
    """The app: the state its routers share, its edge, its routes (blobs, jobs, the workers' leases, ops), its
    lease sweep and its true /openapi.json. `clock`: the server's (`steady_clock` unless a test gives one)."""
    store = store or Store(settings.root)
    clock = clock or steady_clock()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def sweep():  # a lease lost with no worker left to ask would otherwise look held forever
            while True:
                await asyncio.sleep(settings.sweep_s or settings.lease_s / 4)
                try:
                    await run_in_threadpool(store.sweep, clock())
                except sqlite3.Error as e:  # busy for longer than the store waits: the next sweep does it
                    log.warning("lease sweep: %s", e)

        async def collect():  # input files no kept job names, past their grace period
            while True:
                await asyncio.sleep(min(max(settings.blob_grace_s / 4, 0.2), COLLECT_EVERY_S))
                try:
                    await run_in_threadpool(_collect, app.state.blobs, settings)
                except OSError as e:
                    log.warning("input files not collected: %s", e)

        await run_in_threadpool(store.restarted, clock(), settings.lease_s)  # its downtime is not its workers' fault
        for job_id in await run_in_threadpool(lambda: folders.stale_views(store.ended())):
            refresher.touch(job_id, now=True)
        cleared = await run_in_threadpool(app.state.blobs.clear_tmp)  # uploads cut short by the last stop
        if cleared:
            log.warning("removed %d partial upload(s) left by the server's last stop", cleared)
        tasks = [asyncio.create_task(sweep()), asyncio.create_task(collect())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await run_in_threadpool(refresher.close)  # the last reports and sheets written

    app = FastAPI(title="bcg serve", version="1", description=DESCRIPTION, lifespan=lifespan)
    app.state.store, app.state.draining, app.state.settings = store, False, settings
    refresher = app.state.refresher = folders.Refresher(lambda job_id: _served(store, job_id, clock()), clock)
    app.state.blobs = blobs.BlobStore(settings.root, int(settings.max_blobs_gb * (1 << 30)))
    disk = Disk(settings.root, settings.min_free_mb)
    app.state.api = ApiState(settings, store, clock, app.state.blobs, refresher, lambda: app.state.draining, disk,
                             metrics.registry(store, settings.lease_s, clock, disk, app.state.blobs))
    edge.install(app, settings)
    for error in (OSError, sqlite3.OperationalError):  # a write refused for want of space: 507 (disk.py)
        app.add_exception_handler(error, disk.answer)
    app.openapi = lambda: app.openapi_schema or schema(app, settings)
    for routes in (blob_routes, job_routes, lease_routes, ops_routes, queue_routes, ui_routes):
        app.include_router(routes.router)
    edge.fixed_paths(app)  # read once here, from the OpenAPI document: no request waits for it
    return app


def _collect(store: blobs.BlobStore, settings: Settings) -> None:
    removed, freed = store.collect(intake.kept_inputs(settings.root), settings.blob_grace_s)
    if removed:
        log.info("removed %d input file(s) no job names (%.1f MB)", removed, freed / (1 << 20))


def _served(store: Store, job_id: str, now: float) -> dict | None:
    """A job as the folder writer needs it: its view in the store and its job file."""
    job = store.job(job_id, now)
    if job is not None:
        job["path"] = str(store.job_file(job_id))
    return job
