"""The output folder's lock: one render per folder, held by the kernel.

`fcntl.flock` on `<out>/.bcg.lock`: the kernel releases it when its process dies (kill -9, a killed
container), so there is no stale lock to take over and no check-then-unlink race. The pid, host and
start time written into the file are for the message only; nothing decides on them (pids repeat
across containers and get reused).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from storyboard_cli.errors import OutputLocked, folder_error
from storyboard_cli.folder.layout import LOCK

# `held()` takes a shared lock for a moment: a render that finds the lock taken tries again for this
# long before it refuses, so a probe (the contact sheet's) never makes it give up; a render holds it
# for its whole run
PROBE_GRACE_S, PROBE_POLL_S = 0.5, 0.005


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _flock_within(fd: int, seconds: float) -> None:
    """An exclusive flock on `fd`, retried for `seconds`; raises BlockingIOError if it stays taken."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(PROBE_POLL_S)


class OutputLock:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for _ in range(100):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                if self._take(fd):
                    break
            else:
                raise OutputLocked(f"{self.folder}: could not take the lock {self.path}")
            self._stamp()
        except OSError as e:
            self.__exit__()
            raise folder_error(self.folder, e) from None
        return self

    def _take(self, fd: int) -> bool:
        """Locks `fd`; False when the file was replaced meanwhile (retry with the new one)."""
        try:
            _flock_within(fd, PROBE_GRACE_S)
        except BlockingIOError:
            holder = os.read(fd, 512).decode("utf-8", "replace").split("\n")
            os.close(fd)
            who = f" ({holder[0]})" if holder[0] else ""
            raise OutputLocked(f"{self.folder}: another render{who} is writing here; wait for it to finish") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder unlinked it between our open and our lock: lock the new file
            os.close(fd)
            return False
        self.fd = fd
        return True

    def _stamp(self) -> None:
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(self.fd, 0)
        _write_all(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode())

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        # unlink while still holding it: a process that opened the old file sees the inode change in _take
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def held(folder: Path) -> bool:
    """Whether a live render holds `folder`'s lock (a lock file left by a killed process is not held)."""
    try:
        fd = os.open(Path(folder) / LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the probe's own shared lock
    return False
