"""The operators' routes of the API: /metrics (Prometheus), /healthz (admission) and /readyz (a ready worker).
Torch-free."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from storyboard_cli.serve import metrics, wire
from storyboard_cli.serve.api_state import ApiState
from storyboard_cli.serve.edge import JSONRoute, problem
from storyboard_cli.serve.openapi import problems

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def router(state: ApiState) -> APIRouter:
    """/metrics, /healthz, /readyz: open (no token)."""
    api = APIRouter(route_class=JSONRoute)  # each JSON body read by the edge's parser
    store, settings, clock = state.store, state.settings, state.clock
    registry = metrics.registry(store, settings.lease_s, clock, state.disk, state.blobs)

    @api.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text (version 0.0.4)"}})
    def scrape():
        return Response(metrics.exposition(registry), media_type=METRICS_TYPE)

    @api.get("/healthz", response_model=None, responses={
        200: {"model": wire.Health}, **problems({503: "the server is stopping: it admits no job"})})
    def healthz():
        """Liveness and admission: 200 while the server accepts jobs (with or without workers), 503 while it
        drains. What a load balancer routes submissions on."""
        if state.draining():
            return problem(503, "draining", "the server is stopping: it admits no job")
        return JSONResponse({"ok": True})

    @api.get("/readyz", response_model=None, responses={
        200: {"model": wire.Ready}, **problems({503: "by design, until a worker is ready: no registered worker "
                                                      "seen within --lease-s has its graphs captured (or the "
                                                      "server is stopping, or its disk is under --min-free-mb)"})})
    def readyz():
        """Ready: at least one registered worker seen within --lease-s has its model loaded and its graphs
        captured (it says so with each lease request and heartbeat)."""
        if state.draining():
            return problem(503, "draining", "the server is stopping")
        low = state.disk.low()
        if low is not None:
            return problem(503, "disk full", low)
        seen, ready = store.readiness(clock(), settings.lease_s)
        if not ready:
            reason = (f"{seen} worker(s) seen in the last {settings.lease_s:g} s, none has its graphs captured yet "
                      "(a worker loads its model and captures them with its first batch)" if seen else
                      f"no worker seen in the last {settings.lease_s:g} s")
            return problem(503, "no ready worker", reason)
        return JSONResponse({"ready": True, "workers": seen, "workers_ready": ready})

    return api
