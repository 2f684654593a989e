"""/metrics: Prometheus text, read from the store at each scrape (totals live in the database, so they
survive a restart). Torch-free."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from storyboard_cli.serve import store as queue

PREFIX = "bcg_"
COUNTERS = {  # counter name in the store -> (metric, help)
    queue.RENDERED: ("images_rendered", "Images rendered by a worker."),
    queue.CACHED: ("images_cached", "Images copied from an identical image rendered before (dedup)."),
    queue.FAILED: ("images_failed", "Images that failed (their own error, or their worker lost 3 times)."),
    queue.EXPIRED: ("lease_expiries", "Leases that expired: their worker stopped heartbeating."),
    queue.LATE: ("late_completions", "Completions for a lease already expired: ignored."),
}
REJECTED = {queue.REJECTED_FULL: "queue_full", queue.REJECTED_INVALID: "too_large"}


class StoreCollector:
    def __init__(self, store: queue.Store):
        self.store = store

    def collect(self):
        s = self.store.stats()
        images = GaugeMetricFamily(PREFIX + "queue_images", "Images queued or rendering.", labels=["priority"])
        jobs = GaugeMetricFamily(PREFIX + "queue_jobs", "Jobs with images queued or rendering.", labels=["priority"])
        for prio, (n_images, n_jobs) in s["depth"].items():
            images.add_metric([prio], n_images)
            jobs.add_metric([prio], n_jobs)
        by_state = GaugeMetricFamily(PREFIX + "jobs", "Jobs by state.", labels=["state"])
        for state, n in s["jobs"].items():
            by_state.add_metric([state], n)
        leases = GaugeMetricFamily(PREFIX + "leases", "Batches leased to workers now.", value=s["leases"])
        yield from (images, jobs, by_state, leases)
        for name, (metric, text) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + metric, text, value=s["counters"].get(name, 0))
        rejected = CounterMetricFamily(PREFIX + "rejected_submissions", "Submissions refused.", labels=["reason"])
        for name, reason in REJECTED.items():
            rejected.add_metric([reason], s["counters"].get(name, 0))
        yield rejected


def registry(store: queue.Store) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
