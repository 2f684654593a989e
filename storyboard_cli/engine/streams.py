"""The streams a render's batches overlap on (run/batch.py): a batch's inputs (its prompts encoded, its control images
embedded, its noise copied in) are made on `inputs` while the UNet's stream still denoises the batch before, and a
batch's VAE decode and its copy to the host run on `decode` while the next batch denoises. The UNet's stream (the
current one) runs the denoising loops alone, one after the other.

The decode is queued from a host thread of its own (`on_decode`). The thread that queues a loop's replays is held in
the last ones until the GPU is about one replay from the loop's end (the launch queue is full), so a decode queued
after them from that thread began only when the loop had ended, and the next batch's inputs and loop waited for it
(docs/PERFORMANCE.md, issue 41: the trace of 2026-12-02). A replay releases the GIL: the decode thread queues the
decode while the next batch's inputs are made, checked and replayed.

The next batch's prompts are encoded on the inputs' stream (`aside`) between the first replays of the loop before it,
one prompt after each replay, from the thread that queues them: the GPU runs them beside those replays, and the host's
time for them is hidden behind the replays already queued. From a thread of their own they were not: their launches
waited behind the full launch queue, and 1.07 of their 22.7 s stayed exposed (docs/PERFORMANCE.md, seventh session).
The rest of that batch's inputs (its kinds' tensors, noise, first latents and guidance) are made the same way, after
its prompts (run/batch.py `inputs_ahead`), and its own run_batch makes the UNet's stream wait for them: the loops no
longer wait for inputs made after the loop before was queued (docs/PERFORMANCE.md, twenty-sixth session).

A copy from pageable host memory waits for its whole stream: on the UNet's stream it would wait for the batch before
to finish denoising, so the inputs have a stream of their own. A tensor made on one stream and read on another is
handed over (`hand_over`): the caching allocator keeps its memory until the reading stream's work queued so far is
done. On the CPU there are no streams: every lane is the caller's, and the timers read the host clock.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Timer:
    """Seconds between two points of one stream's work (CUDA events), or of the host's (the CPU: its work is done
    when the call returns)."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.host = time.perf_counter()
        if self.event is not None:
            self.event.record()

    def seconds_to(self, end: Timer) -> float:
        """Seconds from this point to `end` (both reached: after `end.wait()`). Points on two streams may be in
        either order: a negative result means `end` came first."""
        if self.event is None:
            return end.host - self.host
        return self.event.elapsed_time(end.event) / 1000

    def wait(self) -> None:
        """Blocks the host until the stream has reached this point."""
        if self.event is not None:
            self.event.synchronize()

    def reached(self) -> bool:
        return self.event is None or self.event.query()


class Lanes:
    """The render's streams on one device: the caller's (the UNet's), `inputs`, `decode`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._inputs = torch.cuda.Stream(device) if self.cuda else None
        self._decode = torch.cuda.Stream(device) if self.cuda else None
        self._thread: ThreadPoolExecutor | None = None  # the decode's, made at the first decode

    def timer(self) -> Timer:
        """A point in the current stream's work."""
        return Timer(self.cuda)

    @contextmanager
    def inputs(self, after_unet: bool = False):
        """Work on the inputs' stream; the UNet's stream waits for it at the end. `after_unet`: the inputs read
        something the UNet's stream wrote just before (the text encoders' weights after a LoRA swap)."""
        if not self.cuda:
            yield
            return
        unet = torch.cuda.current_stream()
        if after_unet:
            self._inputs.wait_stream(unet)
        with torch.cuda.stream(self._inputs):
            yield
        unet.wait_stream(self._inputs)

    def on_decode(self, work: Callable[[], T], here: bool = False) -> Future[T]:
        """`work` on the decode stream, after what the UNet's stream has queued so far (the batch's denoising), queued
        from the decode thread: this returns at once, and the Future holds what `work` returned or raised. `here`: queued
        from this thread (a retry). On the CPU it runs here, and the Future is done when this returns."""
        done: Future[T] = Future()
        if not self.cuda:
            _settle(done, work)
            return done
        after = torch.cuda.Event()
        after.record()  # on the UNet's stream, after the batch's loop

        def queue() -> None:
            with torch.cuda.device(self._decode.device), torch.cuda.stream(self._decode), torch.no_grad():
                self._decode.wait_event(after)
                _settle(done, work)

        if here:
            queue()
        else:
            self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="bcg-decode")
            self._thread.submit(queue)
        return done

    @contextmanager
    def aside(self):
        """Work on the inputs' stream that nothing waits for here (the next batch's prompts, encoded while this batch
        denoises): that batch's inputs, made on the same stream after it, read what it made; the UNet's stream waits
        for them then (`inputs`). On the CPU, the caller's."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self._inputs):
            yield

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy in host memory; on a GPU, pinned and not waited for (wait for a Timer after it)."""
        if not self.cuda:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host


def _settle(done: Future, work: Callable[[], T]) -> None:
    try:
        done.set_result(work())
    except Exception as e:  # noqa: BLE001 - the caller's to handle, where it waits for the result
        done.set_exception(e)


def hand_over(value, stream: torch.cuda.Stream | None = None) -> None:
    """Marks every CUDA tensor in `value` (a tensor, a dataclass of them, a list or tuple) as used by `stream` (the
    current one when None), so that its memory is not reused while that stream's work queued so far runs."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream or torch.cuda.current_stream(value.device))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            hand_over(getattr(value, f.name), stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            hand_over(v, stream)
