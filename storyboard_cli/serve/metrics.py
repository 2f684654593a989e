"""/metrics: Prometheus text, read from the store at each scrape (totals and histograms live in the
database, so they survive a restart). GPU figures are what each worker's last lease request or heartbeat
carried (torch.cuda's memory statistics; NVML's utilisation, power and energy where it is installed); a CPU
worker has none, and none are shown for it. Per-worker series exist only for registered workers seen within
--lease-s (at most --max-workers), labelled by the id the server issued and the worker's name. Torch-free."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from storyboard_cli.serve import store as queue
from storyboard_cli.serve.blobs import BlobStore
from storyboard_cli.serve.disk import Disk
from storyboard_cli.serve.estimates import STALE
from storyboard_cli.serve.schedule import TIERS

PREFIX = "bcg_"
COUNTERS = {  # counter name in the store -> (metric, help)
    queue.RENDERED: ("images_rendered", "Images rendered by a worker."),
    queue.CACHED: ("images_cached", "Images copied from an identical image rendered before (dedup)."),
    queue.FAILED: ("images_failed", "Images that failed (their own error, or their worker lost 3 times)."),
    queue.EXPIRED: ("lease_expiries", "Leases that expired: their worker stopped heartbeating."),
    queue.LATE: ("late_completions", "Completions for a lease already expired: ignored."),
    queue.RETRIES: ("image_retries", "Images leased again after their worker was lost."),
    queue.OOMS: ("out_of_memory", "Batches that ran out of GPU memory (split or retried eager)."),
    queue.MODEL_LOADS: ("model_loads", "Models loaded by workers (a hot worker loads once per model)."),
    queue.STRIKES: ("worker_strikes", "Leases a worker gave back for an error of its own machine (its device): "
                    "their images kept their attempts."),
    queue.QUARANTINES: ("worker_quarantines", f"Workers quarantined: {queue.MAX_STRIKES} leases in a row given "
                        "back for their machine's errors."),
}
REJECTED = {queue.REJECTED_FULL: "queue_full", queue.REJECTED_INVALID: "too_large"}


@dataclass(frozen=True)
class Histogram:
    metric: str
    help: str
    label: str | None = None
    shown: tuple[str, ...] = ("",)  # label values exposed, empty, before their first observation


HISTOGRAMS = {  # histogram name in the store -> its exposition (bounds: store.bounds)
    queue.QUEUE_WAIT: Histogram("queue_wait_seconds", "Seconds from a job's submission to its image's first lease, "
                                "by the job's priority.", "priority", TIERS),
    queue.IMAGE_RENDER: Histogram("image_render_seconds", "Seconds of rendering per image (its batch's time / "
                                  "images)."),
    queue.JOB_LATENCY: Histogram("job_latency_seconds", "Seconds from submission to the job's last image "
                                 "(succeeded or failed jobs)."),
    queue.BATCH_SECONDS: Histogram("batch_seconds", "Seconds per rendered batch, by image shape.", "shape", ()),
    queue.FIRST_IMAGE: Histogram("time_to_first_image_seconds", "Seconds from a job's submission to its first "
                                 "finished image (rendered or cached), by the job's priority.", "priority", TIERS),
    queue.BATCH_FILL: Histogram("batch_fill_ratio", "A rendered batch's images over its bucket's rows (1: no "
                                "padded rows)."),
    queue.WORKER_STARTUP: Histogram("worker_startup_seconds", "Seconds from a worker's start to the first lease "
                                    "it took ready (its model loaded, its graphs captured)."),
}
WORKER = ["worker", "name"]  # the id the server issued, the name the worker registered with
GPU_MEMORY = {"allocated": "memory_allocated_bytes", "reserved": "memory_reserved_bytes",
              "peak": "max_memory_allocated_bytes", "total": "total_memory_bytes"}
GPU_SERIES = {  # a worker's GPU figure (worker.gpu_stats) -> (family, metric, help), one series per worker
    "utilization": (GaugeMetricFamily, "worker_gpu_utilization_ratio", "A worker's GPU busy fraction (NVML)."),
    "power_watts": (GaugeMetricFamily, "worker_gpu_power_watts", "A worker's GPU power draw in watts (NVML)."),
    "energy_joules": (CounterMetricFamily, "worker_gpu_energy_joules", "Joules a worker's GPU has used since its "
                      "driver loaded (NVML)."),
}


class StoreCollector:
    def __init__(self, store: queue.Store, clock: Callable[[], float], worker_window_s: float):
        self.store, self.clock, self.window = store, clock, worker_window_s

    def collect(self):
        now = self.clock()
        s = self.store.stats(now, self.window)
        images = GaugeMetricFamily(PREFIX + "queue_images", "Images queued or rendering.", labels=["priority"])
        jobs = GaugeMetricFamily(PREFIX + "queue_jobs", "Jobs with images queued or rendering.", labels=["priority"])
        oldest = GaugeMetricFamily(PREFIX + "queue_oldest_age_seconds", "Seconds the oldest image waiting for a "
                                   "lease has waited since its job's submission (0: none waits).", labels=["priority"])
        for prio, (n_images, n_jobs) in s["depth"].items():
            images.add_metric([prio], n_images)
            jobs.add_metric([prio], n_jobs)
        for prio, age in self.store.slo_stats(now)["oldest_queued_s"].items():
            oldest.add_metric([prio], age)
        by_state = GaugeMetricFamily(PREFIX + "jobs", "Jobs by state.", labels=["state"])
        for state, n in s["jobs"].items():
            by_state.add_metric([state], n)
        leases = GaugeMetricFamily(PREFIX + "leases", "Batches leased to workers now.", value=s["leases"])
        yield from (images, jobs, oldest, by_state, leases)
        yield GaugeMetricFamily(PREFIX + "images_per_second", "Images finished per second over the last 5 minutes.",
                                value=s["images_per_s"])
        yield GaugeMetricFamily(PREFIX + "stale_leases", f"Leases running longer than {STALE:g}x their time estimate "
                                "(the cost table times their worker's calibration).",
                                value=self.store.stale_leases(now))
        ratio = GaugeMetricFamily(PREFIX + "worker_estimate_ratio", "A worker's measured over estimated batch seconds "
                                  "(the median of its last leases): its calibration.", labels=WORKER)
        for w in s["workers"]:
            if (factor := self.store.calibration.factor(w.id)) is not None:
                ratio.add_metric([w.id, w.name], factor)
        yield ratio
        for name, (metric, text) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + metric, text, value=s["counters"].get(name, 0))
        rejected = CounterMetricFamily(PREFIX + "rejected_submissions", "Submissions refused.", labels=["reason"])
        for name, reason in REJECTED.items():
            rejected.add_metric([reason], s["counters"].get(name, 0))
        yield rejected
        yield from histograms(s["histograms"])
        yield from workers(s["workers"])
        yield GaugeMetricFamily(PREFIX + "workers_ready", "Registered workers seen lately whose model is loaded and "
                                "graphs captured, not quarantined (what /readyz waits for).",
                                value=sum(w.ready and w.quarantined is None for w in s["workers"]))
        dispatch = self.store.dispatch()  # what the studio holds back (POST /v1/queue/pause, /v1/workers/{id}/drain)
        yield GaugeMetricFamily(PREFIX + "dispatch_paused", "1 while dispatch is paused: no batch is leased.",
                                value=float(dispatch.paused is not None))
        yield GaugeMetricFamily(PREFIX + "workers_drained", "Worker names drained: leased nothing until resumed.",
                                value=len(dispatch.drained))


def histograms(observed: dict[tuple[str, str], tuple[list[int], float]]):
    for name, h in HISTOGRAMS.items():
        bounds = [str(b) for b in queue.bounds(name)] + ["+Inf"]
        family = HistogramMetricFamily(PREFIX + h.metric, h.help, labels=[h.label] if h.label else None)
        rows = {lab: ([0] * len(bounds), 0.0) for lab in h.shown}  # series an alert names exist from the start
        rows.update({lab: v for (n, lab), v in observed.items() if n == name})
        for lab, (counts, total) in sorted(rows.items()):
            cumulative, running = [], 0
            for bound, n in zip(bounds, counts):
                running += n
                cumulative.append((bound, running))
            family.add_metric([lab] if h.label else [], cumulative, total)
        yield family


def workers(seen: list[queue.Seen]):
    """The registered workers seen lately (at most --max-workers: ids the server issued, never names a client
    made up), each labelled by its id and name; GPU memory, utilisation, power and energy only for those that
    have a GPU and said so."""
    yield GaugeMetricFamily(PREFIX + "workers", "Registered workers that asked for work or renewed a lease lately.",
                            value=len(seen))
    ready = GaugeMetricFamily(PREFIX + "worker_ready", "1 once the worker's model is loaded and graphs captured.",
                              labels=WORKER)
    quarantined = GaugeMetricFamily(PREFIX + "worker_quarantined", "1 when the worker gets no more leases: it gave "
                                    "back too many in a row for its machine's errors.", labels=WORKER)
    memory = GaugeMetricFamily(PREFIX + "worker_gpu_memory_bytes", "A worker's GPU memory (torch.cuda).",
                               labels=[*WORKER, "kind"])
    figures = {key: family(PREFIX + metric, text, labels=WORKER) for key, (family, metric, text) in GPU_SERIES.items()}
    for w in seen:
        ready.add_metric([w.id, w.name], float(w.ready))
        quarantined.add_metric([w.id, w.name], float(w.quarantined is not None))
        gpu = w.gpu or {}
        for kind, key in GPU_MEMORY.items():
            if gpu.get(key) is not None:
                memory.add_metric([w.id, w.name, kind], gpu[key])
        for key, family in figures.items():
            if gpu.get(key) is not None:
                family.add_metric([w.id, w.name], gpu[key])
    yield from (ready, quarantined, memory, *figures.values())


class DiskCollector:
    """The root's free bytes and the writes refused for want of space (disk.py), the input files stored and those
    collected (blobs.py), read at each scrape; the counters since the server started."""

    def __init__(self, disk: Disk, blobs: BlobStore):
        self.disk, self.blobs = disk, blobs

    def collect(self):
        yield GaugeMetricFamily(PREFIX + "root_free_bytes", "Bytes free on the filesystem of the server's --root.",
                                value=self.disk.free())
        yield CounterMetricFamily(PREFIX + "disk_full", "Requests refused (507) because the server's disk was full "
                                  "or under --min-free-mb.", value=self.disk.refused)
        yield GaugeMetricFamily(PREFIX + "leases_held", "1 while no batch is leased: a write into the job folders "
                                "was refused for want of space, and not enough has been freed since.",
                                value=int(self.disk.holding() is not None))
        yield GaugeMetricFamily(PREFIX + "blobs_bytes", "Bytes of the stored input files (at most --max-blobs-gb).",
                                value=self.blobs.used())
        yield CounterMetricFamily(PREFIX + "blobs_collected", "Input files removed because no job named them for "
                                  "--blob-grace-s.", value=self.blobs.collected)


def registry(store: queue.Store, worker_window_s: float, clock: Callable[[], float] = time.time,
             disk: Disk | None = None, blobs: BlobStore | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store, clock, worker_window_s))
    if disk is not None and blobs is not None:
        reg.register(DiskCollector(disk, blobs))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
