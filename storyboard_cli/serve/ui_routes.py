"""/ui: the queue page, one static HTML file (ui/queue.html) with its style and plain script inline, sent with a
content security policy that lets only those two run (the contact sheet's, folder/sheet_assets.py): no other script,
style or frame, requests to this server alone. It reads and acts through the API (queue_routes.py, job_routes.py) and
follows the one global event stream; it holds no job data itself, so it is open like /docs and asks for the token
when the API wants one (kept in the tab's sessionStorage). Torch-free."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from storyboard_cli.folder.sheet_assets import csp_hash
from storyboard_cli.serve.edge import JSONRoute

PAGE = Path(__file__).with_name("ui") / "queue.html"
INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.S)

router = APIRouter(route_class=JSONRoute)


@cache
def page() -> tuple[str, str]:
    """The page's HTML and its content security policy (the hashes of its one script and one style sheet)."""
    html = PAGE.read_text(encoding="utf-8")
    inline = {tag: csp_hash(body) for tag, body in INLINE.findall(html)}
    csp = (f"default-src 'none'; script-src {inline['script']}; style-src {inline['style']}; "
           "img-src 'self' blob: data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return html, csp


@router.get("/ui", response_class=HTMLResponse, responses={200: {"description": "the queue page (HTML)"}})
def ui() -> HTMLResponse:
    """The queue page: jobs, workers, dispatch; live from GET /v1/events."""
    html, csp = page()
    return HTMLResponse(html, headers={"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                                       "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})
