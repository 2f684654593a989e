"""How a render stops: Ctrl-C, SIGTERM, SIGHUP.

- First Ctrl-C: says at once what will happen (an event; the CLI prints it), then the render stops at
  the next batch boundary, or right after loading or capture when it comes during those.
- Second Ctrl-C: stops now (KeyboardInterrupt); of the images handed to the writer, those whose PNG is being
  written land with their manifest line, the others are dropped.
- SIGTERM / SIGHUP (docker stop, an eviction, a preemption, `timeout`, a closed ssh session): stop now,
  without waiting for the batch: `Stopped` is raised from the handler, between two Python bytecodes
  of the denoising loop (so after the running kernel, well within a second); the batch in flight is
  dropped and rendered next time, the images already decoded are written. Exit status 128 + signal.

Either way the render then writes what is finished, the manifest and a partial report, and releases
the folder's lock. Once stopping, further signals only mark the stop (a second Ctrl-C still forces).

A handler runs between two bytecodes of whatever Python runs, a library's own called from C or Rust included, and
some of those swallow what it raises and raise an error of their own: the render ends on the stop all the same
(`StopFlag.cause`).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SOFT_STOP = "stopping after this batch; Ctrl-C again to stop now"


class Stopped(BaseException):
    """Raised from a signal handler: not an Exception, so no `except Exception` of a batch swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopFlag:
    def __init__(self, on_request: Callable[[str], None] | None = None):
        self.signum: int | None = None  # the first stop signal received
        self.on_request = on_request or (lambda message: None)
        self.finishing = False  # writing the report: signals are recorded, never raised
        self.hard = False  # stopping at once (an exception is on its way up)
        self.announcing = False  # the first Ctrl-C's message is being written (Python handlers nest)
        self.deferred: int | None = None  # a signal that came meanwhile
        self.raised: BaseException | None = None  # what the handler raised into the running code (once at most)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handler(self, signum, frame) -> None:
        if self.announcing:  # a signal while the first Ctrl-C's message is written: acted on once it is out
            self.deferred = self.deferred or signum
            return
        if signum == signal.SIGINT and self.signum is None:
            self.signum = signum
            self.announcing = True
            try:
                self.on_request(SOFT_STOP)
            finally:
                self.announcing = False
            if self.deferred is not None:
                signum, self.deferred = self.deferred, None
                self.handler(signum, frame)
            return
        if self.hard or self.finishing:  # already stopping at once, or writing the report: let it finish
            self.signum = self.signum or signum
            return
        self.hard = True
        if signum == signal.SIGINT:
            self.raised = KeyboardInterrupt()
        else:
            self.signum, self.raised = signum, Stopped(signum)
        raise self.raised

    def cause(self, e: BaseException) -> BaseException:
        """What a render that raised `e` ends on: the stop the handler raised, where the code it landed in turned it
        into an error of its own (a SIGTERM in safetensors' read of a file came up as "ValueError: could not
        determine the shape of object type 'torch.storage.UntypedStorage'", which diffusers made an OSError and the
        loader a ModelError); else `e`."""
        return self.raised if self.raised is not None and not isinstance(e, (Stopped, KeyboardInterrupt)) else e

    def check(self) -> None:
        """At a boundary (a batch, the end of loading or capture): stops if asked to."""
        if self.signum is not None:
            raise Stopped(self.signum)


@contextmanager
def stop_signals(on_request: Callable[[str], None] | None = None):
    """Installs the handlers for the block (main thread only; elsewhere the flag is never set)."""
    flag = StopFlag(on_request)
    old = {}
    try:
        for sig in STOP_SIGNALS:
            old[sig] = signal.signal(sig, flag.handler)
    except ValueError:  # not the main thread: no signal handling
        pass
    try:
        yield flag
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
