"""What /openapi.json says of `bcg serve`: FastAPI's schema made true (every error answer problem+json, the job
body and the server-sent events described, the 413 of every route with a body, the tokens each route needs on
this server), and the descriptions and content types the routes declare. Torch-free."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, StreamingResponse

from storyboard_cli.serve import edge, wire
from storyboard_cli.serve.edge import PROBLEM
from storyboard_cli.serve.queue_workers import MAX_STRIKES
from storyboard_cli.serve.settings import Settings

JOB_TYPES = ("application/yaml", "application/json")  # what /openapi.json says a job body is (any is read as YAML)
EVENT_STREAM = "text/event-stream"
FILE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".html": "text/html",
              ".json": "application/json", ".jsonl": "application/jsonl", ".md": "text/markdown",
              ".yaml": "application/yaml"}  # a job folder's files; any other is application/octet-stream
OCTETS = "application/octet-stream"

DESCRIPTION = """SDXL storyboard jobs: queue, state, outputs; and the workers' lease protocol.

Every error is `application/problem+json` (RFC 9457). With a token (`bcg serve --token`), every /v1 route needs
`Authorization: Bearer <token>`; the worker routes (/v1/workers, /v1/leases) need the worker token
(`--worker-token`, else the same), but for the studio's `GET /v1/workers` and a worker's drain and resume (the client
token), and `GET /v1/blobs/{sha256}` either. /healthz, /readyz, /metrics, this description (/docs, /redoc,
/openapi.json) and the queue page (/ui) are open."""
REF = "#/components/schemas/"
PROBLEM_CONTENT = {PROBLEM: {"schema": {"$ref": REF + "Problem"}}}
UNKNOWN_WORKER = "a worker id this server did not issue, or forgot (not seen within --lease-s): register again"
LEASE_GONE = "the lease is gone: it expired and its images went back to the queue"
NOT_HOLDER = "the lease was issued to another worker: only its holder may renew, complete or give it back"
QUARANTINED = (f"this worker is quarantined: it gave back {MAX_STRIKES} leases in a row for an error of its own "
               "machine (its device); it gets no more leases")
JOB_BODY = {"requestBody": {"required": True, "description": "the job file, at most --max-job-kb",
                            "content": {t: {"schema": {"$ref": REF + "JobDoc"}} for t in JOB_TYPES}}}
FILES = {t: {"schema": {"type": "string", "format": "binary"}} for t in (*FILE_TYPES.values(), OCTETS)}
FILE_BODY = {"requestBody": {"required": True, "description": "the file's bytes, at most --max-blob-mb",
                             "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}}
EVENT = {"type": "object", "required": ["event", "data"], "properties": {  # one server-sent event
    "event": {"type": "string", "description": "queued, running, images, lease_lost, priority, canceled; `end` last"},
    "id": {"type": "string", "pattern": "^[0-9]+$", "description": "its sequence number (Last-Event-ID)"},
    "retry": {"type": "integer"},
    "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"$ref": REF + "JobEvent"}}}}
QUEUE_EVENT = {"type": "object", "required": ["event", "data"], "properties": {  # one event of GET /v1/events
    "event": {"type": "string", "description": "a job's (queued, running, images, lease_lost, priority, front, "
                                               "retried, canceled, end) or the queue's (queue_paused, queue_resumed, "
                                               "worker_drained, worker_resumed)"},
    "id": {"type": "string", "pattern": "^[0-9]+$", "description": "its sequence number, monotonic (Last-Event-ID)"},
    "retry": {"type": "integer", "description": "milliseconds a client waits before it reconnects"},
    "data": {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"$ref": REF + "QueueEvent"}}}}
ANSWERS = {401: "the route's token is missing or wrong (WWW-Authenticate: Bearer)",
           413: "the body is larger than its cap (--max-job-kb, --max-blob-mb, 4 MB for JSON)",
           422: "a malformed body, header, path or query parameter: `detail` names it",
           507: "the server's disk is full (or its input files' store, --max-blobs-gb): nothing of the request "
                "was kept"}


WRITES = ("post", "put", "patch")  # what writes the queue or a file: a full disk answers 507


class EventStream(StreamingResponse):
    media_type = EVENT_STREAM


class JobFile(FileResponse):
    media_type = FILE_TYPES[".png"]  # what /openapi.json shows first; each file is sent with its own type


def problems(answers: dict[int, str]) -> dict:
    return {status: {"description": why, "content": PROBLEM_CONTENT} for status, why in answers.items()}


def schema(app: FastAPI, settings: Settings) -> dict:
    """FastAPI's schema, made true: every error answer problem+json, the job body and Problem as components
    (FastAPI's own validation-error models gone: edge.py answers those), the 413 of every route with a body,
    and the tokens each route needs on this server (none when it has none)."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        models.pop(name, None)
    models.update(wire.component_schemas((wire.JobDoc, wire.JobEvent, wire.QueueEvent, wire.Problem)))
    schemes = {name: {"type": "http", "scheme": "bearer", "description": f"the {name} token"}
               for name, token in edge.tokens(settings).items() if token}
    if schemes:
        components["securitySchemes"] = schemes
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            answers = op["responses"]
            for status, why in ANSWERS.items():
                needed = {401: bool(edge.guarded(method.upper(), path, settings)), 413: "requestBody" in op,
                          422: str(status) in answers, 507: method in WRITES}[status]
                if needed and not (status == 507 and str(status) in answers):  # a route's own wording stays
                    answers[str(status)] = {"description": why, "content": PROBLEM_CONTENT}
            needs = edge.guarded(method.upper(), path, settings)
            if needs:
                op["security"] = [{name: []} for name in needs]
    app.openapi_schema = doc
    return doc
