"""The streams a render's batches overlap on (run/batch.py): a batch's inputs (its prompts encoded, control images and
noise copied in) are made on `inputs` while the UNet's stream still denoises the batch before, and a batch's VAE
decode and its copy to the host run on `decode` while the next batch denoises. The UNet's stream (the current one)
runs the denoising loops alone, one after the other.

A copy from pageable host memory waits for its whole stream: on the UNet's stream it would wait for the batch before
to finish denoising, so the inputs have a stream of their own. A tensor made on one stream and read on another is
handed over (`hand_over`): the caching allocator keeps its memory until the reading stream's work queued so far is
done. On the CPU there are no streams: every lane is the caller's, and the timers read the host clock.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext

import torch


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

    def decode(self):
        """Work on the decode stream, after what the UNet's stream has queued so far (the batch's denoising)."""
        if not self.cuda:
            return nullcontext()
        self._decode.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._decode)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy in host memory; on a GPU, pinned and not waited for (wait for a Timer after it)."""
        if not self.cuda:
            return t.cpu()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host


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
