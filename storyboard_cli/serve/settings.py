"""What `bcg serve` was started with, as the app and its edge read it (`--max-job-kb`, the tokens, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    min_free_mb: int = 512  # free space kept on the root's disk: below it no new job or input file, and not ready
    max_blobs_gb: float = 100.0  # the stored input files' total size (507 above)
    blob_grace_s: float = 3600.0  # an input file no job names is removed this long after its upload or last use

    def __post_init__(self):
        self.root = Path(self.root).resolve()  # once, at start: what the server stores is relative to it
