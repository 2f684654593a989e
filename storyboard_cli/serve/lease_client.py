"""The worker's side of the lease protocol over HTTP: each call sends a `wire` model and parses the answer into one
(the models the server's routes take and return). `bcg submit` (client.py) does not import it, so it starts
without pydantic. Torch-free."""

from __future__ import annotations

import httpx
from pydantic import BaseModel

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import wire
from storyboard_cli.serve.client import QueueBusy, ServerError, headers_for, problem_of

JSON = {"Content-Type": "application/json"}


class Unregistered(ServerError):
    """404 on a lease or heartbeat: the server did not issue this worker id (it restarted on a fresh root) or
    forgot it (not seen within --lease-s). The worker registers again."""


class Quarantined(ServerError):
    """403 on a lease request: the server quarantined this worker (it gave back too many leases in a row for
    errors of its own machine). It cannot render here: exit 2, as a worker that cannot start."""

    exit_code = 2


class ServerFull(ServerError):
    """507: the server's disk is full (its detail). On an uploaded PNG, the lease's images not sent go back to the
    queue with the completion; on a lease request, a completion or a give-back (the queue itself cannot be
    written), the worker asks again later. The server leases no batch until space is freed."""


class LeaseClient:
    """The worker's calls. Connection errors are retried by the caller's loop (the server may restart)."""

    def __init__(self, server: str, token: str | None = None):
        self.server = server
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=headers_for(token), timeout=30)

    def _post(self, path: str, body: BaseModel) -> httpx.Response:
        return self.http.post(path, content=body.model_dump_json(exclude_unset=True), headers=JSON)

    def register(self, name: str) -> wire.Registered:
        """The worker id the server issues for this worker (named in its leases and heartbeats), and the server's
        --lease-s (a registration not seen for that long is forgotten). Raises
        QueueBusy while the server has --max-workers registered, BadInput for a name it refuses."""
        r = self.http.post("/v1/workers", content=wire.Registration.model_construct(name=name).model_dump_json(),
                           headers=JSON)  # constructed unchecked: the server names what is wrong with the name
        if r.status_code == 503:
            raise QueueBusy(f"{self.server}: {problem_of(r)}", int(r.headers.get("Retry-After", "1")))
        if r.status_code == 422:
            raise BadInput(f"worker name {name[:80]!r}: {problem_of(r)}")
        if r.status_code != 201:
            raise ServerError(f"{self.server}: registering worker {name[:80]!r}: HTTP {r.status_code}: "
                              f"{problem_of(r)}")
        return wire.Registered.model_validate_json(r.content)

    def lease(self, report: wire.WorkerReport) -> wire.Lease | None:
        """The next batch, or None. Raises Unregistered, Quarantined, ServerFull."""
        r = self._post("/v1/leases", report)
        self._registered(r, report.worker)
        if r.status_code == 507:
            raise ServerFull(f"{self.server}: {problem_of(r)}")
        if r.status_code == 403:
            raise Quarantined(f"{self.server}: {problem_of(r)}")
        r.raise_for_status()
        return None if r.status_code == 204 else wire.Lease.model_validate_json(r.content)

    def heartbeat(self, lease_id: str, report: wire.WorkerReport) -> bool:
        """False when the lease is gone (or not this worker's); raises Unregistered."""
        r = self._post(f"/v1/leases/{lease_id}/heartbeat", report)
        self._registered(r, report.worker)
        return r.status_code == 200 and wire.LeaseAck.model_validate_json(r.content).lease == lease_id

    def _registered(self, r: httpx.Response, worker: str) -> None:
        if r.status_code == 404:  # the lease routes answer 404 only for a worker id they do not know
            raise Unregistered(f"{self.server}: worker {worker}: {problem_of(r)}")

    def complete(self, lease_id: str, completion: wire.Completion) -> bool:
        """The lease's results (lease_session.py's `Outcome.completion`). False when the lease is gone; ServerError
        when the server refused the completion (its detail)."""
        return self._acked(self._post(f"/v1/leases/{lease_id}/complete", completion), lease_id, "completing")

    def give_back(self, lease_id: str, failure: wire.LeaseFailure) -> bool:
        """The lease given back for an error of this worker's machine (its images are queued again, their attempts
        kept; a strike against this worker). False when the lease is gone; ServerError when refused."""
        return self._acked(self._post(f"/v1/leases/{lease_id}/fail", failure), lease_id, "giving back")

    def _acked(self, r: httpx.Response, lease_id: str, doing: str) -> bool:
        if r.status_code == 410:
            return False
        if r.status_code == 507:
            raise ServerFull(f"{self.server}: {doing} lease: {problem_of(r)}")
        if r.status_code != 200:
            raise ServerError(f"{self.server}: {doing} lease: HTTP {r.status_code}: {problem_of(r)}")
        return wire.LeaseAck.model_validate_json(r.content).lease == lease_id

    def upload(self, lease_id: str, worker: str, job_id: str, path: str, data: bytes) -> bool:
        """One output file of the lease (of one of its jobs), for a server whose filesystem this worker does
        not share; `worker`: this worker's id (the lease's holder). False when the lease is gone; ServerFull when
        the server's disk is."""
        r = self.http.put(f"/v1/leases/{lease_id}/files/{job_id}/{path}", content=data, params={"worker": worker},
                          headers={"Content-Type": "application/octet-stream"})
        if r.status_code == 410:
            return False
        if r.status_code == 507:
            raise ServerFull(f"{self.server}: {problem_of(r)}")
        r.raise_for_status()
        return wire.StoredOutput.model_validate_json(r.content).stored == path

    def download(self, url_path: str) -> bytes | None:
        """A file the server serves (a twin's PNG); None when it is gone."""
        r = self.http.get(url_path)
        return r.content if r.status_code == 200 else None

    def close(self) -> None:
        self.http.close()
