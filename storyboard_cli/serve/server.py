"""`bcg serve`: the API on uvicorn plus one local worker process per `--gpus` entry (each a `bcg worker`
against this server, so local and remote workers speak one protocol). Torch-free: the workers load torch.

SIGTERM (or Ctrl-C): stop admitting (503) and leasing, ask the workers to stop after their running batch
(SIGINT, their soft stop), wait for them up to the grace period, then stop serving and exit 0. A second
signal stops at once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from storyboard_cli.errors import BadInput
from storyboard_cli.serve.api import Settings, create_app

log = logging.getLogger(__name__)
TOKEN_ENV = "BCG_TOKEN"
RESTART_DELAY_S = 2.0
NO_WORKERS = "none"  # --gpus none: the API and the queue only (workers run elsewhere)


@dataclass(frozen=True)
class ServeOptions:
    root: Path
    host: str = "127.0.0.1"
    port: int = 8188
    gpus: tuple[str, ...] = ("auto",)  # "auto": one worker on the device it finds; "cpu"; GPU indices; "none"
    max_queue_images: int = 1000
    lease_s: float = 60.0
    grace_s: float = 60.0
    token: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    compile: str = "auto"
    fp8: bool = False  # every local worker renders with the UNet's FP8 kernels (bcg render --fp8)
    inputs: tuple[Path, ...] = ()  # --allow-dir: folders jobs may read besides --root
    warm: Path | None = None  # each local worker makes this job's model and shapes ready before its first lease
    worker_token: str | None = None  # the worker routes' token (None: --token)
    max_job_kb: int = 1024
    max_blob_mb: int = 2048
    max_workers: int = 64
    allow_models: tuple[str, ...] = ()  # --allow-model: hub ids jobs may name


def check_bind(host: str, token: str | None) -> None:
    """Loopback by default; any other address serves the studio's network and needs a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise BadInput(f"--host {host} is not loopback: set a token (--token or ${TOKEN_ENV}) so only your "
                       "clients and workers can use the server")


def worker_command(url: str, gpu: str, opts: ServeOptions, index: int = 0) -> tuple[list[str], dict]:
    """The `bcg worker` command line and environment for one --gpus entry (the `index`-th of its value: `cpu,cpu`
    starts local-cpu and local-cpu-2, each its own row in the queue's worker table)."""
    env = dict(os.environ)
    name = f"local-{gpu}" if index == 0 else f"local-{gpu}-{index + 1}"
    argv = [sys.executable, "-m", "storyboard_cli", "worker", "--server", url, "--name", name,
            "--engine", opts.engine, "--compile", opts.compile] + (["--fp8"] if opts.fp8 else [])
    if gpu == "cpu":
        argv += ["--device", "cpu"]
    elif gpu != "auto":
        env["CUDA_VISIBLE_DEVICES"] = gpu
        argv += ["--device", "cuda"]
    if opts.dtype:
        argv += ["--dtype", opts.dtype]
    if opts.warm:
        argv += ["--warm", str(opts.warm)]
    if opts.token:
        env[TOKEN_ENV] = opts.token
    return argv, env


class Workers:
    """The local worker processes: started, restarted when one dies, stopped softly."""

    def __init__(self, url: str, opts: ServeOptions):
        entries = [gpu for gpu in opts.gpus if gpu != NO_WORKERS]
        self.commands = [worker_command(url, gpu, opts, entries[:i].count(gpu)) for i, gpu in enumerate(entries)]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.commands)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._supervise, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            for i, (argv, env) in enumerate(self.commands):
                p = self.procs[i]
                if p is None or p.poll() is not None:
                    if p is not None:
                        log.warning("worker %d exited with %s; starting it again", i, p.returncode)
                    self.procs[i] = subprocess.Popen(argv, env=env)
            self.stopping.wait(RESTART_DELAY_S)

    def stop(self, grace_s: float) -> None:
        self.stopping.set()
        self.thread.join()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGINT)  # the worker's soft stop: its running batch finishes
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop within %.0f s; killed (its lease expires)", p.pid, grace_s)
                p.kill()
                p.wait()


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self.drain, self.draining = drain, False

    def handle_exit(self, sig, frame) -> None:
        # not uvicorn's: it would raise the signal again after shutdown, and the exit status would be the signal's
        if self.draining:
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        self.drain()
        self.should_exit = True


def serve(opts: ServeOptions) -> int:
    """Runs until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
    check_bind(opts.host, opts.token)
    settings = Settings(opts.root, opts.max_queue_images, opts.lease_s, opts.token, opts.inputs,
                        worker_token=opts.worker_token, max_job_kb=opts.max_job_kb, max_blob_mb=opts.max_blob_mb,
                        max_workers=opts.max_workers, allow_models=opts.allow_models)
    app = create_app(settings)
    url = f"http://{'127.0.0.1' if opts.host in ('0.0.0.0', '::') else opts.host}:{opts.port}"
    workers = Workers(url, opts)

    def drain() -> None:
        app.state.draining = True
        workers.stop(opts.grace_s)

    server = _Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", lifespan="off"), drain)
    workers.start()
    try:
        server.run()
    finally:
        if not server.draining:  # the server failed (a port in use): the workers go too
            workers.stop(0.0)
        app.state.store.close()
    return 0 if server.started else 1
