"""The HTTP client: `bcg submit` and the worker's side of the lease protocol. Torch-free."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from storyboard_cli.errors import BadInput, JobError, StoryboardError
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, JobState

FINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED)
SUBMIT_TIMEOUT_S = 60.0


class ServerError(StoryboardError):
    """The server refused or could not be reached."""


class QueueBusy(ServerError):
    """503: the queue is full or the server is stopping; `retry_after` in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _headers(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _problem(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text


def submit(path: Path, server: str, priority: str = DEFAULT_PRIORITY, key: str | None = None,
           token: str | None = None) -> dict:
    """POSTs the job file; returns the job. A 422 is raised as the job error it carries."""
    try:
        body = Path(path).read_bytes()
    except OSError as e:
        raise JobError(str(path), None, None, None, f"cannot read: {e.strerror}") from None
    json_file = Path(path).suffix.lower() == ".json"
    headers = {**_headers(token), "Content-Type": "application/json" if json_file else "application/yaml",
               "X-Job-Filename": Path(path).name}
    if key:
        headers["Idempotency-Key"] = key
    try:
        r = httpx.post(f"{server.rstrip('/')}/v1/jobs", content=body, params={"priority": priority}, headers=headers,
                       timeout=SUBMIT_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ServerError(f"{server}: {e}") from None
    if r.status_code == 422:
        raise BadInput(_problem(r).replace(Path(path).name, str(path), 1))
    if r.status_code == 503:
        raise QueueBusy(f"{server}: {_problem(r)}", int(r.headers.get("Retry-After", "1")))
    if r.status_code not in (200, 202):
        raise ServerError(f"{server}: HTTP {r.status_code}: {_problem(r)}")
    return r.json()


def get_job(server: str, job_id: str, token: str | None = None) -> dict:
    r = httpx.get(f"{server.rstrip('/')}/v1/jobs/{job_id}", headers=_headers(token), timeout=30)
    if r.status_code != 200:
        raise ServerError(f"{server}: HTTP {r.status_code}: {_problem(r)}")
    return r.json()


def wait(server: str, job_id: str, token: str | None = None, timeout_s: float | None = None, poll_s: float = 0.5,
         on_update=None) -> dict:
    """Polls until the job is final (or the timeout passes); returns the last view of it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        job = get_job(server, job_id, token)
        if on_update:
            on_update(job)
        if job["state"] in FINAL or (deadline is not None and time.monotonic() > deadline):
            return job
        time.sleep(poll_s)


class LeaseClient:
    """The worker's calls. Connection errors are retried by the caller's loop (the server may restart)."""

    def __init__(self, server: str, token: str | None = None):
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=_headers(token), timeout=30)

    def lease(self, worker: str) -> dict | None:
        r = self.http.post("/v1/leases", json={"worker": worker})
        r.raise_for_status()
        return None if r.status_code == 204 else r.json()

    def heartbeat(self, lease_id: str) -> bool:
        return self.http.post(f"/v1/leases/{lease_id}/heartbeat").status_code == 200

    def complete(self, lease_id: str, done: list[int], cached: list[int], failed: dict[int, str]) -> bool:
        r = self.http.post(f"/v1/leases/{lease_id}/complete", json={"done": done, "cached": cached, "failed": failed})
        return r.status_code == 200

    def close(self) -> None:
        self.http.close()
