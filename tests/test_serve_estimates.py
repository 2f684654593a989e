"""The server's time estimates (serve/estimates.py): each worker calibrated from its leases' batch timings against
the images' estimated seconds, and from it a job's eta_s, a full queue's Retry-After and the stale-lease alarm."""

import json
import os
import time
from dataclasses import replace

import pytest

from storyboard_cli.folder.layout import REPORT_JSON
from storyboard_cli.job.estimate import image_seconds
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.serve import metrics
from storyboard_cli.serve.estimates import STALE, Calibration
from storyboard_cli.serve.store import QueueFull, Store, Work

from conftest import write_job
from helpers.serve import planned


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def job(job_id, n, est, batch=4, priority="normal"):
    p = planned(job_id, n, priority=priority, batch=batch)
    return replace(p, images=tuple(replace(i, est=est) for i in p.images))


def register(store, name, now=0.0):
    return store.register_worker(name, now=now, max_workers=64, ttl=60)


def land(store, worker, now, seconds):
    """The worker leases the next batch at `now` and completes it `seconds` later, saying so in its batch timings."""
    lease = store.lease(worker, now=now, ttl=600)
    ids = [i.id for i in lease.images]
    assert store.complete(lease.lease, ids, [], {}, now + seconds, Work((("64x64", len(ids), seconds, 4),)),
                          worker=worker)
    return lease


def test_calibration_is_the_median_of_a_workers_last_leases():
    c = Calibration()
    assert c.factor("w") is None and c.rate(["w"]) is None
    for measured in (40.0, 8.0, 8.4):  # the first lease loaded the model: it does not set the factor alone
        c.observe("w", measured, 4.0)
    assert c.factor("w") == pytest.approx(2.1)
    c.observe("v", 16.0, 4.0)
    assert c.rate(["w", "v", "never-seen"]) == pytest.approx(1 / 2.1 + 1 / 4.0)


def test_eta_from_calibrated_workers(store):
    a, b = register(store, "a"), register(store, "b")
    store.submit(job("first", 12, est=1.0), None, 100, now=0)
    assert store.job("first", 0)["eta_s"] is None  # nothing measured, nothing drained yet
    land(store, a, now=1, seconds=8.0)  # 4 images estimated at 4 s took 8: worker a runs at 2x the table
    eta = store.job("first", 9)["eta_s"]
    assert eta == pytest.approx(8 * 2.0)  # 8 images of 1 s left, at a's pace alone
    land(store, b, now=9, seconds=16.0)  # worker b at 4x
    store.submit(job("second", 4, est=0.5), None, 100, now=30)
    # the second job: the first's 4 queued images (4 s of table) ranked ahead, then its own 2 s, over a and b together
    rate = 1 / 2.0 + 1 / 4.0
    assert store.job("second", 30)["eta_s"] == pytest.approx(round((4 + 2) / rate, 1))
    assert store.job("first", 30)["eta_s"] == pytest.approx(round(4 / rate, 1))
    # a worker not seen for its ttl no longer counts: b's share of the drain is gone
    store.heartbeat("none", now=50, ttl=600, worker=a)  # a asks on; b, last seen at 9, lapses at 69
    assert store.job("second", 70)["eta_s"] == pytest.approx(6 * 2.0)


def test_a_server_started_again_keeps_its_workers_calibration(tmp_path):
    """The kept ratios live in the queue file: the same workers' factors after a restart, before any new lease lands;
    only the last KEPT per worker are kept, and a worker the queue forgot takes its ratios with it."""
    from storyboard_cli.serve.estimates import KEPT

    store = Store(tmp_path)
    a, b = register(store, "a"), register(store, "b")
    store.submit(job("first", 4 * (KEPT + 5), est=1.0), None, 1000, now=0)
    for n in range(KEPT + 2):  # a: 2x the table, after two slow first leases that fall out of the kept window
        land(store, a, now=n, seconds=40.0 if n < 2 else 8.0)
    land(store, b, now=20, seconds=16.0)
    before = (store.calibration.factor(a), store.calibration.factor(b))
    assert before == (pytest.approx(2.0), pytest.approx(4.0))
    assert store.db.execute("SELECT COUNT(*) FROM calibration").fetchone()[0] == KEPT + 1
    store.db.execute("DELETE FROM workers WHERE id = ?", (b,))  # forgotten (as an expired registration is)
    store.close()
    again = Store(tmp_path)
    try:
        assert (again.calibration.factor(a), again.calibration.factor(b)) == (pytest.approx(2.0), None)
        assert again.job("first", 40)["eta_s"] is not None  # from a's factor, with no lease since the start
    finally:
        again.close()


def test_an_unpriced_image_makes_the_eta_the_drained_images_per_second(store):
    """A job whose images no table prices (est 0) has no calibrated eta: a zero would say "done now". The job's
    eta_s is then its images ahead and left over the images/s drained, as before any calibration."""
    a = register(store, "a")
    store.submit(job("first", 12, est=1.0), None, 100, now=0)
    land(store, a, now=1, seconds=8.0)  # a calibrated, 4 images drained
    store.submit(job("unpriced", 4, est=0.0, priority="urgent"), None, 100, now=9)  # nothing ranked ahead of it
    eta = store.job("unpriced", 9)["eta_s"]
    assert eta and eta > 0
    assert store.job("first", 9)["eta_s"] > 0  # an unpriced image ahead of it: its eta falls back too


def test_a_lease_past_one_and_a_half_times_its_estimate_is_stale(store):
    w = register(store, "w")
    store.submit(job("j", 8, est=1.0), None, 100, now=0)
    land(store, w, now=0, seconds=8.0)  # calibrated: 2x
    store.lease(w, now=10, ttl=600)  # 4 images: 4 s of table, 8 s on w, stale after 12 s
    reg = metrics.registry(store, 1e9, clock=lambda: 10 + STALE * 8.0 - 0.5)
    assert store.stale_leases(10 + STALE * 8 - 0.5) == 0 and "bcg_stale_leases 0.0" in metrics.exposition(reg).decode()
    reg = metrics.registry(store, 1e9, clock=lambda: 10 + STALE * 8.0 + 0.5)
    text = metrics.exposition(reg).decode()
    assert "bcg_stale_leases 1.0" in text and 'bcg_worker_estimate_ratio{name="w",worker="' + w + '"} 2.0' in text


def test_retry_after_divides_the_excess_by_the_calibrated_drain(store):
    w = register(store, "w")
    store.submit(job("j", 8, est=1.5), None, 8, now=0)
    land(store, w, now=0, seconds=3.0)  # 6 s of table in 3 s: 0.5x, so 2 table-seconds a second
    with pytest.raises(QueueFull) as refused:
        store.submit(job("k", 7, est=1.5), None, 8, now=4)
    # 4 open + 7 new against 8: 3 images over, at 2 / 1.5 images a second
    assert refused.value.retry_after == 3  # ceil(3 / (2 / 1.5)) = ceil(2.25)
    with pytest.raises(QueueFull) as refused:
        store.submit(job("k", 8, est=1.5), None, 8, now=4)
    assert refused.value.retry_after == 3  # ceil(4 / (4 / 3)) = 3, where the measured rate (1/s) says 4


def test_an_image_carries_its_share_of_its_batch_on_the_servers_table(tmp_path, monkeypatch):
    """What intake stores: on a machine without a measurement, the shipped table extrapolated by FLOPs (a unit the
    workers' calibration turns into their seconds): a ControlNet image costs more, a padded batch's images share it."""
    monkeypatch.setenv("BCG_CACHE", str(tmp_path / "empty"))
    j = load_job(write_job(tmp_path, """version: 1
model: tiny
controlnet: tiny
shots:
  - {id: a, prompt: x, steps: 4, size: 64x64, candidates: 2}
  - {id: b, prompt: y, steps: 4, size: 64x64, candidates: 2, control: {image: c.png}}
  - {id: c, prompt: z, steps: 8, size: 128x128, candidates: 1}
""".replace("c.png", str(__import__("conftest").ROOT / "jobs" / "control" / "hero_pose.png"))))
    items = work_items(j)
    est = image_seconds(make_batches(items, j.buckets), j.model, "cpu")
    a, _, b, _, c = (est[id(i)] for i in items)
    assert 0 < a < b < c


@pytest.mark.slow  # a real `bcg serve` and `bcg worker`
def test_a_real_worker_is_calibrated_by_its_leases_and_a_queued_jobs_eta_follows(tmp_path):
    """Through the real processes: a CPU worker's completions carry its batch timings, the server calibrates that
    worker from them (`bcg_worker_estimate_ratio` on /metrics), and a job queued behind paused dispatch has an
    `eta_s`."""
    import re

    import httpx

    from helpers.serve import Server, eventually, free_port, start_worker, stop

    text = """version: 1
name: calib
model: tiny
defaults: {steps: 3, size: 64x64}
buckets: [2]
shots:
  - {id: a, prompt: a lighthouse at night, candidates: 2, seed: 1}
"""
    path = write_job(tmp_path, text)
    server = Server(tmp_path / "root", free_port()).start(gpus="none")
    worker = start_worker(server.url, "calib")
    try:
        first = httpx.post(server.url + "/v1/jobs", content=path.read_bytes(),
                           headers={"Content-Type": "application/yaml"}).json()["id"]
        assert server.wait(first, lambda j: j["state"] in ("succeeded", "failed"))["state"] == "succeeded"
        scrape = httpx.get(server.url + "/metrics").text
        ratio = re.search(r'bcg_worker_estimate_ratio\{[^}]*name="calib"[^}]*\} ([0-9.e+-]+)', scrape)
        assert ratio is not None and float(ratio.group(1)) > 0, scrape[-2000:]
        assert httpx.post(server.url + "/v1/queue/pause").status_code < 300
        second = httpx.post(server.url + "/v1/jobs", content=path.read_bytes().replace(b"seed: 1", b"seed: 7"),
                            headers={"Content-Type": "application/yaml"}).json()["id"]
        queued = server.job(second)
        # a fresh cache prices tiny at nothing: the eta is the images/s the first job drained, never a zero
        assert queued["state"] == "queued" and queued["eta_s"] and queued["eta_s"] > 0, queued
        server.kill_everything()  # the server alone (kill -9): its worker runs on and asks it again
        # as if the kill had landed between the first job's end and its folder's last rebuild: the report on disk is
        # one written while the job ran; the server's start rebuilds it
        report = tmp_path / "root" / "jobs" / first / "out" / REPORT_JSON
        report.write_text(json.dumps(json.loads(report.read_text()) | {"status": "running"}))
        os.utime(report, (1.0, 1.0))
        time.sleep(4)  # down longer than --lease-s (3 s): the outage is not held against the worker
        server.start(gpus="none")
        eventually(lambda: json.loads(report.read_text()), lambda r: r["status"] == "done", 30)
        pattern = r'bcg_worker_estimate_ratio\{[^}]*name="calib"[^}]*\} ([0-9.e+-]+)'
        again = eventually(lambda: httpx.get(server.url + "/metrics").text, lambda t: re.search(pattern, t), 30)
        assert float(re.search(pattern, again).group(1)) == float(ratio.group(1))  # kept: no lease landed since
        assert server.job(second)["state"] == "queued"  # dispatch still paused: nothing leased it
    finally:
        stop(worker)
        server.kill_everything()
