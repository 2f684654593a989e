"""The queue's cost per batch as it keeps finished jobs: a `Store` (serve/store.py) on a folder (default /dev/shm)
filled with finished 16-image jobs, and at each size the median of 20 more jobs, each a submission, two leases of
8 images with a heartbeat each and two completions, as a worker's calls make them. `--scan` first removes the index
of the images by their lease (the queue before it had one), for the side-by-side figures of docs/PERFORMANCE.md:

    PYTHONPATH=tests python3 benchmarks/queue_history.py --scan && PYTHONPATH=tests python3 benchmarks/queue_history.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from storyboard_cli.serve import queue_file

from helpers.serve import planned

LEASE_INDEX = "CREATE INDEX IF NOT EXISTS images_lease ON images(lease) WHERE lease IS NOT NULL;\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scan", action="store_true", help="without the images' lease index")
    parser.add_argument("--sizes", default="0,1000,5000,10000", help="finished jobs at which to time")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = parser.parse_args()
    if args.scan:
        assert LEASE_INDEX in queue_file.SCHEMA
        queue_file.SCHEMA = queue_file.SCHEMA.replace(LEASE_INDEX, "")
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
            print(f"{'without' if args.scan else 'with'} the lease index, {size} finished jobs ({16 * size} images): "
                  f"{statistics.median(times) * 1000:.2f} ms a job of two batches", flush=True)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
