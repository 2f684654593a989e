"""`bcg serve` and `bcg worker` as real processes on 127.0.0.1 for the serve tests (conftest's `server` fixture is one
Server on a free port, killed after its test), what they read back (metrics, manifests, pixels), and a planned job for
the store's own tests."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.folder.layout import MANIFEST
from storyboard_cli.serve.intake import Planned, PlannedImage

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 90
YAML = {"Content-Type": "application/yaml"}  # a job body's type
ONE_IMAGE_JOB = """version: 1
model: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1}
"""


# a command run with a tmpfs of {size} (8m, 24k) on a folder: sh -c MOUNT DIR COMMAND... ($0: the folder, "$@": the
# command)
MOUNT = 'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"'


def mount_namespace(tmp_path):
    """The prefix that runs a command in a mount namespace of its own, where MOUNT can put a tmpfs on a folder (as a
    user without privileges too, through a user namespace); skips where neither can be had."""
    import pytest

    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        ok = subprocess.run([*prefix, "sh", "-c", MOUNT.format(size="1m"), str(probe), "true"], capture_output=True,
                            timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("needs unshare and a tmpfs mount in a mount namespace")
    return prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root, port):
        self.root, self.port, self.url = root, port, f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self, lease_s=3, gpus="cpu", extra=(), cwd=ROOT, root=None, prefix=(), stderr=None, fault=None):
        """`root`: how --root is spelled (default: the absolute path), read from `cwd`; `prefix`: a command the
        server runs under (a mount namespace); `stderr`: a file for its log; `fault`: a folder holding a
        sitecustomize.py that changes something in the server process alone."""
        argv = [*prefix, sys.executable, "-m", "storyboard_cli", "serve", "--root", str(root or self.root),
                "--port", str(self.port), "--gpus", gpus, "--lease-s", str(lease_s), "--grace-s", "30", *extra]
        path = os.pathsep.join(str(p) for p in (fault, ROOT) if p is not None)
        self.proc = subprocess.Popen(argv, cwd=cwd, start_new_session=True, stderr=stderr,
                                     env={**os.environ, "PYTHONPATH": path})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the server did not answer within 30 s")

    def job(self, job_id):
        return httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=10).json()

    def wait(self, job_id, until):
        return eventually(lambda: self.job(job_id), until)

    def kill_everything(self):
        stop(self.proc)


def eventually(get, ok, timeout_s=DEADLINE_S, poll_s=0.2):
    """Calls get() until ok(its value) (bounded in time); returns that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = get()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {value}")
        time.sleep(poll_s)


def start_worker(url, name, *extra, fault=None, stderr=None):
    """A `bcg worker` process rendering on the CPU, in its own process group. `fault`: a folder holding a
    sitecustomize.py that breaks something in that process alone (`device_fault`); `stderr`: a file for its stderr."""
    env = dict(os.environ)
    if fault is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fault), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "storyboard_cli", "worker", "--server", url, "--device", "cpu",
                             "--name", name, *extra], cwd=ROOT, start_new_session=True, env=env, stderr=stderr)


# a GPU that fails under a worker that started well (a CUDA error is sticky: every later batch fails the same way)
CUDA_ERROR = """from storyboard_cli.run.batch import BatchRunner


def _fails(self, *args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


BatchRunner.run_batch = _fails
"""


# a worker that renders `after` batches, then holds its next lease without rendering it: it waits in that batch until it
# is stopped or killed (a test that kills a worker mid-batch cannot lose the race against 0.04 s batches)
HOLDS_A_LEASE = """import time
from storyboard_cli.run.batch import BatchRunner

_run, _calls = BatchRunner.run_batch, []


def _holds(self, *args, **kwargs):
    _calls.append(1)
    if len(_calls) > {after}:
        time.sleep(600)
    return _run(self, *args, **kwargs)


BatchRunner.run_batch = _holds
"""


# a worker whose every batch takes `seconds` longer (a slower GPU): while it holds one lease, a worker that leases
# next cannot find the job drained, however long that one takes to come back on a loaded machine
SLOW_BATCHES = """import time
from storyboard_cli.run.batch import BatchRunner

_run = BatchRunner.run_batch


def _slow(self, *args, **kwargs):
    time.sleep({seconds})
    return _run(self, *args, **kwargs)


BatchRunner.run_batch = _slow
"""


def slow_batches(folder, seconds):
    """A folder whose sitecustomize.py makes each batch of a worker started with it (start_worker(fault=...)) take
    `seconds` longer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SLOW_BATCHES.replace("{seconds}", repr(float(seconds))))
    return folder


def holds_a_lease(folder, after=0):
    """A folder whose sitecustomize.py makes a worker started with it (start_worker(fault=...)) render `after`
    batches, then wait in the next one, holding its lease."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOLDS_A_LEASE.replace("{after}", str(int(after))))
    return folder


def device_fault(folder):
    """A folder whose sitecustomize.py makes every batch of a worker started with it (start_worker(fault=...))
    raise the CUDA error a failed GPU raises."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(CUDA_ERROR)
    return folder


def stop(proc):
    """kill -9 of the process's group (the server's: its workers too), if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def metric(url, name, **labels):
    """The sum of /metrics samples named `name` whose labels include `labels`."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    found = [s.value for f in families for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    if not found:
        raise KeyError(name)
    return sum(found)


def register(url, name):
    """The worker id the server issues for `name` (what a test that leases by hand names in its calls)."""
    r = httpx.post(url + "/v1/workers", json={"name": name}, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["worker"]


def worker_ids(url, name):
    """The ids of the registered workers called `name` that the server counts now (from /metrics)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return {s.labels["worker"] for f in families for s in f.samples
            if s.name == "bcg_worker_ready" and s.labels["name"] == name}


def manifest_paths(out):
    return [json.loads(line)["path"] for line in (out / MANIFEST).read_text().splitlines()]


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


# three images of the tiny model: the job the metrics and deploy tests submit
JOB_3_IMAGES = """version: 1
model: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 3}
"""
KEY = "64x64 2 steps euler"  # the bucket key of the store tests' planned images


def planned(job_id, n=2, priority="normal", key=KEY, fingerprint=None, batch=4, content="c", mix=None) -> Planned:
    images = tuple(PlannedImage(i, "a", i, 10 + i, (f"a/a_c{i}_s{10 + i}.png",), key,
                                (fingerprint or job_id) + str(i), mix or job_id) for i in range(n))
    return Planned(job_id, job_id, Path("/j") / job_id / "job.yaml", Path("/j") / job_id / "out", priority, content,
                   batch, images)

