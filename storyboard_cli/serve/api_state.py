"""What the API's routers share (blob_routes.py, job_routes.py, lease_routes.py, ops_routes.py; api.py builds it
once per app): the store, the settings, the clock, the blob store, whether the server is stopping, the job folders'
refresher, the disk, the metrics registry. A route takes it as a parameter (`State`, through `Depends`), never from
a closure. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Iterable

from fastapi import Depends, Request
from fastapi import Path as PathParam
from prometheus_client import CollectorRegistry

from storyboard_cli.serve import wire
from storyboard_cli.serve.blobs import BlobStore
from storyboard_cli.serve.disk import Disk
from storyboard_cli.serve.folders import Refresher
from storyboard_cli.serve.schedule import JobState
from storyboard_cli.serve.settings import Settings
from storyboard_cli.serve.store import Store

Id = Annotated[str, PathParam(pattern=wire.NAME_PATTERN, description="an id this server issued")]


@dataclass(frozen=True)
class ApiState:
    settings: Settings
    store: Store
    clock: Callable[[], float]
    blobs: BlobStore
    refresher: Refresher
    draining: Callable[[], bool]  # app.state.draining: set when `bcg serve` stops (server.py)
    disk: Disk
    registry: CollectorRegistry  # what /metrics reads (metrics.py)

    def landed(self, job_ids: Iterable[str]) -> None:
        """Batches of these jobs landed (or they ended): their reports and sheets are rebuilt."""
        for job_id in job_ids:
            state = self.store.job_state(job_id)
            self.refresher.touch(job_id, now=state is None or state in JobState.FINAL)


def api_state(request: Request) -> ApiState:
    """The app's `ApiState` (api.py puts it on `app.state.api`)."""
    return request.app.state.api


State = Annotated[ApiState, Depends(api_state)]
