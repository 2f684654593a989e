"""The HTTP client of `bcg submit`: the job's files uploaded, the job sent, its events followed (the worker's side of
the lease protocol is lease_client.py). Torch-free, and without pydantic until a job names files."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import yaml

from storyboard_cli.errors import BadInput, JobError, StoryboardError
from storyboard_cli.job.digests import file_sha256
from storyboard_cli.job.file import named_files
from storyboard_cli.job.inputs import INPUTS_KEY
from storyboard_cli.serve.schedule import DEFAULT_PRIORITY, END, JobState

SUBMIT_TIMEOUT_S = 60.0
UPLOAD_CHUNK = 1 << 20
RECONNECTS = 5  # an event stream reopened this many times in a row before falling back to polling
STREAM_READ_TIMEOUT_S = 60.0  # the server sends a keep-alive every 15 s


class ServerError(StoryboardError):
    """The server refused or could not be reached."""


class QueueBusy(ServerError):
    """503: the queue is full or the server is stopping; `retry_after` in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def headers_for(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def problem_of(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text


def local_inputs(path: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The files the job names that exist here (name as the job writes it -> file) and their sha256s. A name
    with no file here is left to the server (a path under its own folders)."""
    job_dir = Path(path).resolve().parent
    files = {}
    for name in named_files(path):
        file = (job_dir / Path(name).expanduser()).resolve()
        if file.is_file():
            files[name] = file
    return files, {name: file_sha256(file) for name, file in files.items()}


def with_inputs(text: str, digests: dict[str, str]) -> str:
    """The job text with a top-level `inputs:` naming each file by its sha256, added after the last line so
    that every line an error can name keeps its number. A job that has `inputs:` already is left as it is."""
    if not digests:
        return text
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text  # the server says what is wrong with it, at its line
    if not isinstance(node, yaml.MappingNode) or any(k.value == INPUTS_KEY for k, _ in node.value):
        return text
    entries = {name: digests[name] for name in sorted(digests)}
    if node.flow_style:  # a JSON (or flow-style YAML) job: one more key before the closing brace
        body = text.rstrip()
        if not body.endswith("}"):
            return text
        return body[:-1] + f', "{INPUTS_KEY}": {json.dumps(entries)}}}' + "\n"
    lines = "".join(f"  {json.dumps(name)}: {digest}\n" for name, digest in entries.items())
    return text + ("" if text.endswith("\n") else "\n") + f"{INPUTS_KEY}:  # added by bcg submit\n" + lines


def upload_inputs(http: httpx.Client, files: dict[str, Path], digests: dict[str, str]) -> list[tuple[str, int]]:
    """Sends the files the server lacks (POST /v1/blobs/missing, then PUT /v1/blobs/{sha256} each, streamed);
    the (name, bytes) of each file sent."""
    if not digests:
        return []
    from storyboard_cli.serve import wire  # pydantic: here, so that a job without files is sent without it

    query = wire.BlobQuery(digests=sorted(set(digests.values())))
    r = http.post("/v1/blobs/missing", content=query.model_dump_json(), headers={"Content-Type": "application/json"})
    _raise_for(r)
    missing, sent = set(wire.BlobsMissing.model_validate_json(r.content).missing), []
    for name, digest in digests.items():
        if digest not in missing:
            continue
        missing.discard(digest)
        size = files[name].stat().st_size
        with open(files[name], "rb") as f:
            r = http.put(f"/v1/blobs/{digest}", content=iter(lambda: f.read(UPLOAD_CHUNK), b""),
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                         timeout=httpx.Timeout(SUBMIT_TIMEOUT_S, write=None))
        if r.status_code in (413, 422):
            raise BadInput(f"{name}: {problem_of(r)}")
        _raise_for(r)
        sent.append((name, wire.BlobStored.model_validate_json(r.content).size))
    return sent


def _raise_for(r: httpx.Response) -> None:
    if r.status_code == 503:
        raise QueueBusy(f"{r.request.url.host}: {problem_of(r)}", int(r.headers.get("Retry-After", "1")))
    if r.status_code >= 300:
        raise ServerError(f"{r.request.url}: HTTP {r.status_code}: {problem_of(r)}")


def submit(path: Path, server: str, priority: str = DEFAULT_PRIORITY, key: str | None = None,
           token: str | None = None, on_inputs: Callable[[list[tuple[str, int]], int], None] | None = None) -> dict:
    """Uploads the files the job names that the server lacks, then POSTs the job naming them by sha256;
    returns the job. A 422 is raised as the job error it carries, with this machine's path for the job file.
    `on_inputs(sent, present)`: the files uploaded (name, bytes) and how many the server had already."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(str(path), None, None, None, f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        text = None  # not UTF-8: the server names the byte
    try:
        with httpx.Client(base_url=server.rstrip("/"), headers=headers_for(token), timeout=SUBMIT_TIMEOUT_S) as http:
            if text is not None:
                files, digests = local_inputs(path)
                sent = upload_inputs(http, files, digests)
                if on_inputs and digests:
                    on_inputs(sent, len(set(digests.values())) - len(sent))
                body = with_inputs(text, digests).encode()
            else:
                body = path.read_bytes()
            headers = {"Content-Type": "application/json" if path.suffix.lower() == ".json" else "application/yaml",
                       "X-Job-Filename": path.name}
            if key:
                headers["Idempotency-Key"] = key
            r = http.post("/v1/jobs", content=body, params={"priority": priority}, headers=headers)
    except httpx.HTTPError as e:
        raise ServerError(f"{server}: {e}") from None
    if r.status_code in (413, 422):
        raise BadInput(problem_of(r).replace(path.name, str(path), 1))
    if r.status_code == 503:
        raise QueueBusy(f"{server}: {problem_of(r)}", int(r.headers.get("Retry-After", "1")))
    if r.status_code not in (200, 202):
        raise ServerError(f"{server}: HTTP {r.status_code}: {problem_of(r)}")
    return r.json()


def get_job(server: str, job_id: str, token: str | None = None) -> dict:
    r = httpx.get(f"{server.rstrip('/')}/v1/jobs/{job_id}", headers=headers_for(token), timeout=30)
    if r.status_code != 200:
        raise ServerError(f"{server}: HTTP {r.status_code}: {problem_of(r)}")
    return r.json()


@dataclass(frozen=True)
class Event:
    id: int
    kind: str  # queued, running, images, lease_lost, priority, end
    data: dict  # job, state, at, images_by_state, and the kind's own fields


def events(server: str, job_id: str, token: str | None = None, last_id: int | None = None,
           reconnects: int = RECONNECTS, timeout_s: float | None = None) -> Iterator[Event]:
    """The job's server-sent events until its `end` event. A dropped connection is opened again with
    `Last-Event-ID` (up to `reconnects` times in a row), so no event is lost or repeated. Raises
    ServerError when the stream cannot be had (an older server: 404), or the timeout passes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failures = 0
    while True:
        headers = {**headers_for(token), "Accept": "text/event-stream"}
        if last_id is not None:
            headers["Last-Event-ID"] = str(last_id)
        try:
            with httpx.stream("GET", f"{server.rstrip('/')}/v1/jobs/{job_id}/events", headers=headers,
                              timeout=httpx.Timeout(10.0, read=STREAM_READ_TIMEOUT_S)) as r:
                if r.status_code != 200:
                    r.read()
                    raise ServerError(f"{server}: events of job {job_id}: HTTP {r.status_code}: {problem_of(r)}")
                for event in _parse(r.iter_lines()):
                    failures = 0
                    last_id = event.id
                    yield event
                    if event.kind == END:
                        return
                    if deadline is not None and time.monotonic() > deadline:
                        raise ServerError(f"{server}: job {job_id} not done within {timeout_s:.0f} s")
        except httpx.HTTPError as e:
            failures += 1
            if failures > reconnects:
                raise ServerError(f"{server}: events of job {job_id}: {e}") from None
            time.sleep(min(0.2 * 2 ** failures, 5.0))
            continue
        failures += 1  # the server closed the stream before the end (it is stopping): reconnect
        if failures > reconnects:
            raise ServerError(f"{server}: the event stream of job {job_id} kept closing before its end")
        time.sleep(min(0.2 * 2 ** failures, 5.0))


def _parse(lines: Iterator[str]) -> Iterator[Event]:
    """text/event-stream lines -> events (fields id, event, data; comments and retry ignored)."""
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in fields and "id" in fields:
                yield Event(int(fields["id"]), fields.get("event", "message"), json.loads(fields["data"]))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value


def wait(server: str, job_id: str, token: str | None = None, timeout_s: float | None = None, poll_s: float = 0.5,
         on_event: Callable[[Event], None] | None = None) -> dict:
    """Follows the job's events until it is final (polling when the server has no stream, or it keeps
    failing); returns the job's last view."""
    start = time.monotonic()
    try:
        for event in events(server, job_id, token, timeout_s=timeout_s):
            if on_event:
                on_event(event)
    except ServerError:
        left = None if timeout_s is None else max(timeout_s - (time.monotonic() - start), 0.0)
        return poll(server, job_id, token, left, poll_s)
    return get_job(server, job_id, token)


def poll(server: str, job_id: str, token: str | None = None, timeout_s: float | None = None,
         poll_s: float = 0.5) -> dict:
    """Polls until the job is final (or the timeout passes); returns the last view of it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        job = get_job(server, job_id, token)
        if job["state"] in JobState.FINAL or (deadline is not None and time.monotonic() > deadline):
            return job
        time.sleep(poll_s)
