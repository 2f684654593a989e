"""torchrun integration: one job's batches shared by N workers, one GPU each, one output folder.

    torchrun --nproc-per-node 2 -m storyboard_cli render job.yaml          (or: bcg render job.yaml --gpus 2)

Each worker runs the same `RenderSession` phases. Rank 0 holds the folder lock, reconciles the folder
and sends the items left to render through the process group's store; every worker cuts them into
the same batches (job/plan.py is deterministic) and claims them one at a time with `store.add`, largest
first, so a slow or late worker never holds the job back. A worker appends its manifest lines to a
shard of its own (folder/shards.py); at the end every worker posts its figures to the store and rank 0
merges the shards and writes one report. Only the store is used, never a collective: a worker that
was stopped (Ctrl-C, SIGTERM) can never leave another blocked in one.

Data parallel, not pipeline parallel: an image never leaves its GPU, so there is no traffic during
a step, and an image is computed exactly as a single process computes it (same batch, same rows).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from storyboard_cli.errors import BadInput, OutputLocked, RenderFailure, Status
from storyboard_cli.folder.layout import read_report
from storyboard_cli.folder.lock import OutputLock
from storyboard_cli.folder.outputs import Manifest, Pending
from storyboard_cli.folder.report import Report, WorkerShare, write_report
from storyboard_cli.folder.shards import merge_shards, shard_manifest
from storyboard_cli.folder.sink import ContactSheet
from storyboard_cli.job.file import Job
from storyboard_cli.job.plan import Batch
from storyboard_cli.run import render as rendering
from storyboard_cli.run.batch import batch_shapes

MODULE = "storyboard_cli"  # what a launched worker runs: python -m storyboard_cli render ...
TIMEOUT = timedelta(minutes=30)  # the process group's and the store's (rank 0 may scan a big folder first)
STOP_WAIT_S = 3.0  # after a stop, how long rank 0 waits for the others' figures (a SIGTERM stops them at once)
POLL_S = 0.02
COUNTED = ("batch", "progress", "image", "failed")  # the events whose `done` counts outputs
SHARDS_LEFT = "the next run merges their manifest lines"  # unless the launcher merges them first
LAUNCHED = "BCG_GPUS_LAUNCHER"  # set by `--gpus N` for its workers: the launcher, not rank 0, says how the run ended
DELIVERED_POLL_S = 0.25  # how often rank 0, done with its own batches, reads the others' progress
STOPS = (signal.SIGTERM, signal.SIGINT)  # what the launcher sends its workers: a death by another signal is a crash


@dataclass(frozen=True)
class Worker:
    """This process's place in a torchrun job (torchrun's environment variables)."""

    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def worker() -> Worker | None:
    """The torchrun worker this process is, or None when torchrun did not start it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return Worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def leader() -> bool:
    """Whether this process speaks for the job (prints, writes the report): rank 0, or no torchrun."""
    w = worker()
    return w is None or w.leader


def launched() -> bool:
    """Whether this process is a worker `bcg render --gpus N` started: its launcher, which merges what every worker
    left once they have all exited, prints how the run ended."""
    return worker() is not None and os.environ.get(LAUNCHED) == "1"


def worker_device(device: str | None, w: Worker) -> str:
    """One GPU per worker: any cuda device becomes `cuda:LOCAL_RANK`; the CPU stays the CPU."""
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        return "cpu"
    if w.local_rank >= torch.cuda.device_count():
        raise BadInput(f"worker {w.rank} has LOCAL_RANK {w.local_rank} but this machine has "
                       f"{torch.cuda.device_count()} GPU(s): start at most that many workers per machine")
    return f"cuda:{w.local_rank}"


def connect(w: Worker, device: torch.device) -> dist.Store:
    """Joins the process group (nccl on CUDA, gloo on the CPU) through torchrun's rendezvous and returns
    the store this job coordinates through (the group's store, under a prefix of its own)."""
    store, rank, world = next(dist.rendezvous("env://", timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore("pg", store),
                            rank=rank, world_size=world, timeout=TIMEOUT)
    return dist.PrefixStore("bcg", store)


# --- claiming work -------------------------------------------------------------------------------

def cost(batch: Batch) -> int:
    """What a batch costs to render: rows x steps x pixels (CFG doubles every row alike)."""
    k = batch.key
    return batch.size * k.steps * k.width * k.height


def claim_queues(batches: list[Batch]) -> list[list[list[int]]]:
    """Batch indices in tiers of equal cost, largest first; in each tier one queue per shape and LoRA set."""
    shapes = batch_shapes(batches)
    tiers: dict[int, dict] = {}
    for i in sorted(range(len(batches)), key=lambda i: -cost(batches[i])):  # stable: plan order within a tier
        tiers.setdefault(cost(batches[i]), {}).setdefault((shapes[i], batches[i].key.loras), []).append(i)
    return [list(queues.values()) for queues in tiers.values()]


def claim(store, batches: list[Batch], rank: int = 0) -> Iterator[Batch]:
    """The batches this worker renders, claimed one at a time: `store.add` hands out each queue's next
    index exactly once across all workers. Within a tier a worker asks first for the LoRA set its
    weights hold now (no swap), then for the shapes it has already run (their graphs are captured);
    else it starts at the queue its rank points to, so that workers new to a tier spread over its shapes."""
    shapes = batch_shapes(batches)
    warm: set = set()
    loras: tuple = ()  # the set the worker's weights hold: the model's own at the start
    for t, queues in enumerate(claim_queues(batches)):
        start = rank % len(queues)
        left = list(range(start, len(queues))) + list(range(start))
        while left:
            # stable: the current LoRA set first, then warm shapes
            left.sort(key=lambda q: (batches[queues[q][0]].key.loras != loras, shapes[queues[q][0]] not in warm))
            q = left[0]
            n = store.add(f"claim/{t}/{q}", 1)
            if n > len(queues[q]):
                left.pop(0)  # every batch of this queue is taken
                continue
            i = queues[q][n - 1]
            warm.add(shapes[i])
            loras = batches[i].key.loras
            yield batches[i]


def _wait(store, keys: list[str], deadline: float | None = None, on_poll: Callable[[], None] = lambda: None) -> bool:
    """Waits until `keys` are set (or the deadline passes), polling (and calling `on_poll`): between two polls a
    signal handler runs, which it cannot while the store's own blocking wait is in C."""
    while not store.check(keys):
        if deadline is not None and time.perf_counter() > deadline:
            return False
        on_poll()
        time.sleep(POLL_S)
    return True


@contextmanager
def _wakeable():
    """While waiting on the store, a stop signal ends the wait at once (KeyboardInterrupt)."""
    def wake(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, wake) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# --- the worker's session ------------------------------------------------------------------------

class _NoSheet(ContactSheet):
    """The contact sheet of a worker other than rank 0: rank 0 alone writes index.html. The thumbnails of this
    worker's own images it makes, as they land (`ContactSheet.thumb`), so rank 0's updates find them made."""

    def update(self, failures: list[dict], running: bool = False, final: bool = True) -> None:
        pass


class DistSession(rendering.RenderSession):
    """A RenderSession that shares its job with the other torchrun workers through `store`."""

    def __init__(self, job: Job, opts: rendering.RenderOptions, on_event, w: Worker, store):
        self.w, self.store = w, store
        self.show = on_event if w.leader else None  # one progress display: rank 0's
        self.counted = self.delivered = 0  # outputs this worker / the job has delivered
        self.polled = 0.0  # when rank 0 last read the job's progress while waiting for the others
        super().__init__(job, opts, self._job_progress)
        self.t_run = self.t_pending = None
        if not w.leader:
            self.sheet = _NoSheet(self.out_dir, job, self.notes)

    def lock(self):
        return super().lock() if self.w.leader else nullcontext()

    def _job_progress(self, e: rendering.Event) -> None:
        """Progress counts the job's outputs, not this worker's: each batch's are added up in the store."""
        if e.kind == "progress":  # a batch delivered (main thread)
            self.delivered = self.store.add("delivered", e.done - self.counted)
            self.counted = e.done
        if self.show:
            self.show(replace(e, done=self.delivered) if e.kind in COUNTED else e)

    def _others_progress(self) -> None:
        """Rank 0, its own batches done, shows the job's progress as the other workers deliver theirs: the last line
        reaches the total."""
        if self.show is None or time.perf_counter() - self.polled < DELIVERED_POLL_S:
            return
        self.polled = time.perf_counter()
        delivered = self.store.add("delivered", 0)
        if delivered > self.delivered:
            self.delivered = delivered
            self.show(rendering.Event("progress", delivered, self.pending.outputs))

    def find_pending(self) -> tuple[Pending, Manifest]:
        """Rank 0 reconciles the folder (merging the shards a dead run left) and sends what is pending,
        with its run id (the manifest lines and the set-aside folder name it); every worker then appends
        to a manifest shard of its own."""
        if self.w.leader:
            pending, _ = super().find_pending()  # it merges the shards a dead run left
            self.store.set("pending", pickle.dumps((pending, self.run_id)))
        else:
            _wait(self.store, ["pending"])
            pending, self.run_id = pickle.loads(self.store.get("pending"))
        self.t_pending = time.perf_counter()  # the moment every worker shares: idle times are measured from it
        return pending, shard_manifest(self.out_dir, self.w.rank)

    def owns_done_bases(self) -> bool:
        return self.w.leader  # each worker renders the hires passes of the bases it rendered; rank 0 the rest

    def capture_ahead(self, shapes: list) -> list:
        """None: a worker captures the shapes it claims, on first use (the engine is sized for all of
        them when it is built). Capturing every shape on every GPU would cost each worker the whole
        job's capture time, and that time does not shrink with more GPUs; claims keep a worker on the
        shapes it has captured."""
        return []

    def work(self) -> Iterator[Batch]:
        self.t_run = time.perf_counter()
        return claim(self.store, self.batches, self.w.rank)

    def publish(self, report: Report, keep_last: bool) -> tuple[Report, tuple | None]:
        """Every worker posts its figures to the store; rank 0 waits for all of them (a few seconds at most
        after a stop; not at all after an error of its own), merges the shards and writes the job's report."""
        now = time.perf_counter()
        share = WorkerShare(self.w.rank, socket.gethostname(), busy_s=now - self.t_run if self.t_run else 0.0,
                            arrived_s=now - self.t_pending if self.t_pending else 0.0)
        self.store.set(f"report/{self.w.rank}", json.dumps(replace(report, share=share).to_json()))
        if not self.w.leader:
            # rank 0 speaks for the job (the report, the exit code): a worker whose share is finished exits
            # 0, so that torchrun never stops rank 0 while it merges (a failed image is in the report)
            return replace(report, status=Status.DONE if report.status == Status.FAILED else report.status), None
        if report.status == Status.ERROR:
            return super().publish(report, keep_last)
        seen = self._gather(stopped=report.status == Status.INTERRUPTED)
        merged = Report.merge([Report.from_json(json.loads(self.store.get(f"report/{r}"))) for r in seen])
        if len(seen) < self.w.world:
            merged = replace(merged, status=Status.INTERRUPTED, notes=[
                *merged.notes, f"{self.w.world - len(seen)} of {self.w.world} workers sent no figures; {SHARDS_LEFT}"])
        else:
            merge_shards(self.out_dir)
        return super().publish(merged, keep_last and not merged.images_rendered)

    def _gather(self, stopped: bool) -> list[int]:
        """The ranks whose figures have come in: all of them, unless stopped (then what came in time)."""
        keys = [f"report/{r}" for r in range(self.w.world)]
        try:
            with _wakeable():
                _wait(self.store, keys, time.perf_counter() + STOP_WAIT_S if stopped else None, self._others_progress)
            self.polled = 0.0
            self._others_progress()  # every worker's last batch, delivered before its figures
        except KeyboardInterrupt:
            pass  # stopped while waiting: report what has come in
        return [r for r, key in enumerate(keys) if self.store.check([key])]


# --- entry points --------------------------------------------------------------------------------

def render(job: Job, opts: rendering.RenderOptions = rendering.RenderOptions(),
           on_event: Callable[[rendering.Event], None] | None = None) -> rendering.RenderResult:
    """Renders `job` as one torchrun worker of many; a plain render when torchrun did not start this
    process (or started it alone)."""
    w = worker()
    if w is None or w.world == 1:
        return rendering.render(job, opts, on_event)
    opts = replace(opts, device=worker_device(opts.device, w))
    store = connect(w, torch.device(opts.device))
    try:
        return DistSession(job, opts, on_event, w, store).execute()
    finally:
        dist.destroy_process_group()


def launch_note(n: int, device: str | None) -> str | None:
    """What `--gpus N` will do when it is not N GPUs: CPU workers (no GPU here, or --device cpu)."""
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        why = "--device cpu" if device == "cpu" else "this machine has no GPU"
        return f"--gpus {n}: {why}, so {n} workers render on the CPU"
    return None


def launch(n: int, argv: list[str], out_dir: Path, job: Job, module: str = MODULE) -> tuple[int, Report | None]:
    """`bcg render JOB --gpus N`: starts N workers on this machine through torchrun's own launcher
    (`python -m <module> <argv>` each; a worker sees it runs under torchrun and ignores --gpus), and
    makes `out_dir` whole however they ended (`job`: what they render there): their manifest shards merged,
    a line for each image a killed worker wrote but did not record, the report's count of images made true.
    Returns the exit code (0, the first failed worker's, or 128 + the signal that stopped the launcher) and the
    run's report (None where rank 0 wrote none); a worker killed by a signal (kill -9, the OOM killer) raises
    RenderFailure naming its rank and what is done, also in the report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if n < 1:
        raise BadInput(f"--gpus: expected at least 1, got {n}")
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise BadInput(f"--gpus {n}: this machine has {torch.cuda.device_count()} GPU(s)")
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={n}", "--module", module, *argv])
    started, since, code, death = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.time(), 0, None
    os.environ[LAUNCHED] = "1"  # inherited by the workers
    try:
        run(args)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        dead = [(rank, f) for rank, f in failures if f.exitcode < 0 and -f.exitcode not in STOPS]
        if dead:
            rank, f = dead[0]
            death = f"worker rank {rank} (pid {f.pid}) died from {f.signal_name()}"
        codes = [f.exitcode for _, f in failures]
        code = next((c for c in codes if c > 0), 128 - codes[0])  # else the signal that killed the first
    except SignalException as e:
        code = 128 + e.sigval  # as a single render stopped by that signal
    finally:
        os.environ.pop(LAUNCHED, None)
        recovered = _merge_after(Path(out_dir), job, since)
        report = _settle_report(Path(out_dir), started, recovered, death)
    if death:
        done = f"the {report.images_rendered} images this run rendered" if report else "the images finished"
        raise RenderFailure(f"{death}; {done} are kept, the next run renders the rest")
    return code, report


def _merge_after(out_dir: Path, job: Job, since: float) -> int | None:
    """The folder made whole once the workers have all exited, as a render's start would (under the folder's
    lock): how many images it found written since `since` (this run's start) with no line, which a killed worker
    renamed into place but did not record; None when another render holds the folder, or it cannot be written (the
    next run does it)."""
    try:
        with OutputLock(out_dir):
            recovered = rendering.settle_folder(job, out_dir)[2]
    except (OutputLocked, BadInput, OSError):
        return None
    return sum(_written_since(out_dir / path, since) for path in recovered)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _settle_report(out_dir: Path, started: str, recovered: int | None, death: str | None) -> Report | None:
    """This run's report (rank 0's) made true once its folder is whole (`recovered`: _merge_after's count, None
    where it could not): with the shards merged, its count of images is what the manifest holds of the run (rank 0
    counted only the workers whose figures came in), plus the images a killed worker wrote but did not record, and
    the note that the next run merges them goes; a dead worker makes its status an error naming it. Rank 0's own count
    stands only where every worker's figures came in: not after a worker died, nor after rank 0 failed (it then
    publishes without waiting for them, and without the note). None where rank 0 wrote no report this run."""
    data = read_report(out_dir)
    if not data or data.get("run", {}).get("started", "") < started:
        return None  # rank 0 wrote none this run
    report = Report.from_json(data)  # this run's: written by this version, every key there
    partial = death or report.status == Status.ERROR or any(n.endswith(SHARDS_LEFT) for n in report.notes)
    if recovered is not None and (recovered or partial):
        run = report.run.get("id")
        landed = sum(r.get("run") == run for r in Manifest(out_dir).records.values()) + recovered
        report = replace(report.recounted(landed), notes=[n for n in report.notes if not n.endswith(SHARDS_LEFT)])
    if death:
        report = replace(report, status=Status.ERROR, error=death, stopped_by=None)
    try:
        write_report(out_dir, report)
    except OSError:
        pass  # the summary and the error line say it
    return report
