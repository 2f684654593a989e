"""Checks that `plan` and `render` run before anything is loaded: can the output folder be written, does
the model path exist. Torch-free and quick: one line and exit 2 instead of a traceback minutes later."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from storyboard_cli.errors import BadInput, ModelError, did_you_mean, folder_error

PRESETS = ("tiny", "sdxl-random")  # the names models/loader.py builds itself


def check_destination(folder: Path) -> None:
    """The output folder is a folder (or can become one) that this process may write."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"output folder {folder}: exists and is not a folder")
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise folder_error(folder, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise folder_error(folder, OSError(errno.EACCES, f"{existing} is not writable"))


def free_bytes(folder: Path) -> int | None:
    """Free space where `folder` is (or would be created); None when it cannot be told."""
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def check_model_path(spec: str | None, field: str) -> None:
    """A model given as a path must exist; presets and hub ids are checked when they load."""
    if spec is None or spec in PRESETS:
        return
    path = Path(spec).expanduser()
    pathlike = spec.startswith((".", "/", "~")) or spec.endswith((".safetensors", ".ckpt"))
    if pathlike and not path.exists():
        raise ModelError(f"{field}: no such file or folder: {spec}")
    hint = did_you_mean(spec.lower(), PRESETS) if "/" not in spec and not path.exists() else ""
    if hint:  # `Tiny`: not a hub id (owner/name) nor a path, a preset misspelt
        raise ModelError(f"{field}: unknown model {spec!r}{hint}")
