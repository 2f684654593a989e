"""Progress as server-sent events, from a real `bcg serve` process (no local worker: the test leases and
completes the batches itself, so it knows when each event happens): ids that resume after a reconnect with
`Last-Event-ID`, nothing lost or repeated, the stream ends with the job; `bcg submit --wait` follows it."""

import hashlib
import json
import threading

import httpx
import pytest
from typer.testing import CliRunner

from storyboard_cli.cli import app
from storyboard_cli.errors import Status, exit_code
from storyboard_cli.serve import client

from helpers.serve import Server, free_port, register, start_worker, stop


JOB = """version: 1
model: tiny
buckets: [1]
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 3}
"""
YAML = {"Content-Type": "application/yaml"}


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "root", free_port())
    s.start(lease_s=30, gpus="none")
    yield s
    if s.proc.poll() is None:
        s.kill_everything()


def read(url, n=None, last_id=None, timeout_s=10):
    """Up to n events (all, until the server closes the stream, when n is None): (id, event, data) each."""
    headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
    got, fields = [], {}
    with httpx.stream("GET", url, headers=headers, timeout=timeout_s) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "":
                if "id" in fields:
                    got.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
                    if len(got) == n:
                        return got  # the connection drops here, mid-stream
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
    return got


def lease_and_complete(url, done=True):
    worker = register(url, "t")
    lease = httpx.post(url + "/v1/leases", json={"worker": worker}, timeout=10).json()
    ids = [i["id"] for i in lease["images"]]
    lines = {lease["job"]: [{"path": i["outputs"][0], "sha256": hashlib.sha256(b"png").hexdigest()}
                            for i in lease["images"]]} if done else {}  # the PNGs the test left on disk
    r = httpx.post(f"{url}/v1/leases/{lease['lease']}/complete", json={"worker": worker, "done": ids if done else [],
                                                                       "manifest": lines}, timeout=10)
    assert r.status_code == 200, r.text
    return ids


def test_a_stream_resumes_after_a_reconnect_and_ends_with_the_job(server):
    job = httpx.post(server.url + "/v1/jobs", content=JOB, headers=YAML, timeout=10).json()
    events_url = f"{server.url}/v1/jobs/{job['id']}/events"
    for out in job["images"]:  # the job's images are done on the server's disk as a worker would leave them
        png = server.root / "jobs" / job["id"] / "out" / out["outputs"][0]
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(b"png")
    lease_and_complete(server.url)
    first = read(events_url, n=3)  # queued, running, images: then the client goes away
    assert [e[1] for e in first] == ["queued", "running", "images"]

    lease_and_complete(server.url, done=False)  # while nobody listens: a lease given back,
    httpx.patch(f"{server.url}/v1/jobs/{job['id']}", json={"priority": "urgent"}, timeout=10)  # a new priority
    rest: list = []
    reader = threading.Thread(target=lambda: rest.extend(read(events_url, last_id=first[-1][0])))
    reader.start()  # resumes, then waits for the last two images
    lease_and_complete(server.url)
    lease_and_complete(server.url)
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end with the job"

    whole = read(events_url)  # the full history, from a client that connects after the end
    assert first + rest == whole  # nothing lost, nothing repeated
    ids = [e[0] for e in whole]
    assert ids == sorted(set(ids))
    assert [e[1] for e in whole] == ["queued", "running", "images", "running", "images", "priority", "running",
                                     "images", "running", "images", "end"]
    assert whole[-1][2]["state"] == "succeeded" and whole[-1][2]["images_by_state"] == {"done": 3}
    assert read(events_url, last_id=ids[-1]) == []  # resumed after the end: the stream closes at once
    assert httpx.get(f"{server.url}/v1/jobs/nope/events", timeout=10).status_code == 404
    bad = httpx.get(events_url, headers={"Last-Event-ID": "x"}, timeout=10)
    assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["detail"]


def _fail_every_lease(url, n):
    """Leases the queue's batches as they come and fails their images (no PNG needed), n leases in all."""
    worker = register(url, "t")
    for _ in range(n):
        for _ in range(200):
            r = httpx.post(url + "/v1/leases", json={"worker": worker}, timeout=10)
            if r.status_code == 200:
                break
            threading.Event().wait(0.05)
        else:
            pytest.fail("no batch to lease")
        lease = r.json()
        httpx.post(f"{url}/v1/leases/{lease['lease']}/complete",
                   json={"worker": worker, "failed": {str(i["id"]): "broken on purpose" for i in lease["images"]}},
                   timeout=10)


def test_submit_wait_follows_the_events_and_falls_back_to_polling(server, tmp_path, monkeypatch):
    (tmp_path / "job.yaml").write_text(JOB)
    runner = threading.Thread(target=_fail_every_lease, args=(server.url, 3))
    runner.start()
    r = CliRunner().invoke(app, ["submit", str(tmp_path / "job.yaml"), "--server", server.url, "--wait", "--json"])
    runner.join(30)
    assert r.exit_code == exit_code(Status.FAILED) and json.loads(r.stdout)["state"] == "failed"
    assert "queued: 0/3 done" in r.stderr and "end: 0/3 done" in r.stderr  # the events, as they came

    def no_stream(*a, **k):
        raise client.ServerError("no event stream")
        yield

    monkeypatch.setattr(client, "events", no_stream)
    job = client.submit(tmp_path / "job.yaml", server.url, priority="bulk")
    runner = threading.Thread(target=_fail_every_lease, args=(server.url, 3))
    runner.start()
    assert client.wait(server.url, job["id"], timeout_s=30, poll_s=0.1)["state"] == "failed"
    runner.join(30)


FIRST_BATCH_CANCELED = JOB.replace("buckets: [1]", "buckets: [2]").replace("candidates: 3", "candidates: 6")


@pytest.mark.slow
def test_a_job_canceled_while_a_batch_renders_ends_its_stream_after_the_batch_lands(server):
    """A real worker renders a batch when the job is canceled (its first: the worker loads its model after the
    lease): the stream says so at once (`canceled`), then the batch's images, and ends with the job's final
    counts."""
    worker = start_worker(server.url, "w")
    try:
        job = httpx.post(server.url + "/v1/jobs", content=FIRST_BATCH_CANCELED, headers=YAML, timeout=10).json()
        events_url = f"{server.url}/v1/jobs/{job['id']}/events"
        first = read(events_url, n=2)
        assert [e[1] for e in first] == ["queued", "running"]
        canceled = httpx.post(f"{server.url}/v1/jobs/{job['id']}/cancel", timeout=10).json()
        assert canceled["images_by_state"] == {"leased": 2, "canceled": 4}, canceled  # the batch still renders
        rest = read(events_url, last_id=first[-1][0], timeout_s=90)  # the model loads first
        final = server.job(job["id"])
    finally:
        stop(worker)
    assert [e[1] for e in rest] == ["canceled", "images", "end"]
    assert rest[0][2]["images_by_state"] == {"leased": 2, "canceled": 4}
    assert rest[-1][2]["state"] == final["state"] == "canceled"
    assert rest[-1][2]["images_by_state"] == final["images_by_state"] == {"done": 2, "canceled": 4}
