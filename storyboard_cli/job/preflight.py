"""Checks that `plan` and `render` run before anything is loaded: can the output folder be written, does
the model path exist. Torch-free and quick: one line and exit 2 instead of a traceback minutes later."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from storyboard_cli.errors import BadInput, ModelError, did_you_mean, folder_error
from storyboard_cli.job.yaml_loader import clip, short_repr

PRESETS = ("tiny", "sdxl-random")  # the names models/loader.py builds itself
# `owner/name`, as huggingface_hub's validate_repo_id takes a repo id (1-96 of [A-Za-z0-9_.-] a part, no
# '--' or '..', not ending '.git'), with the owner required: a bare name or a URL is no hub id
HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}\w)?/\w(?:[\w.-]{0,94}\w)?", re.ASCII)
HUB_ID_RULE = "a hub id (owner/name)"


def check_destination(folder: Path) -> None:
    """The output folder is a folder (or can become one) that this process may write."""
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise BadInput(f"output folder {folder}: exists and is not a folder")
    except OSError as e:  # a name too long for the file system
        raise folder_error(folder, e) from None
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


def is_hub_id(spec: str) -> bool:
    return HUB_ID.fullmatch(spec) is not None and ".." not in spec and "--" not in spec and not spec.endswith(".git")


def is_pathlike(spec: str) -> bool:
    """A model spec written as a path (what models/loader.py reads from disk even when nothing is there)."""
    return spec.startswith((".", "/", "~")) or spec.endswith((".safetensors", ".ckpt"))


def expanded(spec: str) -> Path | None:
    """A path as written in a job, `~` expanded; None where `~user` names no user of this machine."""
    try:
        return Path(spec).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory"
        return None


def exists(path: Path | None) -> bool:
    """Whether a path names something, False for a name the file system refuses (too long, a loop)."""
    try:
        return path is not None and path.exists()
    except OSError:
        return False


def check_model_path(spec: str | None, field: str) -> None:
    """A model given as a path must exist; anything else must be a preset or look like a hub id (owner/name):
    whether the hub has it is found when it loads."""
    if spec is None or spec in PRESETS:
        return
    if exists(expanded(spec)):
        return
    if is_pathlike(spec):
        raise ModelError(f"{field}: no such file or folder: {clip(spec)}")
    if is_hub_id(spec):
        return
    hint = did_you_mean(spec.lower(), PRESETS) if "/" not in spec else ""
    if hint:  # `Tiny`: a preset misspelt
        raise ModelError(f"{field}: unknown model {short_repr(spec)}{hint}")
    raise ModelError(f"{field}: {short_repr(spec)} is not a preset ({', '.join(PRESETS)}), a path or {HUB_ID_RULE}")
