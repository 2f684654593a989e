"""The queue's cost as it keeps finished jobs: a `Store` (serve/store.py) on a folder (default /dev/shm) filled
with finished 16-image jobs, and at each size the median of 20 more jobs, each a submission, two leases of 8 images
with a heartbeat each and two completions, as a worker's calls make them; then the median of 5 scrapes of /metrics'
figures (`Store.stats`). `--before`: the queue as it was before the forty-ninth session, without the index of the
images by their lease and counting the jobs per state from every image at each scrape, for the side-by-side
figures of docs/PERFORMANCE.md:

    PYTHONPATH=tests:. python3 benchmarks/queue_history.py --before && PYTHONPATH=tests:. python3 benchmarks/queue_history.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from collections import Counter

from storyboard_cli.serve import queue_file, queue_stats, schedule

from helpers.serve import planned

LEASE_INDEX = "CREATE INDEX IF NOT EXISTS images_lease ON images(lease) WHERE lease IS NOT NULL;\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", action="store_true", help="the queue as it was: no lease index, every image read "
                                                              "at each scrape")
    parser.add_argument("--sizes", default="0,1000,5000,10000", help="finished jobs at which to time")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = parser.parse_args()
    if args.before:
        assert LEASE_INDEX in queue_file.SCHEMA
        queue_file.SCHEMA = queue_file.SCHEMA.replace(LEASE_INDEX, "")
        queue_stats.QueueStats._job_states = _every_image
    from storyboard_cli.serve.store import Store

    root = Path(tempfile.mkdtemp(prefix="queue-history-", dir=args.dir))
    store = Store(root)
    worker = store.register_worker("w", now=0, max_workers=64, ttl=1e12)

    def job(name: str, now: float) -> None:
        store.submit(planned(name, n=16, batch=8), None, 10**6, now=now)
        while (lease := store.lease(worker, now=now, ttl=60)) is not None:
            store.heartbeat(lease.lease, now=now, ttl=60, worker=worker)
            store.complete(lease.lease, done=[i.id for i in lease.images], cached=[], failed={}, now=now)

    try:
        done = 0
        for size in map(int, args.sizes.split(",")):
            while done < size:
                job(f"done-{done}", done)
                done += 1
            times = []
            for k in range(20):
                t0 = time.perf_counter()
                job(f"timed-{size}-{k}", 10**9)
                times.append(time.perf_counter() - t0)
            scrapes = []
            for _ in range(5):
                t0 = time.perf_counter()
                store.stats(10**9, 60)
                scrapes.append(time.perf_counter() - t0)
            print(f"{'before' if args.before else 'now'}, {size} finished jobs ({16 * size} images): "
                  f"{statistics.median(times) * 1000:.2f} ms a job of two batches, "
                  f"{statistics.median(scrapes) * 1000:.2f} ms a scrape", flush=True)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _every_image(self, db) -> Counter:
    """The jobs per state as a scrape counted them before: every job's images read, each scrape."""
    canceled = {r[0]: bool(r[1]) for r in db.execute("SELECT id, canceled FROM jobs")}
    per_job: dict[str, Counter] = {}
    for job, state, n in db.execute("SELECT job, state, COUNT(*) FROM images GROUP BY job, state"):
        per_job.setdefault(job, Counter())[state] = n
    return Counter(schedule.job_state(c, canceled[j]) for j, c in per_job.items())


if __name__ == "__main__":
    main()
