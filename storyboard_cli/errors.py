"""The domain errors and every exit code, and the wording helpers their messages share. Library code
raises these; cli.py exits with the codes here."""

from __future__ import annotations

import difflib
import errno
from pathlib import Path
from typing import Iterable


class StoryboardError(Exception):
    """Base of every error a user can act on. `exit_code` is what the CLI exits with."""

    exit_code = 1


class BadInput(StoryboardError):
    """The job, a path, or an option is wrong. Nothing was rendered because of it."""

    exit_code = 2


class JobError(BadInput):
    """A job-file error, located at file:line, shot and field."""

    def __init__(self, file: str, line: int | None, shot: str | None, field: str | None, message: str):
        self.file, self.line, self.shot, self.field, self.message = file, line, shot, field, message
        where = f"{file}:{line}" if line else file
        parts = [where]
        if shot is not None:
            parts.append(f"shot '{shot}'")
        if field is not None:
            parts.append(f"field '{field}'")
        # one line, always: it is printed as one (a shot id or a mapping key may hold a newline too)
        super().__init__(" ".join(": ".join([" ".join(parts), str(message)]).splitlines()))


class ModelError(StoryboardError):
    """A model could not be found or loaded."""

    exit_code = 2


class DeviceUnusable(StoryboardError):
    """The device cannot be used here: no CUDA device, a broken driver, a CUDA error mid-render. A fault of this
    machine, not of the job: the render service gives such a lease back (its images keep their attempts) as a
    strike against the worker."""

    exit_code = 2


class OwnDiskUnusable(DeviceUnusable):
    """A render service's worker cannot write its own copies of job folders (its --root full, read-only, gone): a
    fault of this machine as DeviceUnusable is, its models still good."""


class RenderFailure(StoryboardError):
    """The render itself broke (not the input)."""

    exit_code = 1


class OutputUnwritable(StoryboardError):
    """The output folder stopped taking writes mid-render: its disk full (`DiskFull`), read-only (remounted so after
    an I/O error, an NFS export turned read-only) or no longer permitted; what was written before is kept. `path`:
    the file that could not be written."""

    exit_code = 2

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class DiskFull(OutputUnwritable):
    """The output disk (or its quota) filled up mid-render."""


class OutputLocked(BadInput):
    """Another live render holds the output folder."""


class Interrupted(StoryboardError):
    """The user stopped the render (Ctrl-C); what was finished is kept."""

    exit_code = 128 + 2  # as a shell reports a process ended by SIGINT


class Status:
    """A render's status, as its report and result carry it (plain strings: they go into JSON), and the
    CLI's exit code for each. "error" never finishes a render: it raises."""

    DONE, FAILED, INTERRUPTED, ERROR = "done", "failed", "interrupted", "error"
    EXIT_CODES = {DONE: 0, FAILED: 3, INTERRUPTED: Interrupted.exit_code}
    ORDER = (DONE, FAILED, INTERRUPTED)  # better to worse

    @classmethod
    def worst(cls, statuses: Iterable[str]) -> str:
        """The status of a render made of several (the workers of a multi-GPU render): the worst of
        theirs; a status that is none of ORDER (a worker's error) counts as interrupted."""
        worst = max(statuses, key=lambda s: cls.ORDER.index(s) if s in cls.ORDER else len(cls.ORDER))
        return worst if worst in cls.ORDER else cls.INTERRUPTED


def exit_code(status: str, signum: int | None = None) -> int:
    """The exit code of a finished render: a render stopped by a signal exits 128 + that signal."""
    if status == Status.INTERRUPTED and signum:
        return 128 + signum
    return Status.EXIT_CODES[status]


# ---------------------------------------------------------------- wording shared by the messages


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's text (cut to `limit` characters); "" when it has none."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else ""


def one_line(e: BaseException, limit: int | None = None) -> str:
    """An exception as one line: `OSError: its first line`, the class name alone when it has no text."""
    text = first_line(e, limit)
    return f"{e.__class__.__name__}: {text}" if text else e.__class__.__name__


def plural(n: int, word: str) -> str:
    """"1 image", "2 images", "0 images"."""
    return f"{n} {word}{'s' * (n != 1)}"


def did_you_mean(word: str, choices: Iterable[str], known: bool = False) -> str:
    """"; did you mean 'seed'?" for the closest of `choices`, else "" (with `known`: the list of them)."""
    choices = list(choices)
    hint = difflib.get_close_matches(word, choices, n=1)
    if hint:
        return f"; did you mean '{hint[0]}'?"
    return f"; known: {', '.join(choices)}" if known else ""


def write_error(path: Path, e: OSError) -> StoryboardError:
    """An OSError writing an output file: a full disk, or a folder read-only or not permitted (exit 2, as a bad
    destination), or a failed render."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"disk full: cannot write {path} ({e.strerror or e}); free some space and run again", path)
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputUnwritable(f"cannot write {path} ({e.strerror or e}); make its folder writable and run again",
                                path)
    return RenderFailure(f"cannot write {path}: {e.strerror or e}")


def folder_error(path: Path, e: OSError) -> BadInput:
    """An OSError about the output folder as the one line a person can act on."""
    reason = e.strerror or str(e)
    if e.errno == errno.ENOTDIR:
        reason = "a part of this path is a file, not a folder"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = f"cannot write here ({reason})"
    return BadInput(f"output folder {path}: {reason}")
