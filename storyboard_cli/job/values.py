"""The job file's values checked where they are read: `Context` (the file being read, its errors located at
file:line, shot and field; the files it names, confined to the service's folders and read through its blob store)
and the checks of keys, types and ranges. No torch."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from storyboard_cli.errors import BadInput, JobError, did_you_mean
from storyboard_cli.job.digests import file_sha256, relative_to_job
from storyboard_cli.job.inputs import INPUTS_KEY, InputProblem, Inputs, shown_name, suffix_of
from storyboard_cli.job.preflight import ADAPTER_PRESETS, PRESETS, cwd_only, exists, expanded, is_pathlike, job_spec
from storyboard_cli.job.yaml_loader import SHOT_ID, Located, clip, short_repr

SAFE_NAME = SHOT_ID
SAFE_NAME_RULE = "must be 1-64 letters, digits, '_', '-' or '.', starting with a letter or digit"


class Context:
    """Where we are in the file, to build located errors."""

    def __init__(self, file: str, roots: tuple[Path, ...] | None = None, inputs: Inputs | None = None):
        self.file = file
        self.images_checked: set[Path] = set()  # control images decoded once per job, however many shots use them
        self.roots = None if roots is None else tuple(Path(r).resolve() for r in roots)
        self.inputs = inputs
        self.warnings: list[str] = []  # said once each, as errors are located: Job.warnings
        self.folder = Path(file).resolve().parent  # the job file's: what its relative paths are read from
        self.lines: dict[str, int | None] = {}  # the model fields' lines (model, controlnets.pose, ...): Job.lines

    def warn(self, line: int | None, shot: str | None, field: str | None, message: str) -> None:
        text = str(JobError(self.file, line, shot, field, message))
        if text not in self.warnings:
            self.warnings.append(text)

    def fail(self, line: int | None, shot: str | None, field: str | None, message: str) -> JobError:
        return JobError(self.file, line, shot, field, message)

    def refuse_home(self, text: str, line: int | None, shot: str | None, field: str) -> None:
        """With roots (the render service), a path from `~` names a home folder of the server's users: refused as
        outside its folders, in the same words whether that user exists or not (an answer must not tell which
        users the server has), and before anything is read."""
        if self.roots is not None and text.startswith("~"):
            raise self.fail(line, shot, field, f"{clip(text)} is outside the folders this server may read and write")

    def confine(self, path: Path, line: int | None, shot: str | None, field: str, shown: str | None = None) -> None:
        """With roots (the render service), a file the job names, symlinks followed, must lie under one."""
        if self.roots is not None and not any(path.resolve().is_relative_to(r) for r in self.roots):
            raise self.fail(line, shot, field, f"{shown or path} is outside the folders this server may read and write")

    def input_file(self, rel: str, job_dir: Path, line: int | None, shot: str | None, field: str,
                   is_file: bool = True) -> tuple[Path, str]:
        """A file the job names: (the file to read, the name the outputs record). Named in the job's inputs
        (by sha256), it is read from the blob store; else it is a path from the job's folder, confined on the
        service and there copied into the blob store before anything reads it."""
        inputs, fail, name = self.inputs, (lambda why: self.fail(line, shot, field, why)), clip(rel)
        digest = inputs.digests.get(rel) if inputs is not None else None
        blobs = inputs is not None and inputs.blob is not None
        by_digest = digest is not None and blobs  # read from the blob store: `rel` is only the name it records
        if not by_digest:
            self.refuse_home(rel, line, shot, field)
        local = Path(rel) if by_digest else expanded(rel)
        if local is None:
            raise fail(f"{name}: {clip(rel.split('/')[0])} names no user of this machine")
        path = (job_dir / local).resolve()
        if not by_digest:
            self.confine(path, line, shot, field, name)
            if not (path.is_file() if is_file else path.exists()):
                raise fail(f"file not found: {name}")
        if blobs:
            try:
                if digest is None:
                    if inputs.adopt is None:
                        raise fail(f"{name} is not among the job's uploaded inputs")
                    digest = inputs.adopt(path)
                inputs.used[rel] = digest
                return inputs.blob(digest, suffix_of(rel)), shown_name(rel, job_dir)
            except (InputProblem, BadInput) as e:
                raise fail(f"{name}: {e}") from None
        if digest is not None and file_sha256(path) != digest:
            raise fail(f"{name} changed since its sha256 was recorded in '{INPUTS_KEY}:' ({digest[:12]}...)")
        return path, relative_to_job(path, job_dir)

    def model_spec(self, spec: str | None, line: int | None, field: str) -> None:
        """A model field's value checked where it is read: confined on the service (`confine_model`), and said once
        where a relative path is found only from the working folder (read from there, as older versions did)."""
        self.lines[field] = line
        self.confine_model(spec, line, field)
        if cwd_only(spec, self.folder):
            self.warn(line, None, field, f"{clip(spec)} is not in the job file's folder ({clip(str(self.folder))}) "
                      f"but in the working folder, where it is read from; relative paths in a job are read from the "
                      f"job file's folder: write it from there or as an absolute path")

    def confine_model(self, spec: str | None, line: int | None, field: str) -> None:
        """A model named by a local path (as the loader reads it: from the job file's folder, job_spec) is confined
        too; presets and hub ids are not files of this machine."""
        if self.roots is None or spec is None or spec in PRESETS or spec in ADAPTER_PRESETS:
            return
        self.refuse_home(spec, line, None, field)
        path = expanded(job_spec(spec, self.folder))
        if path is None:  # `~user` of no user here: no folder of this server's either
            raise self.fail(line, None, field, f"{clip(spec)} is outside the folders this server may read and write")
        if is_pathlike(spec) or exists(path):
            self.confine(path, line, None, field, clip(spec))


def line_of(mapping: Any, key: str, fallback: int | None = None) -> int | None:
    if isinstance(mapping, Located):
        return mapping.lines.get(key, mapping.line)
    return fallback


def check_keys(ctx: Context, mapping: Located, allowed: tuple[str, ...], shot: str | None, prefix: str = "") -> None:
    for key in mapping:
        if key in allowed:
            continue
        line = mapping.lines.get(key, mapping.line)
        raise ctx.fail(line, shot, clip(f"{prefix}{key}"), f"unknown key{did_you_mean(str(key), allowed, known=True)}")


# what a YAML value is, in words: the types PyYAML's safe loader makes (timestamps as dates, !!binary as bytes)
TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
              type(None): "nothing", bytes: "binary data", datetime.date: "a date",
              datetime.datetime: "a date and time", set: "a set"}


def type_name(value: Any) -> str:
    return TYPE_NAMES.get(type(value), "a mapping" if isinstance(value, dict) else f"a {type(value).__name__}")


def given(value: Any) -> str:
    """What a job gave, in plain words for a message's "got ...": "nothing", "binary data (5 bytes)", "a date
    (2024-01-02)", "a string ('x')"."""
    if value is None:
        return "nothing"
    if isinstance(value, bytes):
        return f"binary data ({len(value)} bytes)"
    return f"{type_name(value)} ({short_repr(value)})"


def sub_mapping(ctx: Context, raw: Any, line: int | None, shot: str, field: str, allowed: tuple[str, ...],
                like: str, required: str, meaning: str) -> Located | None:
    """A shot's optional mapping `field: {...}` (`off`, `false` or nothing: None), its keys checked and `required`
    present (`meaning` says what it is, in the message when it is missing)."""
    if raw is None or raw is False:
        return None
    if not isinstance(raw, Located):
        raise ctx.fail(line, shot, field, f"must be a mapping like {like}, or off; got {given(raw)}")
    check_keys(ctx, raw, allowed, shot, prefix=f"{field}.")
    if required not in raw:
        raise ctx.fail(raw.line, shot, f"{field}.{required}", f"missing ({meaning})")
    return raw


def as_int(ctx: Context, value: Any, line: int | None, shot: str | None, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.fail(line, shot, field, f"must be an integer, got {given(value)}")
    if not lo <= value <= hi:
        raise ctx.fail(line, shot, field, f"must be between {lo} and {hi}, got {short_repr(value)}")
    return value


def as_float(ctx: Context, value: Any, line: int | None, shot: str | None, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ctx.fail(line, shot, field, f"must be a number, got {given(value)}")
    value = float(value)
    if not lo <= value <= hi:  # also rejects NaN
        raise ctx.fail(line, shot, field, f"must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def unicode_text(value: str) -> str | None:
    """`value` as Unicode text: a surrogate pair that a JSON escape left split (`"\\ud83d\\ude0d"`) joined; None when
    a lone surrogate remains (no file, path or PNG chunk can hold it)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        try:
            return value.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            return None


def as_str(ctx: Context, value: Any, line: int | None, shot: str | None, field: str, *, empty_ok: bool) -> str:
    if not isinstance(value, str):
        raise ctx.fail(line, shot, field, f"must be a string, got {given(value)}")
    text = unicode_text(value)
    if text is None:
        raise ctx.fail(line, shot, field, "must be Unicode text (it holds a lone UTF-16 surrogate)")
    value = text
    if not empty_ok and not value.strip():
        raise ctx.fail(line, shot, field, "must not be empty")
    if "\x00" in value:
        raise ctx.fail(line, shot, field, "must not contain NUL characters")
    return value
