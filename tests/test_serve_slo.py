"""The service-level series of /metrics, read from a real store through the real collector (no HTTP, no
torch but the GPU test's): the oldest queued image's age per priority, the SLO histograms' buckets (the fill
ratio's own, the others' untouched), time to the first image, the workers' GPU power and energy (absent
without NVML, never zero), and gpu_stats itself on a GPU."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.serve import metrics
from storyboard_cli.serve.intake import Planned, PlannedImage
from storyboard_cli.serve.schedule import TIERS
from storyboard_cli.serve.store import (BATCH_FILL, BUCKETS_S, FILL_BUCKETS, FIRST_IMAGE, QUEUE_WAIT, WORKER_STARTUP,
                                        Store, bounds)
from storyboard_cli.serve.wire import WorkerReport

KEY = "64x64 2 steps euler"
GPU = {"memory_allocated_bytes": 7.0e9, "total_memory_bytes": 1.4e11, "utilization": 0.97, "power_watts": 612.5,
       "energy_joules": 8.25e7}


def planned(job_id, n=2, priority="normal") -> Planned:
    images = tuple(PlannedImage(order=i, shot="a", k=i, seed=10 + i, outputs=(f"a/a_c{i}_s{10 + i}.png",), key=KEY,
                                fingerprint=f"{job_id}{i}", mix=job_id) for i in range(n))
    return Planned(job_id, job_id, Path("/j") / job_id / "job.yaml", Path("/j") / job_id / "out", priority, "c", 4,
                   images)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def scrape(store, now):
    """/metrics's families as Prometheus parses them, at time `now`: {family name: {(sample name, labels): value}}."""
    text = metrics.exposition(metrics.registry(store, worker_window_s=60, clock=lambda: now)).decode()
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def observe(store, name, label, *values):
    """What the lease and completion paths do: one observation per value, in a transaction."""
    with store._tx() as db:
        for value in values:
            store._observe(db, name, label, value)


def test_the_oldest_queued_image_per_priority_ages_from_its_submission_and_leaves_when_leased(store):
    store.submit(planned("n1", n=2), None, 100, now=10)
    store.submit(planned("u1", n=1, priority="urgent"), None, 100, now=40)
    store.submit(planned("n2", n=1), None, 100, now=70)
    assert store.slo_stats(now=100)["oldest_queued_s"] == {"urgent": 60.0, "normal": 90.0, "bulk": 0.0}
    oldest = scrape(store, 100)["bcg_queue_oldest_age_seconds"]
    assert {dict(labels)["priority"]: v for (_, labels), v in oldest.items()} == {"urgent": 60, "normal": 90, "bulk": 0}

    worker = store.register_worker("w", now=100, max_workers=4, ttl=1e9)
    lease = store.lease(worker, now=100, ttl=50)
    assert {i["job"] for i in lease["images"]} == {"u1"}  # urgent first: it no longer waits
    assert store.slo_stats(now=110)["oldest_queued_s"] == {"urgent": 0.0, "normal": 100.0, "bulk": 0.0}
    lease = store.lease(worker, now=110, ttl=50)
    assert {i["job"] for i in lease["images"]} == {"n1"}
    assert store.slo_stats(now=111)["oldest_queued_s"]["normal"] == 41.0  # n2's image, submitted at 70
    store.expire(now=200)  # both leases are lost: their images wait again, aged from their job's submission
    assert store.slo_stats(now=200)["oldest_queued_s"] == {"urgent": 160.0, "normal": 190.0, "bulk": 0.0}


def test_the_fill_ratio_has_its_own_eighths_and_the_seconds_histograms_keep_theirs(store):
    assert bounds(BATCH_FILL) == FILL_BUCKETS == (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
    assert bounds(QUEUE_WAIT) == bounds(FIRST_IMAGE) == bounds(WORKER_STARTUP) == BUCKETS_S
    observe(store, BATCH_FILL, "", 1 / 4, 3 / 4, 1.0, 1.0)
    observe(store, QUEUE_WAIT, "urgent", 0.3, 45.0)
    families = scrape(store, 0)
    fill = families["bcg_batch_fill_ratio"]
    assert [v for (name, labels), v in fill.items() if name.endswith("_bucket")] == [0, 1, 1, 1, 1, 2, 2, 4, 4]
    assert [dict(labels)["le"] for (name, labels), v in fill.items() if name.endswith("_bucket")] == [
        "0.125", "0.25", "0.375", "0.5", "0.625", "0.75", "0.875", "1.0", "+Inf"]
    assert fill["bcg_batch_fill_ratio_sum", ()] == 3.0 and fill["bcg_batch_fill_ratio_count", ()] == 4
    urgent = {dict(labels)["le"]: v for (name, labels), v in families["bcg_queue_wait_seconds"].items()
              if name.endswith("_bucket") and dict(labels)["priority"] == "urgent"}
    assert list(urgent) == [str(b) for b in BUCKETS_S] + ["+Inf"]
    assert urgent["0.25"] == 0 and urgent["0.5"] == 1 and urgent["30.0"] == 1 and urgent["60.0"] == 2


def test_the_slo_histograms_exist_empty_from_the_start_for_every_priority(store):
    """An alert on one tier's p95 names a series that exists before that tier's first image."""
    families = scrape(store, 0)
    for metric in ("bcg_queue_wait_seconds", "bcg_time_to_first_image_seconds"):
        counts = {dict(labels)["priority"]: v for (name, labels), v in families[metric].items()
                  if name == metric + "_count"}
        assert counts == {p: 0 for p in TIERS}, metric
    for metric in ("bcg_batch_fill_ratio", "bcg_worker_startup_seconds"):
        assert families[metric][metric + "_count", ()] == 0
    assert not families["bcg_batch_seconds"]  # by shape: none before the first batch


def test_time_to_first_image_is_the_first_completion_of_a_job_only(store):
    store.submit(planned("j1", n=3, priority="urgent"), None, 100, now=10)
    worker = store.register_worker("w", now=10, max_workers=4, ttl=1e9)
    lease = store.lease(worker, now=11, ttl=60)
    ids = [i["id"] for i in lease["images"]]
    store.complete(lease["lease"], done=ids[:2], cached=[], failed={}, now=14.5)  # the third goes back
    with store._tx() as db:
        assert store._first_image(db, "j1", 2, now=14.5) == ("urgent", 4.5)
        assert store._first_image(db, "j1", 0, now=14.5) is None  # a completion that landed nothing
    lease = store.lease(worker, now=15, ttl=60)
    store.complete(lease["lease"], done=[i["id"] for i in lease["images"]], cached=[], failed={}, now=20)
    with store._tx() as db:
        assert store._first_image(db, "j1", 1, now=20) is None  # its first image landed before
        assert store._first_image(db, "nope", 1, now=20) is None
    observe(store, FIRST_IMAGE, "urgent", 4.5)
    ttfi = scrape(store, 20)["bcg_time_to_first_image_seconds"]
    assert ttfi["bcg_time_to_first_image_seconds_sum", (("priority", "urgent"),)] == 4.5
    assert ttfi["bcg_time_to_first_image_seconds_bucket", (("le", "5.0"), ("priority", "urgent"))] == 1


def test_gpu_power_and_energy_per_worker_and_none_for_a_cpu_or_a_gpu_without_nvml(store):
    gpu, cpu, no_nvml = (store.register_worker(n, now=0, max_workers=4, ttl=1e9) for n in ("h200", "cpu", "old"))
    report = WorkerReport.model_validate({"worker": gpu, "gpu": GPU, "ready": True})  # the wire takes them
    store.seen(gpu, report.gpu, now=1, ready=True)
    store.seen(cpu, None, now=1)
    store.seen(no_nvml, {"memory_allocated_bytes": 1.0e9, "total_memory_bytes": 2.4e10}, now=1)
    families = scrape(store, 1)
    labels = (("name", "h200"), ("worker", gpu))
    assert families["bcg_worker_gpu_power_watts"] == {("bcg_worker_gpu_power_watts", labels): 612.5}
    assert families["bcg_worker_gpu_energy_joules"] == {("bcg_worker_gpu_energy_joules_total", labels): 8.25e7}
    assert families["bcg_worker_gpu_utilization_ratio"] == {("bcg_worker_gpu_utilization_ratio", labels): 0.97}
    memory = {dict(k)["name"] for _, k in families["bcg_worker_gpu_memory_bytes"]}
    assert memory == {"h200", "old"}  # the GPU without NVML still has torch's memory series


def test_gpu_stats_is_none_on_a_cpu_and_before_a_model_is_loaded():
    import torch

    from storyboard_cli.serve.worker import Hot, gpu_stats

    assert gpu_stats(Hot()) is None
    assert gpu_stats(SimpleNamespace(models=SimpleNamespace(device=torch.device("cpu")))) is None


@pytest.mark.gpu
def test_gpu_stats_reads_power_and_energy_from_nvml_on_a_gpu():
    """On a GPU with nvidia-ml-py: watts and joules of this device, energy never decreasing; without
    nvidia-ml-py, neither key (absent, not zero)."""
    import time

    import torch

    from storyboard_cli.serve.worker import gpu_stats

    hot = SimpleNamespace(models=SimpleNamespace(device=torch.device("cuda", torch.cuda.current_device())))
    torch.ones(1, device="cuda")
    first = gpu_stats(hot)
    time.sleep(0.5)
    second = gpu_stats(hot)
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert not {"power_watts", "energy_joules", "utilization"} & set(first)
        return
    print(f"\nNVML: {second['power_watts']:.1f} W, {second['energy_joules']:.0f} J since the driver loaded, "
          f"utilisation {second['utilization']:.2f}")
    assert 1 < first["power_watts"] < 2000 and 1 < second["power_watts"] < 2000
    assert 0 < first["energy_joules"] <= second["energy_joules"]
    assert 0 <= second["utilization"] <= 1
    assert second["total_memory_bytes"] == torch.cuda.get_device_properties(hot.models.device).total_memory
