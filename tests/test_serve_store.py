"""The queue without HTTP or torch: the scheduler's picks, and the store's leases, expiry, three strikes,
late completions, dedup twins, idempotency and backpressure (milliseconds each)."""

import functools
import json
import sqlite3
from collections import Counter
from contextlib import closing

import pytest

from storyboard_cli.errors import BadInput
from storyboard_cli.serve import schedule
from storyboard_cli.serve.schedule import ImageState, JobState, Waiting
from storyboard_cli.serve.store import (APPLICATION_ID, BATCH_SECONDS, BUCKETS_S, DB, IMAGE_RENDER, JOB_LATENCY,
                                        QUEUE_WAIT, IdempotencyConflict, JobFinal, QueueFull, QueueUnusable, Store,
                                        UnknownWorker, Work)

from helpers.serve import KEY, planned


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


@functools.cache
def worker(store, name):
    """The id `store` issued to the worker called `name` (registered once, at time 0, for the whole test)."""
    return store.register_worker(name, now=0, max_workers=64, ttl=1e9)


def w(image, job, priority="normal", submitted=0.0, key=KEY, order=0, batch=4, fp=None, mix=None, cost=1.0):
    return Waiting(image, job, priority, submitted, key, fp or f"{job}{image}", order, batch, mix, cost)


def test_pick_takes_the_best_ranked_job_and_its_images_of_one_key_up_to_its_bucket():
    waiting = [w(1, "late", submitted=100), w(2, "early", order=1), w(3, "early", order=0),
               w(4, "early", key="other", order=2), w(5, "early", order=3), w(6, "early", order=4, batch=2)]
    assert [x.image for x in schedule.pick(waiting, set())] == [3, 2, 5, 6]
    assert [x.image for x in schedule.pick(waiting, {"early3", "early2", "early5", "early6"})] == [4]  # twins wait


def test_a_jobs_batch_with_the_most_work_goes_first_unless_the_worker_has_another_warm():
    small = [w(i, "j", key="512", order=i, cost=0.26, mix="m512") for i in range(4)]
    large = [w(4, "j", key="1024", order=4, cost=1.05, mix="m1024")]  # one 1024x1024 image outweighs four 512s
    assert [x.image for x in schedule.pick(small + large, set())] == [4]
    assert [x.image for x in schedule.pick(small + large, set(), frozenset({"m512"}))] == [0, 1, 2, 3]  # affinity
    assert [x.image for x in schedule.pick(small + large, set(), frozenset({"elsewhere"}))] == [4]


def test_urgent_jumps_the_queue_and_bulk_ages_into_it():
    assert schedule.pick([w(1, "n", submitted=0), w(2, "u", "urgent", submitted=200)], set())[0].job == "u"
    old_bulk, new_urgent = w(1, "b", "bulk", submitted=0), w(2, "u", "urgent", submitted=1801)
    assert schedule.pick([old_bulk, new_urgent], set())[0].job == "b"  # nothing starves


def test_retry_after_is_a_whole_number_of_seconds_from_the_drain_rate():
    assert schedule.retry_after(10, 4.0) == 3
    assert schedule.retry_after(1, 100.0) == 1
    assert schedule.retry_after(5, None) == schedule.UNKNOWN_DRAIN_S


def test_job_state_from_image_states():
    s = schedule.job_state
    assert s(Counter(queued=2), False) == JobState.QUEUED
    assert s(Counter(queued=1, done=1), False) == JobState.RUNNING
    assert s(Counter(done=2), False) == JobState.SUCCEEDED
    assert s(Counter(done=1, failed=1), False) == JobState.FAILED
    assert s(Counter(queued=2), True) == JobState.CANCELED


def test_lease_complete_and_job_state(store):
    store.submit(planned("j1"), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=1, ttl=10)
    assert [i.id for i in lease.images] == [1, 2] and lease.jobs["j1"].out_dir == "/j/j1/out"
    assert store.lease(worker(store, "w2"), now=1, ttl=10) is None  # the job's folder has one writer
    assert store.job("j1", 1)["state"] == JobState.RUNNING
    assert store.complete(lease.lease, done=[1], cached=[], failed={2: "NaN"}, now=2)
    job = store.job("j1", 2)
    assert job["state"] == JobState.FAILED and job["images"][1]["reason"] == "NaN" and job["finished"] == 2


def test_a_batch_costs_the_queue_the_same_however_many_images_it_has_finished(store):
    """A farm's queue keeps every job it finished: a batch's lease, heartbeat and completion read no more of the
    queue with 9,600 finished images than with none (SQLite's instructions counted), where each once scanned every
    image by its lease (a job of two batches took 28.4 ms at 160,000 finished images against 1.5 ms at none:
    benchmarks/queue_history.py --before)."""
    held = worker(store, "w")

    def job(name, now):
        store.submit(planned(name, n=16, batch=8), None, 10**6, now=now)
        while (lease := store.lease(held, now=now, ttl=60)) is not None:
            store.heartbeat(lease.lease, now=now, ttl=60, worker=held)
            store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=now)

    def instructions(name, now):
        steps = [0]
        store.db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 1000)
        try:
            job(name, now)
        finally:
            store.db.set_progress_handler(None, 0)
        return steps[0]

    empty = instructions("first", 1)
    for n in range(600):
        job(f"done{n}", 2 + n)
    assert store.stats(0, 10**4)["counters"]["images_rendered"] == 16 * 601
    full = instructions("last", 10**4)
    assert full <= 2 * empty + 5, (empty, full)


def test_a_scrape_reads_the_images_of_a_finished_job_once_and_a_retry_counts_it_again(store):
    """/metrics' jobs per state: a finished job's state is read from its images once and kept, so a scrape of a
    queue that finished 600 jobs reads a fraction of what the first did (it read every image the queue held, each
    scrape); a failed job retried counts as queued again, then succeeded once it ends."""
    held = worker(store, "w")
    for n in range(600):
        store.submit(planned(f"done{n}", n=16, batch=16), None, 10**6, now=n)
        lease = store.lease(held, now=n, ttl=60)
        store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=n)

    def scrape():
        steps = [0]
        store.db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 100)
        try:
            return store.stats(10**4, 60)["jobs"], steps[0]
        finally:
            store.db.set_progress_handler(None, 0)

    (first, cold), (again, warm) = scrape(), scrape()
    assert first == again and first[JobState.SUCCEEDED] == 600
    assert warm * 4 < cold, (cold, warm)
    store.submit(planned("bad", n=2), None, 10**6, now=10**4)
    lease = store.lease(held, now=10**4, ttl=60)
    bad, good = lease.images
    store.complete(lease.lease, done=[good.id], cached=[], failed={bad.id: "x"}, now=10**4)
    assert scrape()[0][JobState.FAILED] == 1
    store.retry("bad", now=10**4 + 1)
    assert scrape()[0][JobState.FAILED] == 0 and scrape()[0][JobState.RUNNING] + scrape()[0][JobState.QUEUED] == 1
    lease = store.lease(held, now=10**4 + 2, ttl=60)
    store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=10**4 + 2)
    assert scrape()[0][JobState.SUCCEEDED] == 601 and scrape()[0][JobState.FAILED] == 0


@pytest.mark.parametrize("refused", [False, True])
def test_the_time_the_queue_could_not_be_written_counts_against_no_worker_nor_lease(store, refused):
    """A transaction refused for want of space (the queue's disk full to the last byte: a heartbeat not recorded)
    holds nothing against the workers: the first transaction that can be written again counts every registration as
    seen and every lease as renewed then, as a restart does. Without a refusal, the same silence is a lost worker."""
    store.submit(planned("j1"), None, 100, now=0)
    held = store.register_worker("w", now=0, max_workers=64, ttl=5)
    lease = store.lease(held, now=0, ttl=5)
    if refused:
        full = sqlite3.OperationalError("database or disk is full")
        full.sqlite_errorcode = sqlite3.SQLITE_FULL
        with pytest.raises(sqlite3.OperationalError), store._tx():
            raise full  # a heartbeat at 3 that the disk refused
        assert store.refused
    if not refused:
        with pytest.raises(UnknownWorker):  # forgotten, and its lease expired
            store.heartbeat(lease.lease, now=20, ttl=5, worker=held)
        return
    assert store.heartbeat(lease.lease, now=20, ttl=5, worker=held)
    assert not store.refused  # renewed once, and committed
    assert store.heartbeat(lease.lease, now=24, ttl=5, worker=held)  # a worker seen, its lease held as any other
    assert store.stats(0, 60)["counters"].get("lease_expiries", 0) == 0


def test_expired_lease_goes_back_to_the_queue_and_its_late_completion_is_ignored(store):
    store.submit(planned("j1"), None, 100, now=0)
    lost = store.lease(worker(store, "w1"), now=0, ttl=5)
    assert store.heartbeat(lost.lease, now=4, ttl=5)  # renewed until 9
    assert store.lease(worker(store, "w2"), now=8, ttl=5) is None
    again = store.lease(worker(store, "w2"), now=10, ttl=5)
    assert again and [i.id for i in again.images] == [1, 2]
    assert not store.heartbeat(lost.lease, now=10, ttl=5)
    assert not store.complete(lost.lease, done=[1, 2], cached=[], failed={}, now=11)
    assert store.job("j1", 11)["images_by_state"] == {ImageState.LEASED: 2}
    assert store.complete(again.lease, done=[1, 2], cached=[], failed={}, now=12)
    counters = store.stats(0, 60)["counters"]
    assert counters["lease_expiries"] == 1 and counters["late_completions"] == 1 and counters["images_rendered"] == 2


def test_an_image_whose_worker_dies_three_times_fails(store):
    store.submit(planned("j1", n=1), None, 100, now=0)
    for t in (0, 10, 20):
        assert store.lease(worker(store, "w"), now=t, ttl=5)
    store.expire(now=30)
    job = store.job("j1", 30)
    assert job["state"] == JobState.FAILED and job["images"][0]["attempts"] == 3
    assert "lost 3 times" in job["images"][0]["reason"]


def test_a_stopping_worker_returns_its_images_without_a_strike(store):
    store.submit(planned("j1"), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=0, ttl=5)
    assert store.complete(lease.lease, done=[1], cached=[], failed={}, now=1)
    image = store.job("j1", 1)["images"][1]
    assert image["state"] == ImageState.QUEUED and image["attempts"] == 0


def test_a_twin_waits_for_the_first_render_then_is_leased_with_its_png(store):
    store.submit(planned("j1", n=1, fingerprint="same"), None, 100, now=0)
    store.submit(planned("j2", n=1, fingerprint="same"), None, 100, now=1)
    first = store.lease(worker(store, "w1"), now=2, ttl=5)
    assert first.job == "j1" and first.images[0].twin is None
    assert store.lease(worker(store, "w2"), now=2, ttl=5) is None  # rendering it twice at once would waste a GPU
    store.complete(first.lease, done=[1], cached=[], failed={}, now=3)
    second = store.lease(worker(store, "w2"), now=3, ttl=5)
    assert second.images[0].twin == "/j/j1/out/a/a_c0_s10.png"
    assert second.images[0].twin_of == ["j1", "a/a_c0_s10.png"]
    store.complete(second.lease, done=[2], cached=[2], failed={}, now=4)
    assert store.job("j2", 4)["images"][0]["cached"] and store.stats(0, 60)["counters"]["images_cached"] == 1


def test_idempotency_key_returns_the_first_job_and_refuses_another_body(store):
    assert store.submit(planned("j1"), "k", 100, now=0) == ("j1", True)
    assert store.submit(planned("j2"), "k", 100, now=1) == ("j1", False)
    with pytest.raises(IdempotencyConflict):
        store.submit(planned("j3", content="other"), "k", 100, now=2)


def test_a_full_queue_refuses_a_job_whole_with_the_drain_rate(store):
    store.submit(planned("j1", n=6), None, 8, now=0)
    with pytest.raises(QueueFull) as e:
        store.submit(planned("j2", n=3), None, 8, now=1)
    assert e.value.retry_after == schedule.UNKNOWN_DRAIN_S and store.job("j2", 1) is None
    lease = store.lease(worker(store, "w"), now=0, ttl=60)
    store.complete(lease.lease, done=[1, 2, 3, 4], cached=[], failed={}, now=10)  # 4 images in 10 s
    store.submit(planned("j2", n=3), None, 8, now=10)
    with pytest.raises(QueueFull) as e:
        store.submit(planned("j3", n=4), None, 8, now=10)
    assert e.value.retry_after == 3  # 1 image too many at 0.4 images/s
    with pytest.raises(BadInput):
        store.submit(planned("big", n=9), None, 8, now=10)  # could never fit


def test_priorities_cancel_and_queue_position(store):
    store.submit(planned("n", batch=1), None, 100, now=0)
    store.submit(planned("u", priority="urgent", batch=1), None, 100, now=5)
    assert store.job("n", 5)["queue_position"] == 2 and store.job("u", 5)["queue_position"] == 0
    assert store.lease(worker(store, "w"), now=6, ttl=5).job == "u"
    assert store.set_priority("n", "urgent", 6) and store.job("n", 6)["queue_position"] == 0
    with pytest.raises(BadInput):
        store.set_priority("n", "asap", 6)
    assert store.cancel("n", now=7)
    assert store.job("n", 7)["state"] == JobState.CANCELED and store.stats(0, 60)["jobs"]["canceled"] == 1


def test_the_queue_survives_reopening(tmp_path):
    s = Store(tmp_path)
    s.submit(planned("j1"), "k", 100, now=0)
    s.close()
    again = Store(tmp_path)
    assert again.job("j1", 1)["state"] == JobState.QUEUED and again.replay("k", "c") == "j1"
    again.close()


def _kinds(store, job_id, after=0):
    rows, ended = store.events(job_id, after)
    return [kind for _, kind, _ in rows], ended


def test_every_change_is_an_event_in_order_and_the_stream_ends_once(store):
    store.submit(planned("j1"), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=1, ttl=5)
    store.set_priority("j1", "urgent", now=2)
    store.complete(lease.lease, done=[1], cached=[], failed={}, now=3)
    again = store.lease(worker(store, "w"), now=4, ttl=5)
    store.expire(now=10)  # lost: image 2 back to the queue
    last = store.lease(worker(store, "w"), now=11, ttl=5)
    assert _kinds(store, "j1") == (["queued", "running", "priority", "images", "running", "lease_lost", "running"],
                                   False)
    store.complete(last.lease, done=[2], cached=[], failed={}, now=12)
    rows, _ = store.events("j1", 0)
    seqs = [seq for seq, _, _ in rows]
    assert seqs == sorted(set(seqs)) and rows[-1][1] == "end"
    assert json.loads(rows[-1][2])["state"] == JobState.SUCCEEDED
    assert json.loads(rows[5][2])["requeued"] == [i.id for i in again.images]
    assert _kinds(store, "j1", seqs[3]) == (["running", "lease_lost", "running", "images", "end"], False)
    assert _kinds(store, "j1", seqs[-1]) == ([], True)  # resumed after its end: nothing more


def test_a_canceled_job_ends_its_stream_once_its_leased_batch_landed_and_only_once(store):
    store.submit(planned("j1", n=3, batch=2), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=1, ttl=5)
    assert store.cancel("j1", now=2)
    with pytest.raises(JobFinal) as again:
        store.cancel("j1", now=3)
    assert again.value.state == JobState.CANCELED
    assert _kinds(store, "j1") == (["queued", "running", "canceled"], False)  # its batch still renders
    store.complete(lease.lease, done=[1, 2], cached=[], failed={}, now=4)  # its running batch finishes
    assert _kinds(store, "j1") == (["queued", "running", "canceled", "images", "end"], False)
    end = json.loads(store.events("j1", 0)[0][-1][2])
    assert end["state"] == JobState.CANCELED and end["images_by_state"] == {"done": 2, "canceled": 1}
    assert store.job("j1", 4)["images_by_state"] == end["images_by_state"]
    store.submit(planned("j2"), None, 100, now=5)
    assert store.cancel("j2", now=6)  # nothing leased: it ends at once
    assert _kinds(store, "j2") == (["queued", "canceled", "end"], False)


def test_latencies_are_histograms_and_workers_report_their_gpu(store):
    store.submit(planned("j1", n=3), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=2, ttl=5, gpu={"memory_allocated_bytes": 7.0})
    work = Work(batches=(("64x64", 3, 1.5),), out_of_memory=1, model_loads=1)
    store.complete(lease.lease, done=[1, 2, 3], cached=[], failed={}, now=4, work=work)
    store.seen(worker(store, "cpu-worker"), None, now=4)
    s = store.stats(now=4, worker_window_s=60)
    counts, total = s["histograms"][QUEUE_WAIT, "normal"]
    assert sum(counts) == 3 and total == 6.0 and counts[BUCKETS_S.index(2.5)] == 3  # 2 s each: the 2.5 s bucket
    assert s["histograms"][IMAGE_RENDER, ""][1] == pytest.approx(1.5) and sum(s["histograms"][IMAGE_RENDER, ""][0]) == 3
    assert s["histograms"][BATCH_SECONDS, "64x64"] == ([0] * 5 + [1] + [0] * 10, 1.5)
    assert s["histograms"][JOB_LATENCY, ""][1] == 4.0
    assert s["counters"]["out_of_memory"] == 1 and s["counters"]["model_loads"] == 1
    assert {x.name: x.gpu for x in s["workers"]} == {"w": {"memory_allocated_bytes": 7.0}, "cpu-worker": None}
    assert store.stats(now=100, worker_window_s=60)["workers"] == []  # not seen for a while: gone
    assert s["images_per_s"] > 0


def test_room_left_in_a_batch_goes_to_other_jobs_of_the_same_mix():
    waiting = [w(1, "a", order=0, batch=4, mix="m"), w(2, "b", submitted=1, mix="m"), w(3, "c", submitted=2, mix="x"),
               w(4, "d", submitted=3, mix="m", fp="b2"), w(5, "e", submitted=4, mix="m"), w(6, "f", submitted=5, mix="m")]
    assert [x.image for x in schedule.pick(waiting, set())] == [1, 2, 5, 6]  # one per fingerprint
    assert [x.image for x in schedule.pick(waiting, {"e5"})] == [1, 2, 6]  # e5's twin is being rendered
    assert [x.image for x in schedule.pick([w(1, "a", batch=1, mix="m"), w(2, "b", mix="m")], set())] == [1]
    assert [x.image for x in schedule.pick([w(1, "a"), w(2, "b")], set())] == [1]  # no mix: alone


def test_a_jobs_batches_are_leased_to_several_workers_at_once(store):
    store.submit(planned("j", n=6, batch=2), None, 100, now=0)
    leases = [store.lease(worker(store, f"w{n}"), now=1, ttl=5) for n in range(3)]
    assert [[i.id for i in lease.images] for lease in leases] == [[1, 2], [3, 4], [5, 6]]
    assert store.lease(worker(store, "w3"), now=1, ttl=5) is None
    assert store.job("j", 1)["images_by_state"] == {"leased": 6}
    store.expire(now=10)  # the three workers lost: every batch back in the queue
    assert store.job("j", 10)["images_by_state"] == {"queued": 6}


def test_a_mixed_lease_carries_every_job_it_touches(store):
    store.submit(planned("j1", n=1, mix="m"), None, 100, now=0)
    store.submit(planned("j2", n=2, mix="m"), None, 100, now=1)
    lease = store.lease(worker(store, "w"), now=2, ttl=5)
    assert lease.job == "j1" and set(lease.jobs) == {"j1", "j2"}
    assert [(i.id, i.job) for i in lease.images] == [(1, "j1"), (2, "j2"), (3, "j2")]
    store.submit(planned("j3", n=1, mix="m"), None, 100, now=2)
    other = store.lease(worker(store, "w2"), now=2, ttl=5)
    assert set(other.jobs) == {"j3"}
    assert store.complete(lease.lease, done=[1, 2], cached=[], failed={3: "NaN"}, now=3)
    assert store.job("j1", 3)["state"] == JobState.SUCCEEDED and store.job("j2", 3)["state"] == JobState.FAILED
    for job_id, images in (("j1", [1]), ("j2", [2, 3])):
        rows, _ = store.events(job_id, 0)
        running = json.loads(rows[1][2])
        assert rows[1][1] == "running" and running["lease"] == lease.lease and running["images"] == images
        assert rows[-1][1] == "end"
    store.submit(planned("j4", n=1, mix="n"), None, 100, now=3)
    store.submit(planned("j5", n=1, mix="n"), None, 100, now=3)
    lost = store.lease(worker(store, "w"), now=3, ttl=1)
    assert set(lost.jobs) == {"j4", "j5"}
    store.expire(now=10)  # its worker died: both jobs' images back to the queue, each job told
    for job_id in ("j4", "j5"):
        rows, _ = store.events(job_id, 0)
        assert rows[-1][1] == "lease_lost" and store.job(job_id, 10)["images_by_state"] == {"queued": 1}


def test_a_queue_from_before_registration_opens_and_its_self_named_workers_are_gone(tmp_path):
    Store(tmp_path).close()
    with sqlite3.connect(tmp_path / DB) as db:  # the worker table of a queue before registration: rows by name
        db.execute("DROP TABLE workers")
        db.execute("CREATE TABLE workers (name TEXT PRIMARY KEY, seen REAL NOT NULL, gpu TEXT, "
                   "ready INTEGER NOT NULL DEFAULT 0)")
        db.execute("INSERT INTO workers VALUES ('old', 10, 'null', 1)")
    s = Store(tmp_path)
    assert s.readiness(now=10, window_s=5) == (0, 0)
    with pytest.raises(UnknownWorker):  # the worker registers again
        s.seen("old", None, now=11, ready=True)
    s.seen(s.register_worker("old", now=11, max_workers=1, ttl=5), None, now=11, ready=True)
    assert s.readiness(now=11, window_s=5) == (1, 1) and s.readiness(now=17, window_s=5) == (0, 0)
    s.close()


def _final_jobs(store):
    """Three jobs, one per final state: succeeded, failed, canceled."""
    for t, job_id in enumerate(("ok", "bad", "gone")):
        store.submit(planned(job_id, n=1), None, 100, now=t)
    ok, bad = (store.lease(worker(store, "w"), now=3, ttl=5) for _ in range(2))
    assert (ok.job, bad.job) == ("ok", "bad")
    store.complete(ok.lease, done=[ok.images[0].id], cached=[], failed={}, now=4)
    store.complete(bad.lease, done=[], cached=[], failed={bad.images[0].id: "NaN"}, now=4)
    store.cancel("gone", now=4)
    return {"ok": JobState.SUCCEEDED, "bad": JobState.FAILED, "gone": JobState.CANCELED}


def test_a_final_job_refuses_cancel_and_priority_and_nothing_changes(store):
    for job_id, state in _final_jobs(store).items():
        before = store.job(job_id, 5), store.events(job_id, 0)
        assert before[0]["state"] == state and json.loads(before[1][0][-1][2])["state"] == state
        for change in (lambda: store.cancel(job_id, now=5), lambda: store.set_priority(job_id, "urgent", now=5)):
            with pytest.raises(JobFinal) as refused:
                change()
            assert refused.value.state == state and str(refused.value) == f"job {job_id} is already {state}"
        assert (store.job(job_id, 5), store.events(job_id, 0)) == before, job_id  # state, priority, stream
    assert store.cancel("none", now=5) is False and store.set_priority("none", "bulk", now=5) is False


def test_a_canceled_job_whose_lease_is_lost_is_not_leased_again(store):
    store.submit(planned("j1", n=3, batch=2), None, 100, now=0)
    lease = store.lease(worker(store, "w"), now=1, ttl=5)
    assert len(lease.images) == 2
    assert store.cancel("j1", now=2)  # a running job: its queued image at once, the leased two with their lease
    assert store.job("j1", 2)["images_by_state"] == {"leased": 2, "canceled": 1}
    store.expire(now=10)  # the worker died
    job = store.job("j1", 10)
    assert job["state"] == JobState.CANCELED and job["images_by_state"] == {"canceled": 3}
    assert store.lease(worker(store, "w"), now=11, ttl=5) is None
    assert _kinds(store, "j1") == (["queued", "running", "canceled", "lease_lost", "end"], False)
    assert json.loads(store.events("j1", 0)[0][3][2])["requeued"] == []  # canceled, not queued again
    assert job["finished"] == 10


def _queue_file(tmp_path, make):
    root = tmp_path / "root"
    root.mkdir()
    make(root / DB)
    return root, (root / DB).read_bytes()


def _foreign(path):
    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.commit()


def _newer(path):
    Store(path.parent).close()
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA user_version = 99")


@pytest.mark.parametrize("make, says, ours", [
    (lambda p: p.write_bytes(bytes(range(256)) * 64), "is damaged or not a SQLite database", True),
    (_foreign, "is not a bcg queue but another program's SQLite database (tables: users)", False),
    (_newer, "is the queue of a newer bcg (schema 99", True),
], ids=["corrupt", "foreign", "newer"])
def test_a_queue_file_that_is_not_ours_is_refused_in_one_line_and_left_as_it_was(tmp_path, make, says, ours):
    root, before = _queue_file(tmp_path, make)
    with pytest.raises(QueueUnusable) as refused:
        Store(root)
    message = str(refused.value)
    assert message.startswith(f"{root / DB} ") and says in message and "\n" not in message
    assert (root / DB).read_bytes() == before and sorted(p.name for p in root.iterdir()) == [DB]  # no journal either
    if ours:
        assert "only record of the jobs" in message and "never delete or overwrite it" in message


@pytest.mark.parametrize("lock", ["file", "folder"])
def test_a_read_only_queue_is_refused_with_what_to_do(tmp_path, lock):
    root, before = _queue_file(tmp_path, lambda p: Store(p.parent).close())
    target = root / DB if lock == "file" else root
    mode = target.stat().st_mode
    target.chmod(0o444 if lock == "file" else 0o555)
    try:
        with pytest.raises(QueueUnusable) as refused:
            Store(root)
    finally:
        target.chmod(mode)
    message = str(refused.value)
    assert "read-only" in message and str(root) in message and "make" in message and "writable" in message
    assert "only record of the jobs" in message and (root / DB).read_bytes() == before


def test_a_queue_from_before_the_stamp_opens_and_is_stamped(tmp_path):
    s = Store(tmp_path)
    s.submit(planned("j1"), None, 100, now=0)
    s.close()
    with sqlite3.connect(tmp_path / DB) as db:  # as a bcg that did not stamp its queue left it
        db.execute("PRAGMA application_id = 0")
        db.execute("PRAGMA user_version = 0")
    s = Store(tmp_path)
    assert s.job("j1", 1)["state"] == JobState.QUEUED
    s.close()
    with sqlite3.connect(tmp_path / DB) as db:
        assert db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
