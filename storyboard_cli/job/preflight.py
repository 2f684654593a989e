"""Checks that `plan` and `render` run before anything is loaded: can the output folder be written, does
the model path exist. Torch-free and quick: one line and exit 2 instead of a traceback minutes later."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

from storyboard_cli.errors import BadInput, ModelError, did_you_mean, folder_error
from storyboard_cli.job.yaml_loader import clip, short_repr

PRESETS = ("tiny", "sdxl-random")  # the models (and ControlNets) models/loader.py builds itself
# the IP-Adapters models/ip_adapter.py builds itself, and their kind ("base": the image embedding, "plus": the
# Resampler on the encoder's hidden states): `ip_adapter:`'s presets, read by the job, the loader and the service
ADAPTER_PRESETS = {"tiny": "base", "tiny-plus": "plus", "sdxl-random": "base", "sdxl-random-plus": "plus"}
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
    existing = _existing(folder)
    if existing.exists() and not existing.is_dir():
        raise folder_error(folder, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    why = unwritable(existing)
    if why is not None:
        raise folder_error(folder, OSError(errno.EACCES, why))


def unwritable(folder: Path) -> str | None:
    """Why this process cannot write into `folder` (or the nearest folder above it that exists): read-only, or not
    permitted; None when it can."""
    existing = _existing(folder)
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{existing} is on a read-only file system" if read_only else f"{existing} is not writable"


def free_bytes(folder: Path) -> int | None:
    """Free space where `folder` is (or would be created); None when it cannot be told."""
    try:
        return shutil.disk_usage(_existing(folder)).free
    except OSError:
        return None


def _existing(folder: Path) -> Path:
    """`folder`, or the nearest folder above it that exists (where it would be created)."""
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return existing


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


def presets_of(field: str) -> tuple[str, ...]:
    """The preset names a model field takes (`ip_adapter` its adapters', `image_encoder` none, the rest the models')."""
    return {"ip_adapter": tuple(ADAPTER_PRESETS), "image_encoder": ()}.get(field, PRESETS)


def job_spec(spec: str | None, folder: Path) -> str | None:
    """A model field's value as the loaders open it: a relative path is read from the job file's `folder` (as its
    control images, references and LoRAs are); presets, hub ids, absolute paths and `~` stay as written, as does a
    relative path found only from the working folder (the reading of older versions, `cwd_only`)."""
    if spec is None or spec in PRESETS or spec in ADAPTER_PRESETS:
        return spec
    path = expanded(spec)
    if path is None or path.is_absolute() or not exists(folder / path):
        return spec
    return str(folder / path)


def cwd_only(spec: str | None, folder: Path) -> bool:
    """Whether a relative path names something from the working folder and nothing from the job file's folder."""
    path = None if spec is None or spec in PRESETS or spec in ADAPTER_PRESETS else expanded(spec)
    return (path is not None and not path.is_absolute() and not exists(folder / path) and exists(path)
            and (folder / path).resolve() != path.resolve())


def model_problem(spec: str | None, field: str) -> str | None:
    """Why a model field's value (as `job_spec` gives it) names no model, in one line without the field, or None. A path
    must exist; anything else must be a preset of its field (`presets_of`) or look like a hub id (owner/name): whether
    the hub has it is found when it loads."""
    presets = presets_of(field.split(".")[0])
    if spec is None or spec in presets or exists(expanded(spec)):
        return None
    if spec.lower().startswith("file:"):
        return f"{short_repr(spec)} is a URL; give the path itself ({clip(unquote(urlparse(spec).path))})"
    if is_pathlike(spec):
        return f"no such file or folder: {clip(spec)}"
    if is_hub_id(spec):
        return None
    hint = did_you_mean(spec.lower(), presets) if "/" not in spec else ""
    if hint:  # `Tiny`: a preset misspelt
        return f"unknown model {short_repr(spec)}{hint}"
    preset = f"a preset ({', '.join(presets)}), " if presets else ""
    return f"{short_repr(spec)} is not {preset}a path or {HUB_ID_RULE}"


def check_model_path(spec: str | None, field: str) -> None:
    """`model_problem` as a ModelError naming the field (exit 2), for a caller without the job file's lines."""
    problem = model_problem(spec, field)
    if problem:
        raise ModelError(f"{field}: {problem}")
