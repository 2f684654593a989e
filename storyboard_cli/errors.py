"""The domain errors and every exit code. Library code raises these; cli.py exits with the codes here."""

from __future__ import annotations


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
        message = " ".join(str(message).splitlines())  # one line, always: it is printed as one
        super().__init__(": ".join([" ".join(parts), message]))


class ModelError(StoryboardError):
    """A model could not be found or loaded."""

    exit_code = 2


class RenderFailure(StoryboardError):
    """The render itself broke (not the input)."""

    exit_code = 1


class OutputLocked(BadInput):
    """Another live render holds the output folder."""


class Interrupted(StoryboardError):
    """The user stopped the render (Ctrl-C); what was finished is kept."""

    exit_code = 128 + 2  # as a shell reports a process ended by SIGINT


# A finished render's status -> the CLI's exit code ("error" never finishes: it raises).
STATUS_EXIT_CODES = {"done": 0, "failed": 3, "interrupted": Interrupted.exit_code}


def exit_code(status: str, signum: int | None = None) -> int:
    """The exit code of a finished render: a render stopped by a signal exits 128 + that signal."""
    if status == "interrupted" and signum:
        return 128 + signum
    return STATUS_EXIT_CODES[status]
