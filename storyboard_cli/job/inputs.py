"""How the files a job names (control images, LoRA files) are opened. No torch.

On one machine (`bcg plan`, `bcg render`) a name is a path, relative to the job file's folder. A job may also
carry a top-level `inputs:` mapping, each name as the job writes it to the sha256 of its file's bytes:
`bcg submit` adds it when it uploads the files, so the render service (and its workers, on other machines)
open each file by its digest in a blob store and never a path a client chose. Locally, `inputs:` is a promise
that is checked: a file whose bytes changed since is an error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from storyboard_cli.job.preflight import expanded

INPUTS_KEY = "inputs"
DIGEST = re.compile(r"[0-9a-f]{64}")
DIGEST_RULE = "a sha256: 64 lowercase hex digits"
SUFFIX = re.compile(r"\.[a-z0-9]{1,16}")


def is_digest(text: object) -> bool:
    return isinstance(text, str) and DIGEST.fullmatch(text) is not None


def suffix_of(name: str) -> str:
    """The file type a job's name for a file gives (`.safetensors`, `.png`): readers that check it (LoRA files
    must be .safetensors) see it on the blob too. "" when it is none we keep."""
    suffix = Path(name).suffix.lower()
    return suffix if SUFFIX.fullmatch(suffix) else ""


class InputProblem(Exception):
    """Why a named file cannot be had (the caller adds file:line, shot and field)."""


@dataclass
class Inputs:
    """The blob side of a job's files. `digests`: name as written in the job -> sha256 (what the server
    recorded; the job's own `inputs:` adds to it); `blob(digest, suffix)`: the local file holding a blob
    (raises InputProblem or BadInput when there is none); `adopt(path)`: a name that is a path of this machine
    (already confined by the caller) copied into the blob store, its digest (None: such paths are refused);
    `used`: every name the job resolved and its digest, filled while the job loads."""

    digests: dict[str, str] = field(default_factory=dict)
    blob: Callable[[str, str], Path] | None = None
    adopt: Callable[[Path], str] | None = None
    used: dict[str, str] = field(default_factory=dict)


def shown_name(rel: str, job_dir: Path) -> str:
    """The name the outputs record for a file: as the job writes it, relative to the job's folder
    (`control/pose.png`, `../shared/pose.png`), normalised but with no symlink followed."""
    path = expanded(rel) or Path(rel)
    if path.is_absolute():
        try:
            return Path(os.path.relpath(os.path.normpath(path), job_dir)).as_posix()
        except ValueError:  # another drive (Windows)
            return path.as_posix()
    return Path(os.path.normpath(path)).as_posix()
