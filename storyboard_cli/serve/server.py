"""`bcg serve`: the API on uvicorn plus one local worker process per `--gpus` entry (each a `bcg worker`
against this server, so local and remote workers speak one protocol). Torch-free: the workers load torch.

Start-up opens the queue and binds the port before anything is announced (Service), so a queue that cannot
be used, a port in use or a public address without a token is one line and exit 2, never a banner followed
by a traceback. The app's lifespan runs (its lease sweep ends a dead worker's leases with no worker calling).

SIGTERM (or Ctrl-C): stop admitting (503) and leasing, ask the workers to stop after their running batch
(SIGINT, their soft stop), wait for them up to the grace period, then stop serving and exit 0. A second
signal stops at once.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from storyboard_cli.errors import BadInput
from storyboard_cli.serve.api import Settings, create_app
from storyboard_cli.serve.store import Store

log = logging.getLogger(__name__)
TOKEN_ENV = "BCG_TOKEN"
WORKER_TOKEN_ENV = "BCG_WORKER_TOKEN"  # `bcg worker` reads it before $BCG_TOKEN
BACKLOG = 2048  # uvicorn's
RESTART_DELAY_S = 2.0
QUICK_S = 60.0  # a local worker that exits sooner than this after its start failed quickly
QUICK_FAILURES = 5  # quick failures in a row after which a local worker is not started again
# what a worker's error says of the --device this server chose for it (`--device cuda: ...`, `(use --device cpu)`):
# left out of the server's line, which says what `bcg serve` takes instead
WORKER_OPTIONS = re.compile(r"^--device \S+: |\s*\(use --device [^)]*\)")
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
    kernels: str = "auto"  # the kernels' row every local worker renders on (bcg render --kernels)
    inputs: tuple[Path, ...] = ()  # --allow-dir: folders jobs may read besides --root
    warm: Path | None = None  # each local worker makes this job's model and shapes ready before its first lease
    stall_s: float = 600.0  # each local worker's --stall-s: a render with no progress this long, the worker exits 75
    worker_token: str | None = None  # the worker routes' token (None: --token)
    max_job_kb: int = 1024
    max_blob_mb: int = 2048
    max_workers: int = 64
    allow_models: tuple[str, ...] = ()  # --allow-model: hub ids jobs may name
    min_free_mb: int = 512
    max_blobs_gb: float = 100.0
    blob_grace_s: float = 3600.0


def check_bind(host: str, token: str | None) -> None:
    """Loopback by default; any other address serves the studio's network and needs a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not token:
        raise BadInput(f"--host {host} is not loopback: set a token (--token or ${TOKEN_ENV}) so only your "
                       "clients and workers can use the server")


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets (RFC 3986): `http://[::1]:8188`."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def local_url(bound: tuple) -> str:
    """The URL this machine's workers call, from the listening socket's address: an unspecified address
    (0.0.0.0, ::) is reached through the loopback of its family."""
    host, port = bound[0], bound[1]
    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    return http_url(loopback.get(host, host), port)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the banner; uvicorn serves on it. Raises BadInput (a port in use, an
    address that is not this machine's)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise BadInput(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart needs no TIME_WAIT
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        reasons = {errno.EADDRINUSE: "the port is in use (another bcg serve?): stop that server or pick another "
                                     "--port",
                   errno.EADDRNOTAVAIL: "not an address of this machine: pick another --host",
                   errno.EACCES: "not allowed (a port below 1024 needs privileges): pick another --port"}
        raise BadInput(f"cannot listen on {http_url(host, port)}: {reasons.get(e.errno, e.strerror or e)}") from None
    return sock


def worker_command(url: str, gpu: str, opts: ServeOptions, index: int = 0) -> tuple[list[str], dict]:
    """The `bcg worker` command line and environment for one --gpus entry (the `index`-th of its value: `cpu,cpu`
    starts local-cpu and local-cpu-2, each its own row in the queue's worker table)."""
    env = dict(os.environ)
    name = f"local-{gpu}" if index == 0 else f"local-{gpu}-{index + 1}"
    argv = [sys.executable, "-m", "storyboard_cli", "worker", "--server", url, "--name", name,
            "--engine", opts.engine, "--compile", opts.compile, "--kernels", opts.kernels]
    if gpu == "cpu":
        argv += ["--device", "cpu"]
    elif gpu != "auto":
        env["CUDA_VISIBLE_DEVICES"] = gpu
        argv += ["--device", "cuda"]
    if opts.dtype:
        argv += ["--dtype", opts.dtype]
    if opts.warm:
        argv += ["--warm", str(opts.warm)]
    argv += ["--stall-s", f"{opts.stall_s:g}"]
    env.pop(WORKER_TOKEN_ENV, None)
    if opts.worker_token or opts.token:  # the worker routes' token
        env[WORKER_TOKEN_ENV] = opts.worker_token or opts.token
    return argv, env


@dataclass
class Restarts:
    """Whether a local worker that exited is started again: not one that cannot start (exit 2: options it cannot
    render with, a device it cannot use, quarantined by the server), nor one that failed QUICK_FAILURES times in a
    row within QUICK_S of its start; a restart loop would only hide why."""

    quick: int = 0  # failures in a row within QUICK_S of the start

    def why_not(self, code: int, ran_s: float) -> str | None:
        """None: start it again; else why not (a clause of one line)."""
        if code == BadInput.exit_code:
            return "it cannot render here (exit 2)"
        self.quick = self.quick + 1 if ran_s < QUICK_S else 0
        if self.quick >= QUICK_FAILURES:
            return f"it failed {QUICK_FAILURES} times in a row within {QUICK_S:.0f} s of its start"
        return None


class Workers:
    """The local worker processes: started, restarted when one dies (`Restarts`), stopped softly. Each one's
    stderr is passed on, but for its `error:` line: when it will not be started again, the server's one line says
    why, with that error and what `bcg serve` takes instead."""

    def __init__(self, url: str, opts: ServeOptions):
        entries = [gpu for gpu in opts.gpus if gpu != NO_WORKERS]
        self.entries = entries
        self.commands = [worker_command(url, gpu, opts, entries[:i].count(gpu)) for i, gpu in enumerate(entries)]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.commands)
        self.started = [0.0] * len(self.commands)
        self.restarts = [Restarts() for _ in self.commands]
        self.errors: list[str | None] = [None] * len(self.commands)  # each one's last `error:` line
        self.relays: list[threading.Thread | None] = [None] * len(self.commands)
        self.given_up: set[int] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._supervise, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            for i, (argv, env) in enumerate(self.commands):
                p = self.procs[i]
                if i in self.given_up or p is not None and p.poll() is None:
                    continue
                if p is not None and not self._again(i, p):
                    continue
                self.errors[i], self.started[i] = None, time.monotonic()
                self.procs[i] = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
                self.relays[i] = threading.Thread(target=self._relay, args=(i, self.procs[i]), daemon=True)
                self.relays[i].start()
            self.stopping.wait(RESTART_DELAY_S)

    def _again(self, i: int, p: subprocess.Popen) -> bool:
        """Whether worker i, which exited, is started again; says so, or why not, in one line."""
        self.relays[i].join(5)  # its last line read
        name = self.commands[i][0][self.commands[i][0].index("--name") + 1]
        error = self.errors[i]
        why = self.restarts[i].why_not(p.returncode, time.monotonic() - self.started[i])
        if why is None:
            if error:
                sys.stderr.write(error + "\n")
            log.warning("worker %s exited with %s; starting it again", name, p.returncode)
            return True
        self.given_up.add(i)
        reason = WORKER_OPTIONS.sub("", error.removeprefix("error:").strip()) if error else f"exit status {p.returncode}"
        gpu = self.entries[i]
        hint = "" if gpu == "cpu" else ("; bcg serve takes --gpus cpu for a worker on this machine's CPU, or --gpus "
                                        "none for the API and queue alone (workers elsewhere)")
        log.error("worker %s (--gpus %s) not started again: %s: %s%s", name, gpu, why, reason, hint)
        return False

    def _relay(self, i: int, p: subprocess.Popen) -> None:
        """Passes worker i's stderr on, holding back its `error:` line (the supervisor's says it when it gives up)."""
        for line in p.stderr:
            if line.startswith("error:"):
                self.errors[i] = line.rstrip("\n")
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

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


class Service:
    """A server ready to run: its queue open, its app made and its port bound, each refused with one line
    (BadInput) before anything is announced. `url`: where it serves (as --host names it); `workers_url`: what
    its local workers call."""

    def __init__(self, opts: ServeOptions):
        check_bind(opts.host, opts.token)
        self.opts = opts
        self.store = Store(opts.root)  # a damaged, foreign or read-only queue: QueueUnusable
        try:
            settings = Settings(opts.root, opts.max_queue_images, opts.lease_s, opts.token, opts.inputs,
                                worker_token=opts.worker_token, max_job_kb=opts.max_job_kb,
                                max_blob_mb=opts.max_blob_mb, max_workers=opts.max_workers,
                                allow_models=opts.allow_models, min_free_mb=opts.min_free_mb,
                                max_blobs_gb=opts.max_blobs_gb, blob_grace_s=opts.blob_grace_s)
            self.app = create_app(settings, self.store)
            self.sock = listen(opts.host, opts.port)
        except BaseException:
            self.store.close()
            raise
        bound = self.sock.getsockname()
        self.url, self.workers_url = http_url(opts.host, bound[1]), local_url(bound)

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
        app, workers = self.app, Workers(self.workers_url, self.opts)

        def drain() -> None:
            app.state.draining = True
            workers.stop(self.opts.grace_s)

        # lifespan on: the app's lease sweep runs in this process (it ends when the app shuts down)
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"), drain)
        workers.start()
        try:
            server.run(sockets=[self.sock])
        finally:
            if not server.draining:  # the server failed: the workers go too
                workers.stop(0.0)
            self.sock.close()
            self.store.close()
        return 0 if server.started else 1
