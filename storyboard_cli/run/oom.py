"""The out-of-memory policy around a BatchRunner: free the engine's memory, split the batch into
smaller buckets (down to 1, then the eager fallback), and remember the size that failed so later
batches are split before they run. A failure of one batch alone is recorded against its images.

A batch's decode runs beside the next batch's denoising: its images are delivered once the next batch's loop is
queued and the decode is done (`deliver_ready`: the host does not wait for a decode while it could queue a loop), and
at the latest when a third batch's decode would be in flight or before anything else reaches the sink (a failure, the
render's end, a stop: `flush`), so the sink sees the batches in order."""

from __future__ import annotations

import logging
from collections import deque
from typing import Sequence

import torch

from storyboard_cli.errors import DeviceUnusable, first_line, one_line
from storyboard_cli.folder.sink import OutputSink
from storyboard_cli.job.plan import Batch, make_batches
from storyboard_cli.run.batch import BatchRunner, Decoded, Decoding, bucket_label

log = logging.getLogger(__name__)
# What one bad batch may raise (an unreadable control image, a decode error) and the job goes on.
# Anything else (TypeError, AttributeError, ...) is a bug of ours: it aborts, with its traceback.
BATCH_ERRORS = (OSError, ValueError, RuntimeError)
# What a failed device raises (a CUDA error is sticky: every later batch of the process fails too): the render
# stops with DeviceUnusable, not the batch's images failed as if they were at fault.
DEVICE_FAULTS = ("CUDA error", "CUDA driver error", "CUBLAS_STATUS_", "cuDNN error")
# Decodes in flight at most once a batch's decode is queued: the one of the batch whose loop was just queued, and the
# one before it, still running beside that loop. Each holds its batch's latents and pixels until delivered.
MAX_DECODES = 2


def _raise_if_device(e: BaseException) -> None:
    """A device's own error stops the render (the batches still in flight are lost to it, and rendered again by
    the next run or lease); any other error is the batch's."""
    failure = device_failure(e)
    if failure is not None:
        raise failure from e


def device_failure(e: BaseException) -> DeviceUnusable | None:
    """The error as DeviceUnusable when it is the device's (torch's AcceleratorError, or a CUDA library's error
    text); None when it is not."""
    if isinstance(e, getattr(torch, "AcceleratorError", ())) or str(e).lstrip().startswith(DEVICE_FAULTS):
        return DeviceUnusable(f"the device failed: {first_line(e, 200)}")
    return None


def _halved(buckets: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The buckets a batch of `size` that ran out of memory is split into: at most half of it (8 -> 4 + 4, 7 -> 3 + 3
    + 1), so that buckets of every size up to 8 reach one image in as few tries as 1, 2, 4, 8 do; where none is that
    small, every bucket below `size`."""
    return tuple(b for b in buckets if b <= size // 2) or tuple(b for b in buckets if b < size)


class OutOfMemoryPolicy:
    """Runs batches through a BatchRunner and hands what comes out to the OutputSink, under the
    out-of-memory policy: free the engine's memory, split the batch into smaller buckets (down to 1,
    then the eager fallback), and remember the size that failed so later batches are split before they run."""

    def __init__(self, runner: BatchRunner, sink: OutputSink):
        self.runner, self.sink = runner, sink
        self.notes: list[str] = []
        self.oom_at = 1 << 30  # the smallest batch size that ran out of memory
        self.out_of_memory = 0  # batches that ran out of memory (the render service counts them)
        self.pending: deque[tuple[Decoding, str]] = deque()  # the batches whose decodes are in flight, in order

    def deliver(self, decoded: list[Decoded], label: str) -> None:
        """An image with NaN/inf is recorded as failed, never saved."""
        for d in decoded:
            if d.pixels is None:
                self.sink.fail([d.item], d.failure)
            else:
                self.sink.submit(d.item, d.pixels, label)

    def process(self, batch: Batch, buckets: tuple[int, ...], fallback: bool = False,
                upcoming: Sequence[Batch] = ()) -> None:
        """One batch, end to end, under the out-of-memory policy; a batch whose LoRA the models reject
        fails alone. `upcoming`: the batches after it, in order, where known (BatchRunner.run_batch: the next one's
        prompts are encoded beside this one's loop, and its graphs and those of the batches after it captured)."""
        problem = self.runner.lora_problem(batch)
        if problem:
            self.flush()
            self.sink.fail(batch.items, problem)
            return
        smaller = _halved(buckets, min(batch.size, self.oom_at))
        if batch.size >= self.oom_at and smaller:
            self._split(batch, smaller, fallback)
        elif not self._attempt(batch, fallback, upcoming):
            self._out_of_memory(batch, buckets, fallback)

    def _attempt(self, batch: Batch, fallback: bool, upcoming: Sequence[Batch] = ()) -> bool:
        """Runs the batch and queues its decode; False if it ran out of memory. The batch before is delivered
        once this one's loop is queued (its decode ran beside it). A failure of this batch alone is recorded
        against its images and the job goes on."""
        oom, failure = False, None
        try:
            done = self.runner.run_batch(batch, fallback, upcoming)
        except torch.cuda.OutOfMemoryError:
            oom = True  # handled outside this block: the error's frames hold the batch's memory
        except BATCH_ERRORS as e:
            _raise_if_device(e)
            log.exception("batch %s failed", batch.key.label)
            failure = one_line(e, 200)
        if oom or failure is not None:
            # the batches before are delivered first (the sink sees them in order), and their decodes, retried if
            # they ran out of memory beside this batch, get what this batch's failure held (on an H100, decodes run
            # inside this block failed for memory its capture's frames still held: docs/PERFORMANCE.md, twenty-ninth
            # session)
            self.flush()
            if oom:
                return False
            self.sink.fail(batch.items, failure)
            return True
        self.deliver_ready()
        # what the decode raises (out of memory after the retries, a decode error) comes on delivery: the images fail
        self.pending.append((self.runner.start_decode(done), bucket_label(batch)))
        if not self.runner.overlap:
            self.flush()
        return True

    def flush(self) -> None:
        """Delivers every batch whose decode is in flight, in order (waits for them)."""
        while self.pending:
            self._deliver_first()

    def deliver_ready(self) -> None:
        """Delivers the batches whose decodes are done, in order, up to the first one still running, and the oldest
        while two are in flight. A decode beside a loop may outlast it: in the bench job on an H100 the 8 x 1024²
        batch's decode ran 3.46 s beside the next batch's 3.05 s loop, and waiting for it here left the GPU's UNet
        stream idle for 0.41 s before the loop after (docs/PERFORMANCE.md, twenty-eighth session)."""
        while self.pending and (len(self.pending) >= MAX_DECODES or self.runner.decoded(self.pending[0][0])):
            self._deliver_first()

    def _deliver_first(self) -> None:
        decoding, label = self.pending.popleft()
        self.deliver(self._finish(decoding, label), label)

    def _finish(self, decoding: Decoding, label: str) -> list[Decoded]:
        """The decode's images (`BatchRunner.finish`). A decode still out of memory after its own retry is tried once
        more after the engine gives back what it holds for speed (its graphs and their pool: captured again on use),
        and, still out of memory (another process on the GPU, memory too fragmented for the decoder's largest
        tensors), on the CPU (`BatchRunner.decode_on_host`): denoised images are not lost to their decode. Any other
        failure fails the batch's images."""
        try:
            return self.runner.finish(decoding)
        except torch.cuda.OutOfMemoryError:
            pass  # handled below, outside this block: the error's frames hold memory
        except BATCH_ERRORS as e:
            return self._failed(decoding, label, e)
        self.out_of_memory += 1
        self.runner.release()
        try:
            out = self.runner.finish(decoding)
            self.notes.append(f"out of GPU memory decoding {label}: decoded again after the graphs were freed")
            return out
        except torch.cuda.OutOfMemoryError:
            pass
        except BATCH_ERRORS as e:
            return self._failed(decoding, label, e)
        try:
            self.runner.decode_on_host(decoding)
            out = self.runner.finish(decoding)
        except BATCH_ERRORS as e:
            return self._failed(decoding, label, e)
        self.notes.append(f"out of GPU memory decoding {label}, with the graphs freed too: decoded on the CPU")
        return out

    def _failed(self, decoding: Decoding, label: str, e: BaseException) -> list[Decoded]:
        """The decode's images failed with `e` (a device's error stops the render instead)."""
        _raise_if_device(e)
        log.exception("decoding %s failed", label)
        self.sink.fail([item for item, _ in decoding.done], one_line(e, 200))
        return decoding.done.failed

    def _out_of_memory(self, batch: Batch, buckets: tuple[int, ...], fallback: bool) -> None:
        self.oom_at = min(self.oom_at, batch.size)
        self.out_of_memory += 1
        self.runner.release()
        smaller = _halved(buckets, batch.size)
        where = f"out of GPU memory at {batch.size} x {batch.key.label}"
        if batch.size > 1 and smaller:
            self.notes.append(f"{where}: retried in buckets of at most {max(smaller)}")
            self._split(batch, smaller, fallback)
        elif not fallback:
            self.notes.append(f"{where}: retried eager")
            self.process(batch, (1,), fallback=True)
        else:
            self.sink.fail(batch.items, "out of GPU memory even for one image")

    def _split(self, batch: Batch, buckets: tuple[int, ...], fallback: bool) -> None:
        for sub in make_batches(list(batch.items), buckets):
            self.process(sub, buckets, fallback)
