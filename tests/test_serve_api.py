"""The HTTP API through FastAPI's TestClient (no server process, no model): validation as `bcg plan`,
202 + Location, backpressure, idempotency, cancel and priority, the lease protocol, /metrics."""

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.errors import JobError
from storyboard_cli.job.file import load_job
from storyboard_cli.serve.api import PROBLEM, Settings, create_app

JOB = """version: 1
model: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 2}
"""
YAML = {"Content-Type": "application/yaml"}


@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(tmp_path / "root", max_queue_images=3, lease_s=30))
    with TestClient(app) as c:
        yield c


def post(client, body=JOB, **headers):
    return client.post("/v1/jobs", content=body, headers={**YAML, **headers})


def register(client, name):
    """The worker id the server issues for `name` (POST /v1/workers)."""
    r = client.post("/v1/workers", json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()["worker"]


def test_a_bad_job_is_a_422_with_the_plan_message(client, tmp_path):
    bad = JOB.replace("steps: 2", "steps: 0")
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(JobError) as e:
        load_job(tmp_path / "bad.yaml")  # what `bcg plan` prints
    r = post(client, bad, **{"X-Job-Filename": "bad.yaml"})
    assert r.status_code == 422 and r.headers["content-type"] == PROBLEM
    assert r.json()["detail"] == str(e.value).replace(str(tmp_path / "bad.yaml"), "bad.yaml")
    assert r.json()["detail"].startswith("bad.yaml:3 ") and "steps" in r.json()["detail"]
    assert not list((tmp_path / "root" / "jobs").iterdir())  # nothing left behind


def test_submit_answers_202_with_location_and_the_job(client):
    r = post(client)
    assert r.status_code == 202
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}" and job["state"] == "queued"
    assert [(i["shot"], i["candidate"], i["seed"], i["state"]) for i in job["images"]] == [
        ("a", 0, 1, "queued"), ("a", 1, 2, "queued")]
    got = client.get(r.headers["location"]).json()
    assert got["id"] == job["id"] and got["queue_position"] == 0 and got["sheet_url"].endswith("/index.html")
    assert client.get("/v1/jobs/nope").status_code == 404


def test_json_jobs_are_accepted(client):
    body = json.dumps({"version": 1, "model": "tiny", "shots": [{"id": "j", "prompt": "p", "steps": 2,
                                                                 "size": "64x64"}]})
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 202 and r.json()["images"][0]["shot"] == "j"


def test_a_full_queue_refuses_whole_with_retry_after_and_the_key_is_not_spent(client):
    first = post(client).json()
    r = post(client, JOB.replace("castle", "tower"), **{"Idempotency-Key": "k1"})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert client.get("/metrics").text.count('reason="queue_full"} 1.0') == 1
    assert len(list((client.app.state.settings.root / "jobs").iterdir())) == 1  # nothing partly enqueued
    client.post(f"/v1/jobs/{first['id']}/cancel")
    again = post(client, JOB.replace("castle", "tower"), **{"Idempotency-Key": "k1"})
    assert again.status_code == 202


def test_idempotent_retries_return_the_first_job(client):
    a = post(client, **{"Idempotency-Key": "abc"})
    b = post(client, **{"Idempotency-Key": "abc"})
    assert a.status_code == 202 and b.status_code == 200 and a.json()["id"] == b.json()["id"]
    assert b.headers["location"] == a.headers["location"]
    other = post(client, JOB.replace("castle", "tower"), **{"Idempotency-Key": "abc"})
    assert other.status_code == 422 and "another job" in other.json()["detail"]


def test_cancel_and_reprioritise(client):
    job = post(client).json()
    r = client.patch(f"/v1/jobs/{job['id']}", json={"priority": "urgent"})
    assert r.json()["priority"] == "urgent"
    assert client.patch(f"/v1/jobs/{job['id']}", json={"priority": "asap"}).status_code == 422
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.json()["state"] == "canceled" and {i["state"] for i in r.json()["images"]} == {"canceled"}


def test_the_lease_protocol_and_the_files(client):
    job = post(client).json()
    w = register(client, "w")
    lease = client.post("/v1/leases", json={"worker": w}).json()
    assert lease["job"] == job["id"] and len(lease["images"]) == 2
    assert client.post("/v1/leases", json={"worker": register(client, "w2")}).status_code == 204
    assert client.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": w}).status_code == 200
    out = client.app.state.settings.root / "jobs" / job["id"] / "out"
    (out / "a").mkdir(parents=True)
    (out / "a" / "a_c0_s1.png").write_bytes(b"png")
    ids = [i["id"] for i in lease["images"]]
    assert client.post(f"/v1/leases/{lease['lease']}/complete", json={"done": ids}).status_code == 200
    assert client.post(f"/v1/leases/{lease['lease']}/complete", json={"done": ids}).status_code == 410
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["state"] == "succeeded" and got["queue_position"] is None
    url = got["images"][0]["urls"][0]
    assert client.get(url).content == b"png"
    assert client.get(f"/v1/jobs/{job['id']}/files/../../../queue.sqlite3").status_code == 404


def test_metrics_parse_as_prometheus_text(client):
    post(client)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    depth = {s.labels["priority"]: s.value for s in families["bcg_queue_images"].samples}
    assert depth == {"urgent": 0, "normal": 2, "bulk": 0}
    assert {"bcg_jobs", "bcg_images_rendered", "bcg_lease_expiries", "bcg_rejected_submissions"} <= set(families)


def test_readyz_waits_for_a_worker_with_its_graphs_captured_healthz_does_not(tmp_path):
    t = [1000.0]
    app = create_app(Settings(tmp_path / "root", lease_s=30), clock=lambda: t[0])
    with TestClient(app) as c:
        def ready():
            r = c.get("/readyz")
            assert r.status_code in (200, 503) and c.get("/healthz").status_code == 200  # admitting throughout
            return r.status_code == 200, r.json()

        ok, body = ready()
        assert not ok and body["status"] == 503 and body["detail"] == "no worker seen in the last 30 s"
        assert c.get("/readyz").headers["content-type"] == PROBLEM
        cold, loading, hot = (register(c, name) for name in ("cold", "loading", "hot"))
        ok, body = ready()  # registered, not ready
        assert not ok and body["detail"].startswith("3 worker(s) seen in the last 30 s, none has its graphs captured")
        assert c.post("/v1/leases", json={"worker": cold}).status_code == 204  # says nothing: not ready
        assert c.post("/v1/leases", json={"worker": loading, "ready": False}).status_code == 204
        ok, body = ready()
        assert not ok and body["detail"].startswith("3 worker(s) seen in the last 30 s, none has its graphs captured")
        post(c)
        lease = c.post("/v1/leases", json={"worker": hot, "ready": True}).json()
        assert ready() == (True, {"ready": True, "workers": 3, "workers_ready": 1})
        assert "bcg_workers_ready 1.0" in c.get("/metrics").text
        t[0] += 25  # "hot" renders; its heartbeats keep it counted, the idle ones stopped asking
        assert c.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": hot, "ready": True}).status_code == 200
        t[0] += 25
        assert ready() == (True, {"ready": True, "workers": 1, "workers_ready": 1})
        t[0] += 31  # "hot" stopped heartbeating (killed): it no longer counts
        ok, body = ready()
        assert not ok and body["detail"] == "no worker seen in the last 30 s"
        assert "bcg_workers_ready 0.0" in c.get("/metrics").text
        c.post("/v1/leases", json={"worker": register(c, "hot"), "ready": True})  # forgotten: it registers again
        assert ready()[0]
        app.state.draining = True  # SIGTERM: neither admitting nor ready
        assert c.get("/healthz").status_code == 503 and c.get("/readyz").json()["title"] == "draining"


def test_a_token_guards_everything_but_health_and_metrics(tmp_path):
    app = create_app(Settings(tmp_path / "root", token="s3cret"))
    with TestClient(app) as c:
        assert post(c).status_code == 401
        assert post(c, Authorization="Bearer s3cret").status_code == 202
        assert c.get("/metrics").status_code == 200


def test_serve_with_a_bad_warm_job_is_one_line_before_anything_starts(tmp_path):
    from typer.testing import CliRunner

    from storyboard_cli.cli import app

    bad = tmp_path / "warm.yaml"
    bad.write_text("version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x, steps: 0}\n")
    result = CliRunner().invoke(app, ["serve", "--root", str(tmp_path / "root"), "--warm", str(bad), "--gpus", "none"])
    assert result.exit_code == 2 and "warm.yaml:4" in result.output and "steps" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "root").exists()


def test_a_lease_lost_with_no_worker_left_is_ended_by_the_server_itself(tmp_path):
    """Nothing asks for work (the only worker died): the server's own sweep ends the expired lease, so the
    job shows its images queued again and its event stream says the lease was lost."""
    import time

    t = [1000.0]
    app = create_app(Settings(tmp_path / "root", lease_s=30, sweep_s=0.05), clock=lambda: t[0])
    with TestClient(app) as c:
        job = post(c).json()
        lease = c.post("/v1/leases", json={"worker": register(c, "w")}).json()
        assert {i["state"] for i in c.get(f"/v1/jobs/{job['id']}").json()["images"]} == {"leased"}
        t[0] += 31  # past the lease; no worker calls again
        deadline = time.monotonic() + 5
        while {i["state"] for i in c.get(f"/v1/jobs/{job['id']}").json()["images"]} != {"queued"}:
            assert time.monotonic() < deadline, "the expired lease was not ended"
            time.sleep(0.05)
        assert c.post(f"/v1/leases/{lease['lease']}/complete", json={}).status_code == 410


def test_local_workers_have_one_name_each(tmp_path):
    """`--gpus cpu,cpu` starts two workers: each its own name, so its own row in the worker table (readiness,
    GPU series)."""
    from storyboard_cli.serve.server import ServeOptions, Workers

    workers = Workers("http://127.0.0.1:1", ServeOptions(tmp_path, gpus=("cpu", "cpu", "0", "none")))
    names = [argv[argv.index("--name") + 1] for argv, _ in workers.commands]
    assert names == ["local-cpu", "local-cpu-2", "local-0"]
