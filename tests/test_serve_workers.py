"""Worker identity: the server issues worker ids on registration, leases and heartbeats must name one, and a
registration (with its metric series) is forgotten once its worker has not been seen for --lease-s and holds
no lease. Names a client invents make no rows, no series and no readiness. The protocol through TestClient,
then a real `bcg worker` that registers, waits while --max-workers are registered, and registers again when
the server restarts on a fresh root."""

import os
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.serve.api import PROBLEM, Settings, create_app
from storyboard_cli.serve import store as queue

from conftest import ROOT
from helpers.serve import ONE_IMAGE_JOB as JOB, YAML, Server, free_port, planned, start_worker, stop, worker_ids

GPU = {"memory_allocated_bytes": 1.0, "utilization": 0.5}
INVENTED = 1500


def per_worker_series(text):
    """Samples of /metrics that carry a `worker` label."""
    return [s for f in text_string_to_metric_families(text) for s in f.samples if "worker" in s.labels]


def register(c, name):
    r = c.post("/v1/workers", json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()["worker"]


def test_invented_worker_names_make_no_series_and_no_readiness(tmp_path):
    app = create_app(Settings(tmp_path / "root", lease_s=30))
    with TestClient(app) as c:
        c.post("/v1/jobs", content=JOB, headers=YAML)
        for i in range(INVENTED):
            r = c.post("/v1/leases", json={"worker": f"made-up-{i}", "gpu": GPU, "ready": True})
            assert r.status_code == 404 and r.headers["content-type"] == PROBLEM, r.text
        assert r.json()["title"] == "unknown worker" and "register again" in r.json()["detail"]
        beat = c.post("/v1/leases/x/heartbeat", json={"worker": "made-up", "gpu": GPU, "ready": True})
        assert beat.status_code == 404 and beat.json()["title"] == "unknown worker"
        text = c.get("/metrics").text
        assert per_worker_series(text) == []
        assert "bcg_workers 0.0" in text and "bcg_workers_ready 0.0" in text
        assert c.get("/readyz").status_code == 503
        assert app.state.store.stats(0, 1e12)["workers"] == []  # no row was written


def test_registration_is_bounded_and_expires_with_its_last_lease(tmp_path):
    t = [1000.0]
    app = create_app(Settings(tmp_path / "root", lease_s=30, max_workers=2), clock=lambda: t[0])
    with TestClient(app) as c:
        job = c.post("/v1/jobs", content=JOB, headers=YAML).json()
        r = c.post("/v1/workers", json={"name": "gpu-box.1"})
        assert r.status_code == 201 and r.json() == {"worker": r.json()["worker"], "name": "gpu-box.1", "lease_s": 30}
        hot, idle = r.json()["worker"], register(c, "gpu-box.1")  # the same name twice: two workers, two ids
        assert hot != idle and hot.startswith("w-")
        full = c.post("/v1/workers", json={"name": "third"})
        assert full.status_code == 503 and full.headers["content-type"] == PROBLEM
        assert 1 <= int(full.headers["Retry-After"]) <= 30
        for bad in ({"name": ""}, {"name": "a b"}, {"name": "x" * 65}, {"name": 7}, {}, [], None):
            r = c.post("/v1/workers", json=bad)
            assert r.status_code == 422 and r.headers["content-type"] == PROBLEM, (bad, r.text)
        assert c.post("/v1/workers", content=b"{not json", headers={"Content-Type": "application/json"}).status_code \
            == 422

        lease = c.post("/v1/leases", json={"worker": hot, "gpu": GPU, "ready": True}).json()
        assert lease["job"] == job["id"]
        series = {(s.name, s.labels["worker"], s.labels["name"]) for s in per_worker_series(c.get("/metrics").text)}
        assert ("bcg_worker_ready", hot, "gpu-box.1") in series and ("bcg_worker_ready", idle, "gpu-box.1") in series
        assert {w for _, w, _ in series} == {hot, idle}
        assert c.get("/readyz").json() == {"ready": True, "workers": 2, "workers_ready": 1}

        t[0] += 20  # the render takes a while: the worker heartbeats, the idle one says nothing
        assert c.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": hot, "ready": True}).status_code == 200
        t[0] += 20  # the idle one not seen for 40 s: forgotten, its slot free
        third = register(c, "third")
        assert c.post("/v1/leases", json={"worker": idle}).status_code == 404  # forgotten to make room
        t[0] += 11  # the worker stopped heartbeating 31 s ago (killed): its lease and its registration end
        app.state.store.sweep(t[0])
        r = c.post(f"/v1/leases/{lease['lease']}/heartbeat", json={"worker": hot, "ready": True})
        assert r.status_code == 404 and r.json()["title"] == "unknown worker"
        assert {s.labels["worker"] for s in per_worker_series(c.get("/metrics").text)} == {third}
        assert c.get("/readyz").status_code == 503

        again = register(c, "gpu-box.1")  # what the worker does on a 404
        assert again not in (hot, idle)
        relet = c.post("/v1/leases", json={"worker": again, "ready": True}).json()
        assert relet["job"] == job["id"]  # the lost batch, leased again
        assert c.get(f"/v1/jobs/{job['id']}").json()["images"][0]["attempts"] == 2
        assert c.get("/readyz").json() == {"ready": True, "workers": 2, "workers_ready": 1}


def test_a_sweep_alone_forgets_silent_workers_and_a_live_lease_keeps_its_worker(tmp_path):
    store = queue.Store(tmp_path)
    ids = [store.register_worker(f"w{i}", now=0, max_workers=3, ttl=5) for i in range(3)]
    store.seen(ids[0], {"utilization": 1.0}, now=4, ready=True)
    store.sweep(now=6)  # no lease expired, no worker calls: the silent ones are forgotten all the same
    assert [w.id for w in store.stats(now=6, worker_window_s=5)["workers"]] == [ids[0]]
    for silent in ids[1:]:
        with pytest.raises(queue.UnknownWorker):
            store.seen(silent, None, now=6)
    assert store.readiness(now=6, window_s=5) == (1, 1)
    store.submit(planned("j"), None, 100, now=6)
    lease = store.lease(ids[0], now=6, ttl=5)
    assert store.heartbeat(lease.lease, now=10, ttl=5)  # a heartbeat that does not name its worker
    store.sweep(now=12)  # not seen for 6 s, but its lease lives until 15: kept
    store.seen(ids[0], None, now=12)
    store.sweep(now=18)
    assert store.readiness(now=18, window_s=5) == (0, 0)
    store.close()


def test_a_restart_does_not_count_the_servers_downtime_against_its_workers_or_their_leases(tmp_path):
    store = queue.Store(tmp_path)
    busy, idle, gone = (store.register_worker(n, now=0, max_workers=3, ttl=5) for n in ("busy", "idle", "gone"))
    store.submit(planned("j"), None, 100, now=0)
    lease = store.lease(busy, now=0, ttl=5)
    store.close()
    store = queue.Store(tmp_path)  # the server starts again 100 s later: every registration and lease is past due
    store.restarted(now=100, ttl=5)
    store.sweep(now=101)
    store.seen(idle, None, now=104)  # it asks within --lease-s of the restart: the same id (and calibration)
    assert store.heartbeat(lease.lease, now=104, ttl=5, worker=busy)  # its lease lives on: no attempt spent
    store.sweep(now=106)  # the one that did not outlive the outage is forgotten --lease-s after the restart
    with pytest.raises(queue.UnknownWorker):
        store.seen(gone, None, now=106)
    assert {w.id for w in store.stats(now=106, worker_window_s=5)["workers"]} == {busy, idle}
    assert store.stats(now=106, worker_window_s=5)["counters"].get(queue.EXPIRED, 0) == 0
    store.close()


@pytest.mark.slow  # a server (restarted once), two `bcg worker` processes rendering tiny jobs on the CPU
def test_a_real_worker_registers_waits_for_a_slot_and_registers_again_after_a_restart(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    port = free_port()
    server = Server(tmp_path / "root", port).start(lease_s=2, gpus="none", extra=("--max-workers", "1"))
    workers = []
    try:
        bad = subprocess.run([sys.executable, "-m", "storyboard_cli", "worker", "--server", server.url, "--device",
                              "cpu", "--name", "no spaces"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and "worker name" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr

        workers.append(start_worker(server.url, "first"))
        rendered_by(server, job, "first")
        assert httpx.post(server.url + "/v1/workers", json={"name": "x"}, timeout=10).status_code == 503
        workers.append(start_worker(server.url, "second"))  # 503 too: it waits Retry-After, and asks again
        stop(workers[0])  # kill -9: its registration expires --lease-s later, and "second" takes the slot
        before = rendered_by(server, job, "second")

        stop(server.proc)
        server = Server(tmp_path / "fresh-root", port).start(lease_s=2, gpus="none")  # knows no worker id
        after = rendered_by(server, job, "second")
        assert after.isdisjoint(before)  # registered again, with a new id
    finally:
        for w in workers:
            stop(w)
        stop(server.proc)


def rendered_by(server, job, name):
    """Submits the job, waits until it succeeds; asserts the worker called `name` rendered it under an id the
    server issued; returns that worker's ids."""
    r = httpx.post(server.url + "/v1/jobs", content=job.read_bytes(), headers=YAML, timeout=10)
    assert r.status_code == 202, r.text
    done = server.wait(r.json()["id"], lambda j: j["state"] in ("succeeded", "failed"))
    assert done["state"] == "succeeded", done
    ids = worker_ids(server.url, name)
    running = [e for e in httpx.get(f"{server.url}/v1/jobs/{done['id']}/events", timeout=10).text.split("\n\n")
               if "event: running" in e]
    assert ids and all(i.startswith("w-") for i in ids) and any(i in running[0] for i in ids), (ids, running)
    return ids


def test_strikes_in_a_row_quarantine_a_worker_and_a_completion_ends_them(tmp_path):
    """A lease given back for the worker's own machine queues its images again with their attempts; the worker's
    3rd in a row quarantines it: no more leases (403), shown in /metrics, not counted ready. A completion between
    strikes ends the run of them."""
    app = create_app(Settings(tmp_path / "root", lease_s=30))
    with TestClient(app) as c:
        job = c.post("/v1/jobs", content=JOB, headers=YAML).json()
        flaky, broken = register(c, "flaky"), register(c, "broken")

        def strike(worker):
            lease = c.post("/v1/leases", json={"worker": worker, "ready": True}).json()
            r = c.post(f"/v1/leases/{lease['lease']}/fail", json={"worker": worker, "reason": "CUDA error: x"})
            assert r.status_code == 200, r.text
            return lease

        for _ in range(2):
            strike(flaky)
        lease = c.post("/v1/leases", json={"worker": flaky, "ready": True}).json()
        assert c.post(f"/v1/leases/{lease['lease']}/complete", json={"worker": flaky}).status_code == 200
        for _ in range(2):
            strike(flaky)  # 2 in a row again: not quarantined
        for _ in range(3):
            strike(broken)
        assert c.get(f"/v1/jobs/{job['id']}").json()["images"][0] | {"state": "queued", "attempts": 0} == \
            c.get(f"/v1/jobs/{job['id']}").json()["images"][0]  # queued, no attempt spent
        r = c.post("/v1/leases", json={"worker": broken, "ready": True})
        assert r.status_code == 403 and r.headers["content-type"] == PROBLEM
        assert r.json()["title"] == "worker quarantined" and "CUDA error: x" in r.json()["detail"]
        assert c.post("/v1/leases", json={"worker": flaky, "ready": True}).status_code == 200
        series = {(s.name, s.labels.get("name")): s.value for f in text_string_to_metric_families(c.get("/metrics").text)
                  for s in f.samples}
        assert series[("bcg_worker_quarantined", "broken")] == 1 and series[("bcg_worker_quarantined", "flaky")] == 0
        assert series[("bcg_worker_strikes_total", None)] == 7 and series[("bcg_worker_quarantines_total", None)] == 1
        assert series[("bcg_workers_ready", None)] == 1
        assert c.get("/readyz").json() == {"ready": True, "workers": 2, "workers_ready": 1}


def test_the_ended_jobs_whose_report_predates_their_end_are_the_ones_rebuilt(tmp_path):
    from storyboard_cli.folder.layout import REPORT_JSON
    from storyboard_cli.serve.folders import stale_views

    folders = {name: tmp_path / name for name in ("fresh", "stale", "missing")}
    for name in ("fresh", "stale"):
        folders[name].mkdir()
        (folders[name] / REPORT_JSON).write_text("{}")
    os.utime(folders["fresh"] / REPORT_JSON, (1000.0, 1000.0))  # written after the job ended at 900
    os.utime(folders["stale"] / REPORT_JSON, (800.0, 800.0))  # the last write was while it ran
    assert stale_views([("f", 900.0, folders["fresh"]), ("s", 900.0, folders["stale"]),
                        ("m", 900.0, folders["missing"])]) == ["s", "m"]
