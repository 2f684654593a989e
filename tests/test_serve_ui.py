"""The queue page (/ui) in a real browser, headless Chromium (Debian's `chromium`, as tests/test_browser.py drives it),
against a real `bcg serve` and a real CPU worker rendering the tiny model: jobs submitted appear and progress without
a reload; cancel (two at once), priority, move to front and retry from the page change the queue; pause holds
dispatch; a drained worker's current batch finishes and it is leased nothing more; the server killed and started
again, the page reconnects and shows the true state, a change made while it was down included; and all of it on one
event stream. `BCG_UI_SCREENSHOTS=docs` keeps the page's screenshots there (docs/SERVE.md shows them).

The page's two numbers (docs/SERVE.md, "The queue page": loaded in under 1 s with 1000 jobs; the global stream at 100
events a second with /healthz's p99 under 100 ms) are measured by benchmarks/serve_ui.py; the short version here
checks them with bounds that hold on CI's two shared cores (PAGE_S, HEALTH_P99_S), on a server with a token: the page
asks for it, and keeps it for the tab alone."""

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.serve import ROOT, Server, eventually, free_port, planned, start_worker, stop
from storyboard_cli.serve.store import Store

CHROMIUM = Path("/usr/bin/chromium")  # as tests/test_browser.py runs it
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
JOB = """version: 1
model: tiny
buckets: [1]
defaults: {{steps: 2, size: 64x64}}
shots:
  - {{id: a, prompt: {prompt}, seed: 1}}
"""  # one image, leased alone (no other job's image rides in its batch)
WAIT_MS = 60_000
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")


def submit(url, prompt):
    r = httpx.post(url + "/v1/jobs", content=JOB.format(prompt=prompt), timeout=30,
                   headers={"Content-Type": "application/yaml", "X-Job-Filename": f"{prompt.replace(' ', '-')}.yaml"})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def api(url, path, method="GET", **kwargs):
    r = httpx.request(method, url + path, timeout=30, **kwargs)
    assert r.status_code in (200, 201), r.text
    return r.json()


def row(page, job_id, state):
    """Waits until the page's row of the job shows `state` (the page is never reloaded)."""
    page.wait_for_selector(f'tr[data-job="{job_id}"][data-state="{state}"]', timeout=WAIT_MS)


def act(page, job_ids, button):
    for job_id in job_ids:
        page.check(f'tr[data-job="{job_id}"] input[type=checkbox]')
    page.click(button)


def screenshot(page, name):
    folder = os.environ.get("BCG_UI_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(ROOT / folder / name), full_page=True)


@pytest.mark.slow
def test_the_queue_page_follows_and_drives_a_real_server(tmp_path):
    from playwright.sync_api import sync_playwright

    warm = tmp_path / "warm.yaml"
    warm.write_text(JOB.format(prompt="warm"))
    server = Server(tmp_path / "root", free_port()).start(lease_s=5, gpus="none")
    worker = start_worker(server.url, "cpu-box", "--warm", str(warm))  # its model loads while the page is tested
    streams, problems = [], []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: streams.append(r.url) if "/events" in r.url and "follow=false" not in r.url
                    else None)
            page.goto(server.url + "/ui")
            page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)

            # pause from the page holds dispatch: ten jobs appear, none is leased
            page.click("#pause")
            page.wait_for_selector('#pause[data-paused="true"]', timeout=WAIT_MS)
            jobs = [submit(server.url, f"shot {i}") for i in range(10)]
            for job_id in jobs:
                row(page, job_id, "queued")
            eventually(lambda: api(server.url, "/v1/workers")["workers"], lambda w: len(w) == 1 and w[0]["ready"])
            time.sleep(1.5)  # the worker, its model loaded, asks every half second
            assert api(server.url, "/v1/queue")["leases"] == 0

            # cancel two at once, a priority, move to front
            act(page, jobs[:2], "#act-cancel")
            row(page, jobs[0], "canceled")
            row(page, jobs[1], "canceled")
            page.select_option("#act-priority-value", "urgent")
            act(page, [jobs[2]], "#act-priority")
            eventually(lambda: api(server.url, f"/v1/jobs/{jobs[2]}")["priority"], lambda p: p == "urgent")
            act(page, [jobs[9]], "#act-front")
            eventually(lambda: api(server.url, f"/v1/jobs/{jobs[9]}")["queue_position"], lambda n: n == 0)
            # the page shows it once the move's event has come through (the API answers first)
            eventually(lambda: page.locator(f'tr[data-job="{jobs[9]}"] .priority').inner_text(),
                       lambda text: text == "normal (front)")

            # a failed image retried from the page: the page's worker drained, another fails the front job's image
            cpu = api(server.url, "/v1/workers")["workers"][0]["id"]
            page.click(f'tr[data-worker="{cpu}"] button.drain')
            page.wait_for_selector(f'tr[data-worker="{cpu}"][data-state="drained"]', timeout=WAIT_MS)
            page.click("#pause")
            page.wait_for_selector('#pause[data-paused="false"]', timeout=WAIT_MS)
            hand = api(server.url, "/v1/workers", "POST", json={"name": "by-hand"})["worker"]
            lease = api(server.url, "/v1/leases", "POST", json={"worker": hand})
            assert lease["job"] == jobs[9]
            api(server.url, f"/v1/leases/{lease['lease']}/complete", "POST",
                json={"worker": hand, "failed": {str(lease["images"][0]["id"]): "a bad prompt"}})
            row(page, jobs[9], "failed")
            act(page, [jobs[9]], "#act-retry")
            row(page, jobs[9], "queued")
            assert [i["attempts"] for i in api(server.url, f"/v1/jobs/{jobs[9]}")["images"]] == [0]

            # resumed, the worker renders; drained mid-batch, that batch lands and no lease follows
            page.click(f'tr[data-worker="{cpu}"] button.drain')  # Resume
            busy = eventually(lambda: api(server.url, "/v1/workers")["workers"],
                              lambda ws: any(w["id"] == cpu and w["lease"] for w in ws), poll_s=0.05)
            held = next(w for w in busy if w["id"] == cpu)
            page.click(f'tr[data-worker="{cpu}"] button.drain')
            page.wait_for_selector(f'tr[data-worker="{cpu}"][data-state="drained"]', timeout=WAIT_MS)
            row(page, held["job"], "succeeded")  # its batch finished, seen without a reload
            def waiting():
                q = api(server.url, "/v1/queue")
                return q["leases"], {p: t["queued"] for p, t in q["tiers"].items()}

            # the drain holds: once the leases it let finish have landed (the worker may have taken its next batch before
            # the click reached the server), nothing more is leased and the queue stays as it is
            before = eventually(waiting, lambda w: w[0] == 0)
            time.sleep(1.5)
            landed = sum(api(server.url, f"/v1/jobs/{j}")["state"] == "succeeded" for j in jobs[2:])
            assert waiting() == before and landed >= 1 and sum(before[1].values()) == 8 - landed
            screenshot(page, "serve-ui-jobs.png")
            page.click(f'tr[data-job="{jobs[9]}"] button.link')  # its detail: images and event log
            page.wait_for_selector("#images tbody tr", timeout=WAIT_MS)
            page.wait_for_selector("#log:has-text('retried')", timeout=WAIT_MS)  # no string eval: the CSP forbids it
            if held["job"] == jobs[9]:
                assert "cpu-box" in page.locator("#images tbody tr").first.inner_text()
            screenshot(page, "serve-ui-detail.png")

            # the server killed: the page says so; a job canceled meanwhile (its events missed), the server started
            # again: the page reconnects, reads everything again and follows on
            page.click("#pause")
            page.wait_for_selector('#pause[data-paused="true"]', timeout=WAIT_MS)
            assert problems == []
            # a job the drained worker left queued (the ones it took before the drain may have landed)
            victim = next(j for j in jobs[2:] if api(server.url, f"/v1/jobs/{j}")["state"] == "queued")
            stop(server.proc)
            page.wait_for_selector('#conn[data-state="reconnecting"]', timeout=WAIT_MS)
            store = Store(server.root)
            assert store.cancel(victim, time.time())
            store.close()
            server.start(lease_s=5, gpus="none")
            page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
            row(page, victim, "canceled")
            page.wait_for_selector('#pause[data-paused="true"]', timeout=WAIT_MS)  # paused before: paused still
            late = submit(server.url, "after the restart")
            row(page, late, "queued")
            shown = {r.get_attribute("data-job"): r.get_attribute("data-state")
                     for r in page.locator("#jobs tbody tr").all()}
            assert shown == {j["id"]: j["state"] for j in api(server.url, "/v1/jobs")["jobs"]}
            # eleven jobs followed on one stream at a time: the first, and the one opened after the restart
            assert len(streams) == 2 and all("/v1/events?" in u for u in streams), streams
            assert page.evaluate("window.bcgQueue.streams") == 2
            assert all("net::ERR_" in m for m in problems), problems  # only the requests the kill cut short
            browser.close()
    finally:
        stop(worker)
        server.kill_everything()


PAGE_S = 3.0  # the page live with 50 of 1000 jobs (0.8 s median on this project's loaded CPU machine)
HEALTH_P99_S = 0.25  # /healthz beside the stream (62 ms there)
RATE, STREAM_S = 100, 3.0
TOKEN = "page-token"


@pytest.mark.slow
def test_the_page_loads_1000_jobs_and_the_stream_carries_100_events_a_second(tmp_path):
    from playwright.sync_api import sync_playwright

    store = Store(tmp_path / "root")  # the queue filled before the server starts: no 1000 submissions to plan
    store.db.execute("PRAGMA synchronous=OFF")  # this filling alone: no fsync per job
    ids = [f"job{i:04d}" for i in range(1000)]
    for i, job_id in enumerate(ids):
        store.submit(planned(job_id, n=1), None, 10_000, 1000.0 + i)
    store.close()
    server = Server(tmp_path / "root", free_port()).start(gpus="none", extra=("--max-queue-images", "10000",
                                                                              "--token", TOKEN))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(server.url + "/ui")  # the server has a token: the page asks for it
            page.wait_for_selector("#token-form:not([hidden])", timeout=WAIT_MS)
            page.fill("#token", TOKEN)
            page.click("#token-form button")
            page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
            t0 = time.perf_counter()
            page.reload()  # the tab keeps the token (sessionStorage): the page loads without asking
            page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
            page.wait_for_selector("#jobs tbody tr:nth-child(50)", timeout=WAIT_MS)
            loaded = time.perf_counter() - t0
            assert page.locator("#jobs tbody tr").count() == 50 and page.locator("#more").is_visible()
            assert page.locator("#token-form").is_hidden()
            other = browser.new_page()  # another tab: asked again
            other.goto(server.url + "/ui")
            other.wait_for_selector("#token-form:not([hidden])", timeout=WAIT_MS)
            browser.close()
        assert loaded < PAGE_S, loaded

        auth = {"Authorization": f"Bearer {TOKEN}"}
        last = api(server.url, "/v1/queue", headers=auth)["last_event"]
        got, health, done = [], [], threading.Event()

        def read():
            with httpx.stream("GET", f"{server.url}/v1/events?after={last}", timeout=None, headers=auth) as r:
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        got.append(int(line[4:]))
                    if len(got) == RATE * STREAM_S:
                        return

        def probe():
            with httpx.Client(timeout=10) as client:
                while not done.is_set():
                    t = time.perf_counter()
                    assert client.get(server.url + "/healthz").status_code == 200
                    health.append(time.perf_counter() - t)
                    time.sleep(0.05)

        reader, prober = threading.Thread(target=read, daemon=True), threading.Thread(target=probe, daemon=True)
        reader.start()
        prober.start()
        # the events written into the queue beside the server, ten every 0.1 s: the stream's load alone, not the
        # fsync of 100 API writes a second (benchmarks/serve_ui.py writes them through the API)
        db = sqlite3.connect(server.root / "queue.sqlite3", timeout=30)
        written, t0 = 0, time.perf_counter()
        while written < RATE * STREAM_S:
            time.sleep(max(t0 + (written + 10) / RATE - time.perf_counter(), 0))
            with db:
                db.executemany("INSERT INTO events (job, kind, data) VALUES (?, 'priority', ?)", [
                    (ids[n], json.dumps({"job": ids[n], "state": "queued", "at": time.time(),
                                         "images_by_state": {"queued": 1}, "priority": "urgent"}))
                    for n in range(written, written + 10)])
            written += 10
        db.close()
        rate = written / (time.perf_counter() - t0)
        reader.join(30)
        done.set()
        prober.join(10)
        assert rate > 0.9 * RATE and got == list(range(last + 1, last + 1 + written))  # every event, in order
        health.sort()
        assert health and health[int(len(health) * 0.99)] < HEALTH_P99_S, health[-5:]
    finally:
        server.kill_everything()
