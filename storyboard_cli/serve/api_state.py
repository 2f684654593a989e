"""What the API's routers share (job_routes.py, lease_routes.py, ops_routes.py; api.py builds it): the store, the
settings, the clock, the blob store, whether the server is stopping, the job folders' refresher. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Iterable

from fastapi import Path as PathParam

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

    def landed(self, job_ids: Iterable[str]) -> None:
        """Batches of these jobs landed (or they ended): their reports and sheets are rebuilt."""
        for job_id in job_ids:
            state = self.store.job_state(job_id)
            self.refresher.touch(job_id, now=state is None or state in JobState.FINAL)
