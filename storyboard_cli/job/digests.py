"""Fingerprints of the files an image depends on, without torch.

- A control image by its bytes (sha256): a redrawn pose guide re-renders its shots, a moved project
  folder does not.
- Model weights given as a path by file size + mtime + the sha256 of each weight file's first MiB
  (a safetensors file's header and tensor index): replaced weights re-render, and a 7 GB checkpoint
  is not read in full on every `bcg plan`. Presets and hub ids are identified by their name.

Both are cached per (path, size, mtime), so asking again for an unchanged file costs one stat.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HEAD_BYTES = 1 << 20  # a safetensors header + index fits in it (a full SDXL UNet's is ~200 KB)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth")
SHORT = 16  # hex digits kept in the settings: enough to tell files apart, short enough to read

_CACHE: dict[tuple[str, str, int, int], str] = {}  # (kind, resolved path, size, mtime_ns) -> hex


def _key(kind: str, path: Path) -> tuple[str, str, int, int]:
    st = path.stat()
    return kind, str(path.resolve()), st.st_size, st.st_mtime_ns


def remember_sha256(path: Path, data: bytes) -> str:
    """The sha256 of `data`, read from `path` by the caller (who decodes it too), cached for the path."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        _CACHE[_key("sha256", path)] = digest
    except OSError:
        pass
    return digest


def file_sha256(path: Path) -> str:
    """sha256 of the whole file. Raises OSError."""
    key = _key("sha256", path)
    if key not in _CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _CACHE[key] = h.hexdigest()
    return _CACHE[key]


def _head_sha256(path: Path) -> str:
    key = _key("head", path)
    if key not in _CACHE:
        with open(path, "rb") as f:
            _CACHE[key] = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    return _CACHE[key]


def weights_path(spec: str | None) -> Path | None:
    """The file or folder a model spec names, or None for a preset, a hub id or nothing on disk."""
    if not spec:
        return None
    path = Path(spec).expanduser()  # as models/loader.py reads a path
    return path if path.exists() else None


def weights_digest(spec: str | None) -> str | None:
    """One short hex digest of every weight file under a model path (size, mtime, first MiB), or None
    where the spec is not a path (presets and hub ids: the name is the identity)."""
    root = weights_path(spec)
    if root is None:
        return None
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.suffix.lower() in WEIGHT_SUFFIXES and p.is_file())
    parts = []
    for f in files:
        try:
            st = f.stat()
            parts.append([f.relative_to(root).as_posix() if f != root else f.name, st.st_size, st.st_mtime_ns,
                          _head_sha256(f)])
        except OSError as e:
            parts.append([f.name, f"unreadable: {e.strerror}"])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:SHORT]


def relative_to_job(path: Path, job_dir: Path) -> str:
    """`path` as seen from the job file's folder (`control/pose.png`, `../shared/pose.png`)."""
    try:
        return Path(os.path.relpath(path, job_dir)).as_posix()
    except ValueError:  # another drive (Windows): there is no relative path
        return path.as_posix()
