"""The service-level series of /metrics, read from a real store through the real collector (no HTTP, no
torch but the GPU test's): the oldest queued image's age per priority, the SLO histograms' buckets (the fill
ratio's own, the others' untouched), time to the first image, the workers' GPU power and energy (absent
without NVML, never zero: serve/nvml.py against a stand-in NVML), and gpu_stats itself on a GPU."""

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from storyboard_cli.serve import metrics, nvml
from storyboard_cli.serve.intake import Planned, PlannedImage
from storyboard_cli.serve.schedule import TIERS
from storyboard_cli.serve.store import (BATCH_FILL, BUCKETS_S, FILL_BUCKETS, FIRST_IMAGE, QUEUE_WAIT, WORKER_STARTUP,
                                        Store, Work, bounds)
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
    assert {i.job for i in lease.images} == {"u1"}  # urgent first: it no longer waits
    assert store.slo_stats(now=110)["oldest_queued_s"] == {"urgent": 0.0, "normal": 100.0, "bulk": 0.0}
    lease = store.lease(worker, now=110, ttl=50)
    assert {i.job for i in lease.images} == {"n1"}
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


def test_queue_wait_is_observed_by_the_jobs_priority(store):
    store.submit(planned("u", n=1, priority="urgent"), None, 100, now=0)
    store.submit(planned("b", n=2, priority="bulk"), None, 100, now=0)
    worker = store.register_worker("w", now=0, max_workers=4, ttl=1e9)
    store.lease(worker, now=2, ttl=60)
    store.lease(worker, now=30, ttl=60)
    wait = scrape(store, 30)["bcg_queue_wait_seconds"]
    counts = {dict(labels)["priority"]: v for (name, labels), v in wait.items() if name.endswith("_count")}
    assert counts == {"urgent": 1, "normal": 0, "bulk": 2}
    assert wait["bcg_queue_wait_seconds_sum", (("priority", "bulk"),)] == 60.0


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


def test_time_to_first_image_is_observed_at_a_jobs_first_completion_only(store):
    store.submit(planned("j1", n=3, priority="urgent"), None, 100, now=10)
    worker = store.register_worker("w", now=10, max_workers=4, ttl=1e9)
    lease = store.lease(worker, now=11, ttl=60)
    ids = [i.id for i in lease.images]
    store.complete(lease.lease, done=ids[:2], cached=[], failed={}, now=14.5)  # the third goes back
    with store._tx() as db:
        assert store._first_image(db, "j1", 2, now=14.5) == ("urgent", 4.5)
        assert store._first_image(db, "j1", 0, now=14.5) is None  # a completion that landed nothing
    lease = store.lease(worker, now=15, ttl=60)
    store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=20)
    with store._tx() as db:
        assert store._first_image(db, "j1", 1, now=20) is None  # its first image landed before
        assert store._first_image(db, "nope", 1, now=20) is None
    ttfi = scrape(store, 20)["bcg_time_to_first_image_seconds"]
    assert ttfi["bcg_time_to_first_image_seconds_count", (("priority", "urgent"),)] == 1  # one per job
    assert ttfi["bcg_time_to_first_image_seconds_sum", (("priority", "urgent"),)] == 4.5
    assert ttfi["bcg_time_to_first_image_seconds_bucket", (("le", "5.0"), ("priority", "urgent"))] == 1


def test_batch_fill_and_worker_startup_are_observed_from_the_lease_and_completion_paths(store):
    store.submit(planned("j1", n=3), None, 100, now=0)
    worker = store.register_worker("w", now=0, max_workers=4, ttl=1e9)
    lease = store.lease(worker, now=1, ttl=60, ready=False, uptime_s=30.0)  # not ready: not started yet
    work = Work(batches=(("64x64", 3, 1.5, 4),))  # 3 images in a bucket of 4
    store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=3, work=work)
    store.submit(planned("j2", n=2), None, 100, now=4)
    store.lease(worker, now=5, ttl=60, ready=True, uptime_s=42.0)  # its first lease taken ready
    store.submit(planned("j3", n=1), None, 100, now=6)
    store.lease(worker, now=7, ttl=60, ready=True, uptime_s=44.0)  # not its first
    families = scrape(store, 7)
    fill = families["bcg_batch_fill_ratio"]
    assert fill["bcg_batch_fill_ratio_count", ()] == 1 and fill["bcg_batch_fill_ratio_sum", ()] == 0.75
    assert fill["bcg_batch_fill_ratio_bucket", (("le", "0.625"),)] == 0
    assert fill["bcg_batch_fill_ratio_bucket", (("le", "0.75"),)] == 1
    startup = families["bcg_worker_startup_seconds"]
    assert startup["bcg_worker_startup_seconds_count", ()] == 1
    assert startup["bcg_worker_startup_seconds_sum", ()] == 42.0


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


class FakeNvml(ModuleType):
    """pynvml as the worker calls it, for one GPU: readings in NVML's units, `missing` ones not supported."""

    class NVMLError(Exception):
        pass

    def __init__(self, missing=(), init_fails=False):
        super().__init__("pynvml")
        self.missing, self.init_fails, self.energy_reads, self.mj = set(missing), init_fails, 0, 8.25e10

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert uuid == "GPU-8f3a"
        return "handle"

    def _read(self, key, value):
        if key in self.missing:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._read("utilization", 97))

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._read("power_watts", 612_500)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.energy_reads += 1
        self.mj += 1e6
        return self._read("energy_joules", self.mj)


def test_nvml_figures_in_watts_and_joules_the_energy_counter_read_at_most_every_few_seconds(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "_energy", {})
    assert nvml.figures("GPU-8f3a", clock=lambda: 100.0) == {"utilization": 0.97, "power_watts": 612.5,
                                                              "energy_joules": 8.25e7 + 1e3}
    assert nvml.figures("GPU-8f3a", clock=lambda: 100.0 + nvml.ENERGY_EVERY_S / 2)["energy_joules"] == 8.25e7 + 1e3
    assert fake.energy_reads == 1  # a lease request between reads does not pay for the counter
    assert nvml.figures("GPU-8f3a", clock=lambda: 100.0 + nvml.ENERGY_EVERY_S)["energy_joules"] == 8.25e7 + 2e3


@pytest.mark.parametrize("fake, left", [(None, set()), (FakeNvml(init_fails=True), set()),
                                        (FakeNvml(missing={"power_watts", "energy_joules"}), {"utilization"})],
                         ids=["no nvidia-ml-py", "no driver", "no power sensor"])
def test_nvml_figures_it_cannot_read_are_absent_not_zero(monkeypatch, fake, left):
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # None: `import pynvml` raises ImportError
    monkeypatch.setattr(nvml, "_energy", {})
    assert set(nvml.figures("GPU-8f3a")) == left


def test_gpu_stats_is_none_on_a_cpu_and_before_a_model_is_loaded():
    import torch

    from storyboard_cli.serve.worker import Hot, gpu_stats

    assert gpu_stats(Hot()) is None
    assert gpu_stats(SimpleNamespace(models=SimpleNamespace(device=torch.device("cpu")))) is None


@pytest.mark.gpu
def test_gpu_stats_reads_power_and_energy_from_nvml_on_a_gpu():
    """On a GPU with nvidia-ml-py: watts and joules of this device, energy never decreasing (and read again
    after nvml.ENERGY_EVERY_S); without nvidia-ml-py, neither key (absent, not zero). Prints a call's cost."""
    import time

    import torch

    from storyboard_cli.serve.worker import gpu_stats

    hot = SimpleNamespace(models=SimpleNamespace(device=torch.device("cuda", torch.cuda.current_device())))
    torch.ones(1, device="cuda")
    first = gpu_stats(hot)
    t0 = time.perf_counter()
    for _ in range(100):
        gpu_stats(hot)
    per_call_ms = (time.perf_counter() - t0) * 10
    time.sleep(nvml.ENERGY_EVERY_S)
    second = gpu_stats(hot)
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert not {"power_watts", "energy_joules", "utilization"} & set(first)
        return
    print(f"\nNVML: {second['power_watts']:.1f} W, {second['energy_joules']:.0f} J since the driver loaded, "
          f"utilisation {second['utilization']:.2f}; gpu_stats {per_call_ms:.3f} ms a call")
    assert 1 < first["power_watts"] < 2000 and 1 < second["power_watts"] < 2000
    assert 0 < first["energy_joules"] < second["energy_joules"]  # 5 s of an idle GPU: tens of joules
    assert 0 <= second["utilization"] <= 1
    assert second["total_memory_bytes"] == torch.cuda.get_device_properties(hot.models.device).total_memory
