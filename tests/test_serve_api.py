"""The HTTP API through FastAPI's TestClient (no server process, no model): validation as `bcg plan`,
202 + Location, backpressure, idempotency, cancel and priority, the lease protocol, /metrics; and what a
client or worker can send wrong (malformed bodies, headers, queries; oversized bodies; the wrong token; a
final job): always a 4xx problem+json with one line of detail, never a 500. /openapi.json says all of it."""

import asyncio
import hashlib
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.errors import JobError
from storyboard_cli.job.file import SHOT_KEYS, TOP_KEYS, load_job
from storyboard_cli.serve.api import PROBLEM, Settings, create_app
from storyboard_cli.serve.edge import METHODS

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


def problem_of(r, status):
    """The problem+json body of `r`, checked: the status, the media type, one line of detail that shows no
    Python repr, traceback or server path."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    body = r.json()
    detail = body["detail"]
    assert body["status"] == status and body["title"] and detail and "\n" not in detail and len(detail) <= 300
    assert not any(s in detail for s in ("object at 0x", "Traceback", "/tmp/", "/root", "site-packages")), detail
    return body


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


def test_a_key_reused_for_the_same_job_at_another_priority_says_so(client):
    first = post(client, **{"Idempotency-Key": "k"}).json()
    r = client.post("/v1/jobs?priority=urgent", content=JOB, headers={**YAML, "Idempotency-Key": "k"})
    detail = problem_of(r, 422)["detail"]
    assert f"was used for this job ({first['id']}) with priority normal" in detail and "another" not in detail
    assert post(client, **{"Idempotency-Key": "k"}).status_code == 200  # the same request again: replayed


def test_cancel_and_reprioritise(client):
    job = post(client).json()
    r = client.patch(f"/v1/jobs/{job['id']}", json={"priority": "urgent"})
    assert r.json()["priority"] == "urgent"
    assert client.patch(f"/v1/jobs/{job['id']}", json={"priority": "asap"}).status_code == 422
    r = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.json()["state"] == "canceled" and {i["state"] for i in r.json()["images"]} == {"canceled"}


def write_outputs(client, job, lease):
    """The lease's first outputs written into the job's folder as a worker on the server's filesystem writes them:
    (the folder, their manifest lines as dicts)."""
    out = client.app.state.settings.root / "jobs" / job["id"] / "out"
    (out / "a").mkdir(parents=True)
    lines = []
    for image in lease["images"]:
        path = image["outputs"][0]
        (out / path).write_bytes(b"png " + path.encode())
        lines.append({"path": path, "sha256": hashlib.sha256(b"png " + path.encode()).hexdigest()})
    return out, lines


def test_the_lease_protocol_and_the_files(client):
    job = post(client).json()
    w = register(client, "w")
    lease = client.post("/v1/leases", json={"worker": w}).json()
    assert lease["job"] == job["id"] and len(lease["images"]) == 2
    assert client.post("/v1/leases", json={"worker": register(client, "w2")}).status_code == 204
    assert client.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": w}).status_code == 200
    out, lines = write_outputs(client, job, lease)
    ids = [i["id"] for i in lease["images"]]
    complete = f"/v1/leases/{lease['lease']}/complete"
    # the server is the folder's one writer: no line, a line for a file that is not there, a wrong sha256: refused
    assert client.post(complete, json={"worker": w, "done": ids}).status_code == 422
    assert client.post(complete, json={"worker": w, "done": ids, "manifest": {job["id"]: lines[:1]}}).status_code == 422
    wrong = [lines[0], {**lines[1], "sha256": "0" * 64}]
    assert client.post(complete, json={"worker": w, "done": ids, "manifest": {job["id"]: wrong}}).status_code == 422
    assert not (out / "manifest.jsonl").exists()  # nothing recorded by a refused completion
    assert client.post(complete, json={"worker": w, "done": ids, "manifest": {job["id"]: lines}}).status_code == 200
    assert client.post(complete, json={"worker": w, "done": ids, "manifest": {job["id"]: lines}}).status_code == 410
    recorded = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["path"] for r in recorded) == sorted(line["path"] for line in lines)
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["state"] == "succeeded" and got["queue_position"] is None
    url = got["images"][0]["urls"][0]
    assert client.get(url).content == b"png " + got["images"][0]["outputs"][0].encode()
    client.app.state.refresher.flush()  # the report and the sheet, rebuilt by the server once the job ended
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "done" and report["images_rendered"] == 2 and (out / "index.html").is_file()
    assert client.get(f"/v1/jobs/{job['id']}/files/../../../queue.sqlite3").status_code == 404


def test_a_completions_report_is_kept_in_the_transaction_that_marks_its_images_done(client, monkeypatch):
    """The moment a lease's images are done, its report is kept beside the job: a job report rebuilt then has the
    lease's batches (kept after the commit, a rebuild in between and then a killed server left a finished job's report
    two images short in its buckets)."""
    from pathlib import Path

    from storyboard_cli.folder.report import Report, Timings
    from storyboard_cli.serve import folders, wire

    job = post(client).json()
    w = register(client, "w")
    lease = client.post("/v1/leases", json={"worker": w}).json()
    out, lines = write_outputs(client, job, lease)
    lines = [wire.ManifestLine(**line) for line in lines]
    timings = Timings(stages={"denoise": 1.0})
    bucket = timings.bucket("2 x 64x64 2 steps euler")
    bucket.images, bucket.batches, bucket.rows, bucket.steps, bucket.denoise_s = 2, 1, 4, 2, 1.0
    report = Report.build(job="job.yaml", out_dir=Path("out"), device="cpu", dtype="float32", engine="eager",
                          model="tiny", timings=timings, wall_s=2.0, rendered=2, skipped=0, failed=[],
                          peak_mem_mb=None, graphs=[], status="done", notes=[])
    store, at_commit = client.app.state.api.store, []
    real = store.complete

    def complete(*args, **kwargs):
        ok = real(*args, **kwargs)  # committed: the images are done
        at_commit.append(sorted(f.stem for f in (out.parent / folders.LEASES).glob("*.json")))
        return ok

    monkeypatch.setattr(store, "complete", complete)
    body = wire.Completion(worker=w, done=[i["id"] for i in lease["images"]], manifest={job["id"]: lines},
                           reports={job["id"]: wire.lease_report(report)})
    r = client.post(f"/v1/leases/{lease['lease']}/complete", content=body.model_dump_json(exclude_unset=True),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert at_commit == [[lease["lease"]]]  # the lease's report was there when its images became done
    kept = json.loads((out.parent / folders.LEASES / f"{lease['lease']}.json").read_text())
    assert kept["worker"] == w and kept["report"]["buckets"][0]["images"] == 2


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


def test_the_worker_token_guards_the_worker_routes_and_either_token_reads_an_input(tmp_path):
    app = create_app(Settings(tmp_path / "root", token="client", worker_token="worker"))
    client, worker = {"Authorization": "Bearer client"}, {"Authorization": "Bearer worker"}
    with TestClient(app) as c:
        assert post(c, **client).status_code == 202
        assert problem_of(post(c, **worker), 401)["detail"].endswith("with the client token")
        assert c.post("/v1/workers", json={"name": "w"}, headers=client).status_code == 401
        w = c.post("/v1/workers", json={"name": "w"}, headers=worker).json()["worker"]
        assert c.post("/v1/leases", json={"worker": w}, headers=client).status_code == 401
        assert c.post("/v1/leases", json={"worker": w}, headers=worker).status_code == 200
        assert c.post("/v1/leases/x/heartbeat", json={"worker": w}, headers=client).status_code == 401
        blob = "/v1/blobs/" + "0" * 64
        assert [c.get(blob, headers=h).status_code for h in (client, worker, {})] == [404, 404, 401]
        assert c.post("/v1/blobs/missing", json={"digests": []}, headers=worker).status_code == 401
        r = c.get("/v1/jobs/x", headers={"Authorization": "Bearer \u00e9t\u00e9".encode("latin-1")})  # not ASCII
        assert problem_of(r, 401) and r.headers["www-authenticate"] == "Bearer"
        for path in ("/openapi.json", "/docs", "/redoc", "/healthz", "/metrics"):  # no job data: open
            assert c.get(path).status_code == 200, path
    app = create_app(Settings(tmp_path / "root2", worker_token="worker"))  # no client token: only workers need one
    with TestClient(app) as c:
        assert post(c).status_code == 202 and c.post("/v1/workers", json={"name": "w"}).status_code == 401


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
        w = register(c, "w")
        lease = c.post("/v1/leases", json={"worker": w}).json()
        assert {i["state"] for i in c.get(f"/v1/jobs/{job['id']}").json()["images"]} == {"leased"}
        t[0] += 31  # past the lease; no worker calls again
        deadline = time.monotonic() + 5
        while {i["state"] for i in c.get(f"/v1/jobs/{job['id']}").json()["images"]} != {"queued"}:
            assert time.monotonic() < deadline, "the expired lease was not ended"
            time.sleep(0.05)
        assert c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": w}).status_code == 410


def test_local_workers_have_one_name_each(tmp_path):
    """`--gpus cpu,cpu` starts two workers: each its own name, so its own row in the worker table (readiness,
    GPU series)."""
    from storyboard_cli.serve.server import ServeOptions, Workers

    workers = Workers("http://127.0.0.1:1", ServeOptions(tmp_path, gpus=("cpu", "cpu", "0", "none")))
    names = [argv[argv.index("--name") + 1] for argv, _ in workers.commands]
    assert names == ["local-cpu", "local-cpu-2", "local-0"]


def leased(client):
    """A job of two images and a live lease on them: (job, worker id, lease)."""
    job = post(client).json()
    worker = register(client, "w")
    return job, worker, client.post("/v1/leases", json={"worker": worker}).json()


def short(value) -> str:
    return str(value)[:40]


HUGE = "9" * 100_000  # a JSON integer Python's parser refuses to convert (a ValueError, once a 500)
WORKER_BODIES = ["", "null", "[]", '"x"', "{", '{"worker": 7}', '{"worker": "w", "ready": "yes"}',
                 '{"worker": "w", "ready": 1}', '{"worker": "w", "gpu": [1]}', '{"worker": "w", "gpu": {"u": true}}',
                 '{"worker": "w", "gpu": {"u": NaN}}', '{"worker": "w", "gpu": {"u": 1e999}}', f'{{"worker": {HUGE}}}',
                 '{"worker": "w", "spare": 1}', '{"worker": "a b"}', "[" * 100_000]
COMPLETIONS = ["", "null", "[]", '"x"', '{"done": "1"}', '{"done": [1.5]}', '{"done": ["1"]}', f'{{"done": [{HUGE}]}}',
               '{"done": [99999999999999999999999999]}', '{"failed": {"x": "r"}}', '{"failed": {"1": 2}}',
               '{"batches": [{"shape": "64x64", "images": 0, "seconds": 1}]}',
               '{"batches": [{"shape": "a\\nb", "images": 1, "seconds": 1}]}',
               '{"batches": [{"shape": "64x64", "images": 9999999999, "seconds": 1}]}',
               '{"out_of_memory": -1}', '{"model_loads": true}', '{"manifest": {"j": [{}]}}',
               '{"manifest": {"j": [{"path": "\\ud800"}]}}', '{"done": [], "extra": 1}', '{"reports": {"j": {}}}',
               '{"reports": {"j": {"wall_s": "1"}}}', '{"done": []}']  # the last: no worker (an older client)


@pytest.mark.parametrize("body", WORKER_BODIES, ids=short)
def test_a_malformed_lease_request_or_heartbeat_is_a_422_problem(client, body):
    job, worker, lease = leased(client)
    for route in ("/v1/leases", f"/v1/leases/{lease['lease']}/heartbeat"):
        problem_of(client.post(route, content=body, headers={"Content-Type": "application/json"}), 422)
    assert client.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": worker}).status_code == 200


@pytest.mark.parametrize("body", COMPLETIONS, ids=short)
def test_a_malformed_completion_is_a_422_problem_and_changes_nothing(client, body):
    job, worker, lease = leased(client)
    url = f"/v1/leases/{lease['lease']}/complete"
    if body.startswith("{") and '"worker"' not in body and body != '{"done": []}':  # the holder names itself
        body = body.replace("{", f'{{"worker": "{worker}", ', 1)
    detail = problem_of(client.post(url, content=body, headers={"Content-Type": "application/json"}), 422)["detail"]
    assert HUGE not in detail and "ud800" not in detail
    assert {i["state"] for i in client.get(f"/v1/jobs/{job['id']}").json()["images"]} == {"leased"}
    failed = {str(i["id"]): "a reason" for i in lease["images"]}
    assert client.post(url, json={"worker": worker, "failed": failed,
                                  "batches": [{"shape": "64x64", "images": 2, "seconds": 0.5}],
                                  "out_of_memory": 1.0, "model_loads": 1}).status_code == 200  # 1.0: an integer
    assert client.get(f"/v1/jobs/{job['id']}").json()["state"] == "failed"


def test_a_100000_digit_integer_names_itself_in_one_line(client):
    detail = problem_of(client.post("/v1/workers", content=f'{{"name": {HUGE}}}',
                                    headers={"Content-Type": "application/json"}), 422)["detail"]
    assert detail == "body: not valid JSON (an integer of 100000 digits is beyond 64 bits)"


@pytest.mark.parametrize("content,headers", [
    ("priority=urgent", {"Content-Type": "application/x-www-form-urlencoded"}), ("urgent", {}),
    ("{", {"Content-Type": "application/json"}), ('{"priority": "asap"}', {"Content-Type": "application/json"}),
    ('{"priority": "urgent", "x": 1}', {"Content-Type": "application/json"}), ("null", {"Content-Type": "application/json"}),
    (f'{{"priority": {HUGE}}}', {"Content-Type": "application/json"})], ids=short)
def test_a_malformed_patch_is_a_422_problem(client, content, headers):
    job = post(client).json()
    problem_of(client.patch(f"/v1/jobs/{job['id']}", content=content, headers=headers), 422)
    assert client.get(f"/v1/jobs/{job['id']}").json()["priority"] == "normal"


@pytest.mark.parametrize("value", ["99999999999999999999999999", "x", "-1", " ", "1.5", HUGE[:5000]], ids=short)
def test_an_out_of_range_last_event_id_is_a_422_problem(client, value):
    job = post(client).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")  # its stream has ended: a server that took the value cannot hang
    detail = problem_of(client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": value}), 422)["detail"]
    assert detail.startswith("header Last-Event-ID: ")


@pytest.mark.parametrize("query,headers", [("priority=asap", {}), ("", {"X-Job-Filename": "../x.yaml"}),
                                           ("", {"Idempotency-Key": "k" * 300}), ("", {"X-Job-Filename": "out"})])
def test_a_malformed_submission_query_or_header_is_a_422_problem(client, query, headers):
    problem_of(client.post(f"/v1/jobs?{query}", content=JOB, headers={**YAML, **headers}), 422)


def test_cancel_or_patch_of_a_final_job_is_a_409_naming_its_state_and_changes_nothing(client):
    def final(state, outcome):
        job, worker, lease = leased(client)
        ids = [i["id"] for i in lease["images"]]
        if outcome == "done":
            out = client.app.state.settings.root / "jobs" / job["id"] / "out"
            for image in lease["images"]:
                (out / image["outputs"][0]).parent.mkdir(parents=True, exist_ok=True)
                (out / image["outputs"][0]).write_bytes(b"png")
            lines = [{"path": i["outputs"][0], "sha256": hashlib.sha256(b"png").hexdigest()} for i in lease["images"]]
            assert client.post(f"/v1/leases/{lease['lease']}/complete",
                               json={"worker": worker, "done": ids, "manifest": {job["id"]: lines}}).status_code == 200
        elif outcome == "failed":
            client.post(f"/v1/leases/{lease['lease']}/complete",
                        json={"worker": worker, "failed": {str(i): "why" for i in ids}})
        else:
            assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "canceled"
            client.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": worker})
        assert client.get(f"/v1/jobs/{job['id']}").json()["state"] == state
        return job["id"]

    for state, outcome in (("succeeded", "done"), ("failed", "failed"), ("canceled", "cancel")):
        job_id = final(state, outcome)
        events = client.get(f"/v1/jobs/{job_id}/events").text
        for r in (client.post(f"/v1/jobs/{job_id}/cancel"), client.patch(f"/v1/jobs/{job_id}", json={"priority": "bulk"})):
            assert problem_of(r, 409)["detail"] == f"job {job_id} is already {state}"
        got = client.get(f"/v1/jobs/{job_id}").json()
        assert got["state"] == state and got["priority"] == "normal"
        assert client.get(f"/v1/jobs/{job_id}/events").text == events  # the stream did not move either
        last = json.loads(events.strip().split("\n")[-1].removeprefix("data: "))
        assert last["state"] == state  # the job and its stream agree


def test_a_job_body_over_max_job_kb_is_a_413_before_it_is_parsed(tmp_path):
    app = create_app(Settings(tmp_path / "root", max_job_kb=1))
    bomb = "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: x}\n# " + "x" * 2000 + "\n"
    with TestClient(app) as c:
        assert "--max-job-kb" in problem_of(post(c, bomb), 413)["detail"]
        assert not (tmp_path / "root" / "jobs").exists() or not list((tmp_path / "root" / "jobs").iterdir())
        assert post(c).status_code == 202


def test_other_bodies_are_capped_and_a_worker_upload_at_max_blob_mb(client, tmp_path):
    job, worker, lease = leased(client)
    big = b'{"done": [' + b"1," * (2 << 20) + b'1]}'  # 4 MB and more of valid JSON
    assert "4 MB" in problem_of(client.post(f"/v1/leases/{lease['lease']}/complete", content=big,
                                            headers={"Content-Type": "application/json"}), 413)["detail"]
    app = create_app(Settings(tmp_path / "root2", max_blob_mb=1))
    with TestClient(app) as c:
        job, worker, lease = leased(c)
        url = f"/v1/leases/{lease['lease']}/files/{job['id']}/{lease['images'][0]['outputs'][0]}"
        octets = {"Content-Type": "application/octet-stream"}
        assert "--max-blob-mb" in problem_of(c.put(url, content=b"x" * ((1 << 20) + 1), headers=octets), 413)["detail"]
        problem_of(c.put(url, content=b"png", params={"worker": worker}), 415)
        assert c.put(url, content=b"png", headers=octets, params={"worker": worker}).status_code == 200


def test_a_body_without_content_length_is_cut_at_the_first_chunk_past_its_cap(tmp_path):
    """What uvicorn hands the app for a chunked upload: the body in pieces and no Content-Length. The app
    reads one piece past the cap, answers 413 and reads no further."""
    app = create_app(Settings(tmp_path / "root", max_job_kb=64))
    chunk, reads = b"#" * 16384 + b"\n", [0]

    async def receive():
        reads[0] += 1
        await asyncio.sleep(0)
        return {"type": "http.request", "body": chunk, "more_body": reads[0] < 1000}  # 16 MB, unless cut

    sent = asgi_post(app, "/v1/jobs", [(b"content-type", b"application/yaml")], receive)
    assert sent[0]["status"] == 413 and reads[0] == 64 * 1024 // len(chunk) + 1
    assert json.loads(sent[1]["body"])["detail"] == "the body is larger than 64 KB (--max-job-kb)"


@pytest.mark.parametrize("length,status", [(b"\xb2", 422), (b"9" * 5000, 413), (b"-1", 422), (b"2", 422)])
def test_a_content_length_that_is_no_number_or_past_any_cap_is_a_4xx(tmp_path, length, status):
    """Headers as uvicorn hands them over (TestClient would set its own Content-Length)."""
    app = create_app(Settings(tmp_path / "root"))

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent = asgi_post(app, "/v1/workers", [(b"content-type", b"application/json"), (b"content-length", length)],
                     receive)
    assert sent[0]["status"] == status and json.loads(sent[1]["body"])["status"] == status


def asgi_post(app, path, headers, receive):
    """A POST straight into the ASGI app (bounded in time); the messages it sent back."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "root_path": "", "app": app}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def test_unknown_routes_methods_and_files_are_problems_and_405_lists_every_method(client):
    problem_of(client.get("/nope"), 404)
    for method in ("DELETE", "OPTIONS", "PUT"):
        r = client.request(method, "/v1/jobs/x")
        assert problem_of(r, 405) and r.headers["allow"] == "GET, PATCH"
    job = post(client).json()
    for path in ("%00", "a" * 5000, "..%2f..%2fqueue.sqlite3", "\udcff".encode("utf-8", "surrogatepass").hex()):
        problem_of(client.get(f"/v1/jobs/{job['id']}/files/{path}"), 404)
    problem_of(client.get("/v1/jobs/a%00b"), 422)  # not an id this server issues


def test_a_hub_id_off_the_allow_list_is_refused_at_its_line_and_field(tmp_path):
    app = create_app(Settings(tmp_path / "root", allow_models=("stabilityai/sdxl",)))
    body = "version: 1\n# the model\nmodel: someone/other-model\nshots:\n  - {id: a, prompt: x, steps: 2, size: 64x64}\n"
    with TestClient(app) as c:
        detail = problem_of(post(c, body), 422)["detail"]
    assert detail.startswith("job.yaml:3 field 'model': the hub id 'someone/other-model' is not one"), detail
    assert "--allow-model list: stabilityai/sdxl" in detail


def test_every_fixed_path_answers_a_method_it_lacks_with_405_whatever_route_shares_its_shape(client):
    """PUT /v1/blobs/missing is no upload of a blob named `missing`: a path without parameters is answered by its
    own routes alone, for every such path of the API and every method it does not declare."""
    paths = client.app.openapi()["paths"]
    fixed = {p: {m.upper() for m in ops} for p, ops in paths.items() if "{" not in p}
    assert "/v1/blobs/missing" in fixed and {"/v1/jobs", "/v1/workers", "/v1/leases"} <= set(fixed)
    for path, declared in fixed.items():
        allow = ", ".join(m for m in METHODS if m in declared | ({"HEAD"} if "GET" in declared else set()))
        for method in sorted(set(METHODS) - declared - {"HEAD"} - ({"HEAD"} if "GET" in declared else set())):
            r = client.request(method, path, json={"digests": []})
            assert r.status_code == 405, (method, path, r.status_code, r.text)
            if method != "HEAD":
                assert problem_of(r, 405)
            assert r.headers["allow"] == allow, (method, path)
    r = client.put("/v1/blobs/missing", json={"digests": []})
    assert problem_of(r, 405) and r.headers["allow"] == "POST"
    assert client.put("/v1/blobs/" + "a" * 64, content=b"x").status_code == 422  # the upload route still answers


def test_the_openapi_schema_says_every_answer_and_describes_the_job(tmp_path):
    spec = create_app(Settings(tmp_path / "root", token="t")).openapi()
    operations = {(m.upper(), p): op for p, ops in spec["paths"].items() for m, op in ops.items()}
    for (method, path), op in operations.items():
        for status, answer in op["responses"].items():
            if int(status) >= 400:
                assert list(answer["content"]) == [PROBLEM], (method, path, status)
        assert ("requestBody" in op) == ("413" in op["responses"]), (method, path)
        assert bool(op.get("security")) == path.startswith("/v1/") == ("401" in op["responses"]), (method, path)
    job = operations["POST", "/v1/jobs"]
    assert set(job["requestBody"]["content"]) == {"application/yaml", "application/json"}
    assert {"200", "202", "401", "413", "422", "503"} <= set(job["responses"])
    assert {"404", "409"} <= set(operations["POST", "/v1/jobs/{job_id}/cancel"]["responses"])
    assert {"404", "409", "422"} <= set(operations["PATCH", "/v1/jobs/{job_id}"]["responses"])
    assert {"404", "410"} <= set(operations["POST", "/v1/leases/{lease_id}/heartbeat"]["responses"])
    assert {"200", "204", "404"} <= set(operations["POST", "/v1/leases"]["responses"])
    assert "503" in operations["GET", "/readyz"]["responses"] and "503" in operations["POST", "/v1/workers"]["responses"]
    assert list(operations["GET", "/metrics"]["responses"]["200"]["content"]) == ["text/plain"]
    assert list(operations["GET", "/v1/jobs/{job_id}/events"]["responses"]["200"]["content"]) == ["text/event-stream"]
    assert "image/png" in operations["GET", "/v1/jobs/{job_id}/files/{path}"]["responses"]["200"]["content"]
    models = spec["components"]["schemas"]
    assert set(models["JobDoc"]["properties"]) == set(TOP_KEYS) and models["JobDoc"]["additionalProperties"] is False
    assert set(models["ShotDoc"]["properties"]) == set(SHOT_KEYS)
    assert "HTTPValidationError" not in models
    open_spec = create_app(Settings(tmp_path / "root2")).openapi()  # no token: the schema asks for none
    assert "securitySchemes" not in open_spec["components"]
    assert not any(op.get("security") for ops in open_spec["paths"].values() for op in ops.values())
