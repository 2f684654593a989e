"""The queue page's API through FastAPI's TestClient (no server process, no model): the jobs a page at a time and
filtered by state, the workers, the queue's summary, retry of failed images, move to front, drain and resume of a
worker, pause and resume of dispatch (both surviving a restart on the same root), the one global event stream
resumed after Last-Event-ID, the tokens each route needs, and /ui with its content security policy."""

import hashlib
import re

import pytest
from fastapi.testclient import TestClient

from storyboard_cli.serve.api import PROBLEM, Settings, create_app
from storyboard_cli.serve.ui_routes import page

JOB = """version: 1
model: tiny
defaults: {steps: 2, size: 64x64}
shots:
  - {id: a, prompt: a castle, seed: 1, candidates: 2}
"""
YAML = {"Content-Type": "application/yaml"}
SIZES = ("64x64", "64x72", "72x64")  # jobs of other sizes share no batch (no rider fills one job's lease)


def sized(size):
    return JOB.replace("64x64", size)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def client(tmp_path, clock):
    app = create_app(Settings(tmp_path / "root", max_queue_images=1000, lease_s=30), clock=clock)
    with TestClient(app) as c:
        yield c


def post(c, body=JOB, priority="normal", **headers):
    r = c.post(f"/v1/jobs?priority={priority}", content=body, headers={**YAML, **headers})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def register(c, name, **headers):
    r = c.post("/v1/workers", json={"name": name}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()["worker"]


def lease(c, worker, **extra):
    return c.post("/v1/leases", json={"worker": worker, **extra})


def done(c, worker, got):
    """Completes a lease with every image done (their files written as a worker would)."""
    out = c.app.state.settings.root / "jobs"
    lines = {}
    for image in got["images"]:
        path = out / image["job"] / "out" / image["outputs"][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"png")
        lines.setdefault(image["job"], []).append({"path": image["outputs"][0],
                                                   "sha256": hashlib.sha256(b"png").hexdigest()})
    r = c.post(f"/v1/leases/{got['lease']}/complete",
               json={"worker": worker, "done": [i["id"] for i in got["images"]], "manifest": lines})
    assert r.status_code == 200, r.text


def events(c, after=None, **headers):
    """The global stream up to now (follow=false), as (id, event, data) triples, and its `retry:`."""
    query = "?follow=false" + (f"&after={after}" if after is not None else "")
    text = c.get("/v1/events" + query, headers=headers).text
    retry = re.search(r"^retry: (\d+)$", text, re.M)
    found = re.findall(r"^id: (\d+)\nevent: (\S+)\ndata: (.*)$", text, re.M)
    return [(int(i), e, d) for i, e, d in found], retry and int(retry[1])


def test_jobs_come_a_page_at_a_time_newest_first_with_no_cap_on_the_total(client, clock):
    ids = []
    for _ in range(7):
        ids.append(post(client))
        clock.t += 1
    pages, cursor = [], None
    while True:
        r = client.get("/v1/jobs?limit=3" + (f"&cursor={cursor}" if cursor else "")).json()
        pages.append([j["id"] for j in r["jobs"]])
        cursor = r["next"]
        if cursor is None:
            break
    assert pages == [ids[::-1][:3], ids[::-1][3:6], ids[::-1][6:]]
    row = client.get("/v1/jobs?limit=1").json()["jobs"][0]
    assert row["images"] == 2 and row["images_by_state"] == {"queued": 2} and row["queue_position"] == 12
    assert row["sheet_url"].endswith(f"/v1/jobs/{ids[-1]}/files/index.html") and row["workers"] == []
    assert client.get("/v1/jobs?limit=501").status_code == 422  # a page is bounded, the walk is not
    assert client.get("/v1/jobs?cursor=abc").status_code == 422


def test_jobs_filtered_by_state_across_pages(client, clock):
    ids = []
    for _ in range(6):
        ids.append(post(client))
        clock.t += 1
    for job_id in ids[1::2]:
        client.post(f"/v1/jobs/{job_id}/cancel")
    w = register(client, "w")
    got = lease(client, w).json()  # the oldest job's two images
    assert got["job"] == ids[0]

    def walk(query):
        found, cursor = [], None
        while True:
            r = client.get(f"/v1/jobs?limit=1&{query}" + (f"&cursor={cursor}" if cursor else "")).json()
            found += [(j["id"], j["state"]) for j in r["jobs"]]
            if (cursor := r["next"]) is None:
                return found

    assert walk("state=canceled") == [(i, "canceled") for i in ids[1::2][::-1]]
    assert walk("state=queued&state=running") == [(ids[4], "queued"), (ids[2], "queued"), (ids[0], "running")]
    assert client.get("/v1/jobs?state=running").json()["jobs"][0]["workers"] == [w]
    done(client, w, got)
    assert walk("state=succeeded") == [(ids[0], "succeeded")]
    row = client.get("/v1/jobs?state=succeeded").json()["jobs"][0]
    assert row["latest_url"].endswith("/files/a/a_c0_s1.png") or row["latest_url"].endswith("/files/a/a_c1_s2.png")
    assert problem_of(client.get("/v1/jobs?state=lost"), 422)


def problem_of(r, status):
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM and "\n" not in r.json()["detail"]
    return r.json()


def test_the_global_stream_has_monotonic_ids_and_resumes_after_last_event_id(client, clock):
    a = post(client)
    client.post("/v1/queue/pause")
    b = post(client, priority="urgent")
    client.post(f"/v1/jobs/{a}/cancel")
    client.post("/v1/queue/resume")
    got, retry = events(client)
    assert retry == 1000
    assert [(e, '"job": "' + a + '"' in d or '"job": "' + b + '"' in d) for _, e, d in got] == [
        ("queued", True), ("queue_paused", False), ("queued", True), ("canceled", True), ("end", True),
        ("queue_resumed", False)]
    ids = [i for i, _, _ in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # resumed after any id: exactly the events after it, none lost, none repeated
    for k, (seen, _, _) in enumerate(got):
        assert events(client, **{"Last-Event-ID": str(seen)})[0] == got[k + 1:]
        assert events(client, after=seen)[0] == got[k + 1:]
    assert events(client, after=0, **{"Last-Event-ID": str(ids[3])})[0] == got[4:]  # the later of the two
    assert events(client, after=ids[4], **{"Last-Event-ID": str(ids[3])})[0] == got[5:]
    one = client.get(f"/v1/events?follow=false&job={b}").text
    assert re.findall(r"^event: (\S+)$", one, re.M) == ["queued"]
    assert problem_of(client.get("/v1/events", headers={"Last-Event-ID": "-1"}), 422)
    # the last id a page reads with the queue is where its stream starts
    assert client.get("/v1/queue").json()["last_event"] == ids[-1] == client.get("/v1/jobs").json()["last_event"]


def test_retry_queues_a_jobs_failed_images_again(client):
    job = post(client)
    w = register(client, "w")
    got = lease(client, w).json()
    ids = [i["id"] for i in got["images"]]
    client.post(f"/v1/leases/{got['lease']}/complete", json={"worker": w, "failed": {str(ids[0]): "bad prompt"},
                                                             "done": []})  # the other image: queued again
    view = client.get(f"/v1/jobs/{job}").json()
    assert [(i["state"], i["attempts"], i["worker"]) for i in view["images"]] == [("failed", 1, w), ("queued", 0, w)]
    assert problem_of(client.post("/v1/jobs/nope/retry"), 404)
    r = client.post(f"/v1/jobs/{job}/retry")
    assert r.status_code == 200 and [(i["state"], i["attempts"], i["reason"]) for i in r.json()["images"]] == [
        ("queued", 0, None)] * 2
    assert problem_of(client.post(f"/v1/jobs/{job}/retry"), 409)["title"] == "nothing to retry"
    # a failed job runs again: its stream goes on after its `end`
    got = lease(client, w).json()
    client.post(f"/v1/leases/{got['lease']}/complete",
                json={"worker": w, "failed": {str(i["id"]): "again" for i in got["images"]}})
    assert client.get(f"/v1/jobs/{job}").json()["state"] == "failed"
    assert client.post(f"/v1/jobs/{job}/retry").json()["state"] == "queued"
    kinds = re.findall(r"^event: (\S+)$", client.get(f"/v1/events?follow=false&job={job}").text, re.M)
    assert kinds[-4:] == ["running", "images", "end", "retried"]
    client.post(f"/v1/jobs/{job}/cancel")
    assert problem_of(client.post(f"/v1/jobs/{job}/retry"), 409)["title"] == "job canceled"
    stream = client.get(f"/v1/jobs/{job}/events").text  # the job's own stream: through the retry, to its last end
    assert re.findall(r"^event: (\S+)$", stream, re.M)[-3:] == ["retried", "canceled", "end"]


def test_move_to_front_ranks_a_job_ahead_of_every_open_one_until_its_priority_changes(client, clock):
    urgent = post(client, sized(SIZES[0]), priority="urgent")
    clock.t += 10
    normal, bulk = post(client, sized(SIZES[1])), post(client, sized(SIZES[2]), priority="bulk")
    assert client.get(f"/v1/jobs/{bulk}").json()["queue_position"] == 4
    r = client.post(f"/v1/jobs/{bulk}/front")
    assert r.status_code == 200 and r.json()["queue_position"] == 0
    assert client.get(f"/v1/jobs/{urgent}").json()["queue_position"] == 2
    assert [j["front"] for j in client.get("/v1/jobs").json()["jobs"]] == [True, False, False]
    w = register(client, "w")
    assert lease(client, w).json()["job"] == bulk
    client.patch(f"/v1/jobs/{normal}", json={"priority": "normal"})
    client.post(f"/v1/jobs/{normal}/front")  # ahead of the urgent job too
    assert lease(client, w).json()["job"] == normal
    assert lease(client, w).json()["job"] == urgent
    assert problem_of(client.post("/v1/jobs/nope/front"), 404)


def test_a_drained_worker_gets_no_new_lease_and_its_current_batch_finishes(client, clock):
    for size in SIZES:
        post(client, sized(size))
        clock.t += 1
    a, b = register(client, "a"), register(client, "b")
    got = lease(client, a, gpu={"memory_allocated_bytes": 2e9, "total_memory_bytes": 8e10, "power_watts": 410.0},
                ready=True, warm=["m1", "m2"]).json()
    r = client.post(f"/v1/workers/{a}/drain")
    assert r.status_code == 200 and r.json()["state"] == "draining" and r.json()["job"] == got["job"]
    assert lease(client, a).status_code == 204  # no new lease
    assert client.post(f"/v1/leases/{got['lease']}/heartbeat", json={"worker": a}).status_code == 200
    clock.t += 4
    done(client, a, got)  # its current batch lands as any other
    assert lease(client, a).status_code == 204
    assert lease(client, b).status_code == 200  # the other worker renders on
    table = {w["id"]: w for w in client.get("/v1/workers").json()["workers"]}
    assert table[a]["state"] == "drained" and table[a]["draining"] and table[a]["images"] == 0
    assert table[b]["state"] == "rendering" and table[b]["shape"].startswith("64x72 ") and table[b]["images"] == 2
    assert table[a]["images_per_s"] > 0 and table[a]["warm"] == [] and table[b]["gpu"] is None
    assert client.get("/v1/queue").json()["drained"] == ["a"]
    assert client.post(f"/v1/workers/{a}/resume").json()["state"] in ("idle", "cold")
    assert lease(client, a).status_code == 200
    assert problem_of(client.post("/v1/workers/w-000000000000/drain"), 404)
    kinds = [e for _, e, _ in events(client)[0]]
    assert kinds.count("worker_drained") == 1 and kinds.count("worker_resumed") == 1


def test_the_workers_table_shows_gpu_figures_warm_mixes_and_heartbeat_age(client, clock):
    post(client)
    w = register(client, "gpu-0")
    gpu = {"memory_allocated_bytes": 2e9, "total_memory_bytes": 8e10, "power_watts": 410.0}
    got = lease(client, w, gpu=gpu, ready=True, warm=["m1", "m2"]).json()
    clock.t += 2.5
    row = client.get("/v1/workers").json()["workers"][0]
    assert (row["name"], row["state"], row["job"], row["lease"]) == ("gpu-0", "rendering", got["job"], got["lease"])
    assert row["gpu"] == gpu and row["warm"] == ["m1", "m2"] and row["heartbeat_age_s"] == 2.5 and row["ready"]
    view = client.get(f"/v1/jobs/{got['job']}").json()
    assert [(i["worker"], i["seconds"]) for i in view["images"]] == [(w, 2.5)] * 2
    clock.t += 60  # not seen within --lease-s, its lease expired: lost, then forgotten
    client.post("/v1/leases", json={"worker": register(client, "other")})
    assert [r["name"] for r in client.get("/v1/workers").json()["workers"]] == ["other"]


def test_pause_holds_dispatch_and_survives_a_restart_as_does_a_drain(tmp_path, clock):
    settings = Settings(tmp_path / "root", lease_s=30)
    with TestClient(create_app(settings, clock=clock)) as c:
        post(c)
        a, b = register(c, "a"), register(c, "b")
        assert c.post("/v1/queue/pause").json()["paused"] is True
        assert c.post("/v1/queue/pause").json()["paused"] is True  # again: no change, no second event
        assert c.post(f"/v1/workers/{b}/drain").status_code == 200
        assert lease(c, a).status_code == 204
        c.app.state.store.close()
    with TestClient(create_app(Settings(tmp_path / "root", lease_s=30), clock=clock)) as c:  # the server restarted
        q = c.get("/v1/queue").json()
        assert q["paused"] and q["paused_since"] == 1000.0 and q["drained"] == ["b"]
        assert q["tiers"]["normal"] == {"queued": 2, "rendering": 0, "jobs": 1, "oldest_s": 0.0}
        assert lease(c, a).status_code == 204
        assert c.post("/v1/queue/resume").json()["paused"] is False
        assert lease(c, b).status_code == 204  # still drained
        assert lease(c, register(c, "b")).status_code == 204  # its name is: the worker started again is drained too
        assert lease(c, a).status_code == 200
        kinds = [e for _, e, _ in events(c)[0]]
        assert kinds.count("queue_paused") == 1 and kinds.count("queue_resumed") == 1
        scraped = c.get("/metrics").text
        assert "bcg_dispatch_paused 0.0" in scraped and "bcg_workers_drained 1.0" in scraped
        c.post("/v1/queue/pause")
        assert "bcg_dispatch_paused 1.0" in c.get("/metrics").text


def test_the_queue_summary_per_priority(client, clock):
    post(client, priority="bulk")
    clock.t += 30
    post(client, priority="urgent")
    w = register(client, "w")
    lease(client, w)  # the urgent job's two images
    clock.t += 5
    q = client.get("/v1/queue").json()
    assert q["tiers"] == {"urgent": {"queued": 0, "rendering": 2, "jobs": 1, "oldest_s": 0.0},
                          "normal": {"queued": 0, "rendering": 0, "jobs": 0, "oldest_s": 0.0},
                          "bulk": {"queued": 2, "rendering": 0, "jobs": 1, "oldest_s": 35.0}}
    assert (q["leases"], q["workers"], q["workers_ready"], q["paused"]) == (1, 1, 0, False)


def test_the_client_token_guards_the_page_api_and_the_page_itself_is_open(tmp_path):
    app = create_app(Settings(tmp_path / "root", token="client", worker_token="worker"))
    client, worker = {"Authorization": "Bearer client"}, {"Authorization": "Bearer worker"}
    with TestClient(app) as c:
        job = post(c, **client)
        w = register(c, "w", **worker)
        reads = ["/v1/jobs", "/v1/workers", "/v1/queue", "/v1/events?follow=false"]
        writes = [f"/v1/jobs/{job}/front", f"/v1/jobs/{job}/retry", f"/v1/workers/{w}/drain",
                  f"/v1/workers/{w}/resume", "/v1/queue/pause", "/v1/queue/resume"]
        for path in reads:
            assert [c.get(path, headers=h).status_code for h in ({}, worker, client)] == [401, 401, 200], path
        for path in writes:
            assert [c.post(path, headers=h).status_code for h in ({}, worker)] == [401, 401], path
            assert c.post(path, headers=client).status_code in (200, 409), path
        assert c.post("/v1/workers", json={"name": "x"}, headers=client).status_code == 401  # still the worker's
        r = c.get("/ui")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "Authorization" in r.text and "sessionStorage" in r.text


def test_the_page_runs_only_its_own_script_and_style(client):
    r = client.get("/ui")
    html, csp = page()
    assert r.text == html and r.headers["content-security-policy"] == csp
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp and "connect-src 'self'" in csp
    assert len(re.findall(r"<script>", html)) == 1 and len(re.findall(r"<style>", html)) == 1
    assert " style=" not in html and "<script src" not in html and "http://" not in html and "https://" not in html
    assert "EventSource" not in html  # a stream with the token in a header, not in its URL


def test_the_openapi_document_describes_the_page_api(tmp_path):
    spec = create_app(Settings(tmp_path / "root", token="t")).openapi()
    paths = spec["paths"]
    for path, method in (("/v1/jobs", "get"), ("/v1/workers", "get"), ("/v1/queue", "get"),
                         ("/v1/jobs/{job_id}/retry", "post"), ("/v1/jobs/{job_id}/front", "post"),
                         ("/v1/workers/{worker_id}/drain", "post"), ("/v1/workers/{worker_id}/resume", "post"),
                         ("/v1/queue/pause", "post"), ("/v1/queue/resume", "post"), ("/v1/events", "get")):
        op = paths[path][method]
        assert op["security"] == [{"client": []}] and "401" in op["responses"], (path, method)
    assert list(paths["/v1/events"]["get"]["responses"]["200"]["content"]) == ["text/event-stream"]
    assert "last-event-id" in [p["name"].lower() for p in paths["/v1/events"]["get"]["parameters"]]
    assert "security" not in paths["/ui"]["get"]
    assert {"JobPage", "JobRow", "WorkersView", "QueueView", "QueueEvent"} <= set(spec["components"]["schemas"])


def test_a_server_started_again_on_a_clock_set_back_holds_a_dead_workers_lease_no_longer_than_lease_s(tmp_path, clock):
    """The server stops with a lease held, and starts again on a machine whose clock was set an hour back meanwhile:
    the lease counts as renewed at the new start, expiring --lease-s later as after any restart, not an hour later."""
    with TestClient(create_app(Settings(tmp_path / "root", lease_s=30), clock=clock)) as c:
        post(c)
        assert lease(c, register(c, "gone")).status_code == 200
        c.app.state.store.close()
    clock.t -= 3600
    with TestClient(create_app(Settings(tmp_path / "root", lease_s=30), clock=clock)) as c:
        clock.t += 31
        assert lease(c, register(c, "next")).status_code == 200  # the lease expired: its images queued again
