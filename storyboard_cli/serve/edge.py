"""What every request to `bcg serve` meets before a route runs, and what every error looks like. Torch-free.

- The token its path needs (401): the worker token for /v1/workers and /v1/leases (but the studio's list of
  workers and a worker's drain and resume: the client token), either token for
  GET /v1/blobs/{sha256}, the client token for the rest of /v1 (and any unknown path). /healthz, /readyz,
  /metrics, the API's description (/docs, /redoc, /openapi.json: no job data in them, and a studio's proxy
  and tools can read the schema) and the queue page's static file (/ui) stay open.
- Its body's cap (413): a job body --max-job-kb, a PUT of a file --max-blob-mb, any other body JSON_CAP. A
  Content-Length over the cap is refused before a byte is read; a body without one is counted as it arrives
  and refused at the first chunk past the cap, the rest left unread.
- JSON parsed without Python's surprises: an integer of more digits than any 64-bit one, NaN or Infinity,
  a lone surrogate escape, or nesting past the parser's depth is a 422, never a 500; a number without a
  fraction (2.0) is an integer, as JSON Schema counts them.
- Every error is RFC 9457 problem+json with a one-line detail that shows no Python repr and no server path; a
  route raises it (`Refused`) and returns only its model.
- A client that goes away mid-body is one log line, not a traceback (what it sent is dropped by the route).
- A file path in a route (`{path:any}`) takes every character, a newline or a control character too, so that the
  route answers it (its own 404 or 422), not the router's "no route" (Starlette's `path` stops at a newline).
"""

from __future__ import annotations

import hmac
import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import ClientDisconnect
from starlette.routing import Match

if TYPE_CHECKING:
    from storyboard_cli.serve.settings import Settings

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"
JSON_CAP = 4 << 20  # bytes: any body but a job's or a file's
MAX_INT_DIGITS = 40  # a JSON integer longer than this is no 64-bit integer (pydantic checks the exact bounds)
MAX_DETAIL = 300  # characters of a problem's detail
MAX_ERRORS = 3  # validation errors named in one detail
METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what a 405's Allow may name
OPEN = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                  "/ui"})  # /ui: the queue page's static file, no job data (it asks for the token itself)
STUDIO_WORKER_ROUTES = ("/drain", "/resume")  # POST /v1/workers/{id}/drain and /resume: the client token's
CLIENT, WORKER = "client", "worker"  # the two tokens, as the OpenAPI security schemes name them


class AnyPath(Convertor):
    """`{name:any}`: the rest of the URL's path, whatever its characters."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("any", AnyPath())


def problem(status: int, title: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"type": "about:blank", "title": title, "status": status, "detail": one_line(detail)},
                        status_code=status, media_type=PROBLEM, headers=headers)


class Refused(Exception):
    """A route's answer other than its model: one problem, raised where the route finds it (`refused` answers it),
    so that a handler returns only its model."""

    def __init__(self, status: int, title: str, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.title, self.detail, self.headers = status, title, detail, headers

    def answer(self) -> JSONResponse:
        return problem(self.status, self.title, self.detail, self.headers)


async def refused(request: Request, e: Refused) -> JSONResponse:
    return e.answer()


def one_line(text: str, limit: int = MAX_DETAIL) -> str:
    """`text` on one line, at most `limit` characters, encodable as UTF-8 (a client's lone surrogate is not)."""
    text = " ".join(str(text).split())
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def guard(method: str, path: str) -> tuple[str, ...]:
    """The tokens any one of which opens `method path` (a route's path or its template); () for none."""
    if path in OPEN:
        return ()
    if (path == "/v1/workers" and method in ("GET", "HEAD")
            or path.startswith("/v1/workers/") and path.endswith(STUDIO_WORKER_ROUTES)):
        return (CLIENT,)  # the studio reads and drains its workers; the workers' own protocol is the worker token's
    if path == "/v1/workers" or path.startswith(("/v1/workers/", "/v1/leases")):
        return (WORKER,)
    if method in ("GET", "HEAD") and path.startswith("/v1/blobs/") and path != "/v1/blobs/missing":
        return (CLIENT, WORKER)
    return (CLIENT,)


def tokens(settings: Settings) -> dict[str, str | None]:
    return {CLIENT: settings.token, WORKER: settings.worker_token or settings.token}


def guarded(method: str, path: str, settings: Settings) -> tuple[str, ...]:
    """The tokens `method path` needs on this server; () when it is open (any of its tokens unset)."""
    names, values = guard(method, path), tokens(settings)
    return names if names and all(values[n] for n in names) else ()


def body_cap(method: str, path: str, settings: Settings) -> tuple[int, str]:
    """(bytes, the option that sets them) for a request's body."""
    if path == "/v1/jobs":
        return settings.max_job_kb << 10, "--max-job-kb"
    if method == "PUT" and path.startswith(("/v1/blobs/", "/v1/leases/")):
        return settings.max_blob_mb << 20, "--max-blob-mb"
    return JSON_CAP, "the limit of a JSON body"


class BodyTooLarge(HTTPException):
    def __init__(self, cap: int, option: str):
        super().__init__(413, f"the body is larger than {_size(cap)} ({option})")


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KB"


class Edge:
    """ASGI middleware: the token, then the body's cap, before the app sees the request."""

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path, headers = scope["method"], scope["path"], Headers(scope=scope)
        names = guarded(method, path, self.settings)
        if names and not _authorized(headers.get("authorization", ""), [tokens(self.settings)[n] for n in names]):
            which = " or ".join(f"the {n} token" for n in names)
            return await problem(401, "unauthorized", f"this route needs `Authorization: Bearer <token>` with {which}",
                                 {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        fixed = fixed_paths(scope["app"]).get(path) if "app" in scope else None
        if fixed is not None and method not in fixed:
            return await not_allowed(method, path, fixed)(scope, receive, send)
        cap, option = body_cap(method, path, self.settings)
        declared = headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
            return await problem(413, "body too large", BodyTooLarge(cap, option).detail)(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > cap:
                raise BodyTooLarge(cap, option)  # answered by http_error; the rest of the body is never read
            return message

        await self.app(scope, counted, send)


def _authorized(header: str, wanted: list[str]) -> bool:
    got = header.encode("latin-1")  # as the server decoded it; compared in constant time
    return any(hmac.compare_digest(got, f"Bearer {t}".encode()) for t in wanted)


# ---------------------------------------------------------------- JSON bodies


def parse_json(raw: bytes) -> Any:
    """A JSON body, or json.JSONDecodeError (which FastAPI answers with a 422) for what Python's parser would
    take or choke on but no client should send."""
    def integer(text: str) -> int:
        if len(text) > MAX_INT_DIGITS:
            raise json.JSONDecodeError(f"an integer of {len(text)} digits is beyond 64 bits", "", 0)
        return int(text)

    def number(text: str) -> float | int:
        value = float(text)  # 2.0 is the integer 2, as JSON Schema counts integers
        return int(value) if value.is_integer() and abs(value) <= 2**63 else value

    def constant(name: str) -> None:
        raise json.JSONDecodeError(f"{name} is not JSON", "", 0)

    try:
        value = json.loads(raw, parse_int=integer, parse_float=number, parse_constant=constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape (\ud800) is no text
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except UnicodeError:
        raise json.JSONDecodeError("not Unicode text (not UTF-8, or a lone surrogate escape)", "", 0) from None
    return value


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """A route whose JSON body is read with parse_json."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_JSONRequest(request.scope, request.receive))

        return route


# ---------------------------------------------------------------- errors


async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
    """422: each error as `where: what` (the body's field path, the header, the query parameter), never the
    value sent."""
    errors = list(e.errors())
    parts = [f"{_where(err.get('loc', ()))}: {_what(err)}" for err in errors[:MAX_ERRORS]]
    more = f" (and {len(errors) - MAX_ERRORS} more)" if len(errors) > MAX_ERRORS else ""
    return problem(422, "invalid request", "; ".join(parts) + more)


def _where(loc) -> str:
    """`body.failed.12`, `header Last-Event-ID`, `query priority`, `path job_id`."""
    parts = [one_line(str(p), 40) for p in loc]
    if parts and parts[0] in ("header", "query", "path", "cookie") and len(parts) > 1:
        return f"{parts[0]} {'.'.join(parts[1:])}"
    if len(loc) == 2 and loc[0] == "body" and isinstance(loc[1], int):
        return "body"  # a JSON syntax error, at this character
    return ".".join(parts) or "request"


def _what(err: dict) -> str:
    if err.get("type") == "json_invalid":
        return f"not valid JSON ({one_line(str((err.get('ctx') or {}).get('error', 'JSON decode error')), 80)})"
    if err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",):
        return "a JSON body is required"
    return one_line(err.get("msg", "invalid"), 120)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """The framework's own answers (no such route, a method the route lacks, a body too large or unreadable)
    as problems; a 405 lists every method the path has in Allow."""
    headers = dict(e.headers or {})
    detail = e.detail if isinstance(e.detail, str) else HTTPStatus(e.status_code).phrase
    if e.status_code == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif e.status_code == 405:
        return not_allowed(request.method, request.url.path, allowed_methods(request), headers)
    elif e.status_code == 400 and e.__cause__ is not None:  # FastAPI's: a body its JSON parser choked on
        return problem(422, "invalid request", "body: not valid JSON")
    return problem(e.status_code, HTTPStatus(e.status_code).phrase.lower(), detail, headers)


def not_allowed(method: str, path: str, allowed, headers: dict | None = None) -> JSONResponse:
    allow = ", ".join(m for m in METHODS if m in allowed)
    return problem(405, "method not allowed", f"{method} is not a method of {path} (it has {allow})",
                   {**(headers or {}), "Allow": allow})


def fixed_paths(app) -> dict[str, frozenset[str]]:
    """Each documented path without parameters -> the methods declared for it (HEAD with GET). Such a path is
    answered by its own routes alone: a method it lacks is a 405 even where a parameterised route of the same
    shape would take the request (PUT /v1/blobs/missing is no upload of a blob named `missing`). Read once per
    app from its OpenAPI document, which lists every route the API declares, however its routers are nested."""
    table = getattr(app.state, "fixed_paths", None)
    if table is None:
        table = {}
        for path, operations in app.openapi().get("paths", {}).items():
            if "{" not in path:
                methods = {m.upper() for m in operations if m.upper() in METHODS}
                table[path] = frozenset(methods | ({"HEAD"} if "GET" in methods else set()))
        app.state.fixed_paths = table
    return table


async def disconnected(request: Request, e: ClientDisconnect) -> JSONResponse:
    """The client went away before its body arrived whole (the route kept none of it): one line in the log; the
    answer reaches no one."""
    log.warning("%s %s: the client disconnected before its body arrived whole; nothing was kept", request.method,
                one_line(request.url.path, 120))
    return problem(400, "client disconnected", "the body did not arrive whole")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers at this path (Starlette's 405 names only the first route's).
    Each route is asked per method: a router included whole (recent FastAPI keeps it as one route) answers for
    the routes in it."""
    routes = request.app.router.routes
    return [method for method in METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]


def install(app, settings: Settings) -> None:
    """The edge on `app`: call before its routes are declared (they take JSONRoute)."""
    app.router.route_class = JSONRoute
    app.add_middleware(Edge, settings=settings)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Refused, refused)
    app.add_exception_handler(ClientDisconnect, disconnected)
