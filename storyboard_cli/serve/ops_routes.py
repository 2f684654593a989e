"""The operators' routes of the API: /metrics (Prometheus), /healthz (admission) and /readyz (a ready worker).
Open (no token). Torch-free."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from storyboard_cli.serve import metrics, wire
from storyboard_cli.serve.api_state import State
from storyboard_cli.serve.disk import UNWRITABLE
from storyboard_cli.serve.edge import JSONRoute, Refused
from storyboard_cli.serve.openapi import problems

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text (version 0.0.4)"}})
def scrape(state: State) -> Response:
    return Response(metrics.exposition(state.registry), media_type=METRICS_TYPE)


@router.get("/healthz", responses=problems({503: "the server is stopping: it admits no job"}))
def healthz(state: State) -> wire.Health:
    """Liveness and admission: 200 while the server accepts jobs (with or without workers), 503 while it
    drains. What a load balancer routes submissions on."""
    if state.draining():
        raise Refused(503, "draining", "the server is stopping: it admits no job")
    return wire.Health(ok=True)


@router.get("/readyz", responses=problems({503: "by design, until a worker is ready: no registered worker seen within "
                                                "--lease-s has its graphs captured (or the server is stopping, or its "
                                                "disk is under --min-free-mb, or so full that it leases no batch, or its job folders "
                                                "cannot be written)"}))
def readyz(state: State) -> wire.Ready:
    """Ready: at least one registered worker seen within --lease-s has its model loaded and its graphs
    captured (it says so with each lease request and heartbeat)."""
    if state.draining():
        raise Refused(503, "draining", "the server is stopping")
    low = state.disk.holding() or state.disk.low()
    if low is not None:
        raise Refused(503, "job folders not writable" if low.startswith(UNWRITABLE) else "disk full", low)
    lease_s = state.settings.lease_s
    seen, ready = state.store.readiness(state.clock(), lease_s)
    if not ready:
        reason = (f"{seen} worker(s) seen in the last {lease_s:g} s, none has its graphs captured yet "
                  "(a worker loads its model and captures them with its first batch)" if seen else
                  f"no worker seen in the last {lease_s:g} s")
        raise Refused(503, "no ready worker", reason)
    return wire.Ready(ready=True, workers=seen, workers_ready=ready)
