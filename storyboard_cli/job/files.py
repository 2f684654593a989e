"""The files a job names, checked as it loads: its LoRA files (the top-level `loras:`, each read and held against the
job's model; a shot's `lora:` and its prompt's `<lora:name:scale>` tags), the images it names (every pixel decoded,
the bytes hashed: `check_image`, for the conditioning kinds' images, job/conditions/) and the files it names by
sha256 (`inputs:`). No torch."""

from __future__ import annotations

import io
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyboard_cli.errors import JobError, did_you_mean, one_line
from storyboard_cli.job.digests import file_sha256, remember_sha256
from storyboard_cli.job.inputs import DIGEST_RULE, INPUTS_KEY, Inputs, is_digest
from storyboard_cli.job.lora_files import SCALE_RANGE, inspect_lora, lora_problem, split_lora_tags
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_str, line_of, type_name,
                                       unicode_text)
from storyboard_cli.job.yaml_loader import MESSAGE_VALUE, Located, clip, short_repr


@dataclass(frozen=True)
class LoraFile:
    """One entry of the job's `loras:`, checked (format, architecture) and hashed at load time."""

    name: str
    path: Path  # absolute, resolved against the job file's folder
    file: str  # as seen from the job file's folder: what the outputs record
    sha256: str  # of the tensor bytes (A1111's addnet hash): a changed file re-renders its shots
    shorthash: str  # what A1111 writes in `Lora hashes`
    text_encoders: bool  # whether it changes the prompt embeddings



def _known_lora(ctx: Context, name: Any, line: int | None, shot_id: str, field: str, loras: dict[str, LoraFile]) -> str:
    if isinstance(name, str) and name in loras:
        return name
    if not loras:
        raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)}: the job has no top-level 'loras:' "
                       f"(name: file.safetensors)")
    raise ctx.fail(line, shot_id, field, f"unknown LoRA {short_repr(name)} (the job's loras: {clip(', '.join(loras))})"
                   f"{did_you_mean(str(name), loras)}")


def lora_scales(ctx: Context, raw: Any, line: int | None, shot_id: str | None, field: str,
                loras: dict[str, LoraFile]) -> dict[str, float]:
    """A `lora:` mapping of LoRA name: scale (a shot's, a character's), zero scales kept."""
    lo, hi = SCALE_RANGE
    scales: dict[str, float] = {}
    if raw is None:
        return scales
    if not isinstance(raw, dict):
        raise ctx.fail(line, shot_id, field, f"must be a mapping of LoRA name: scale, like {{mei: 0.8}}, "
                       f"got {type_name(raw)}")
    for name, scale in raw.items():
        name_line = line_of(raw, name, line)
        name = _known_lora(ctx, name, name_line, shot_id, field, loras)
        scales[name] = as_float(ctx, scale, name_line, shot_id, f"{field}.{name}", lo, hi)
    return scales


def shot_loras(ctx: Context, prompt: str, prompt_line: int | None, raw: Any, line: int | None, shot_id: str,
                loras: dict[str, LoraFile]) -> tuple[str, dict[str, float]]:
    """The shot's `lora:` mapping and the prompt's A1111 `<lora:name:scale>` tags, merged: (the prompt
    without its tags, {name: scale}, zero scales kept: `lora_set` leaves them out). Both ways give the same
    image."""
    lo, hi = SCALE_RANGE
    scales = lora_scales(ctx, raw, line, shot_id, "lora", loras)
    try:
        text, tags = split_lora_tags(prompt)
    except ValueError as e:  # it quotes the tag, which may be most of a long prompt
        raise ctx.fail(prompt_line, shot_id, "prompt", clip(str(e), 2 * MESSAGE_VALUE)) from None
    for name, scale in tags:
        tag = f"<lora:{name}:{scale:g}>"
        _known_lora(ctx, name, prompt_line, shot_id, "prompt", loras)
        if not lo <= scale <= hi:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag}: the weight must be between {lo:g} and {hi:g}")
        if scales.get(name, scale) != scale:
            raise ctx.fail(prompt_line, shot_id, "prompt", f"{tag} disagrees with the scale {scales[name]:g} "
                           f"given for '{name}' (in 'lora:' or another tag); give it once")
        scales[name] = scale
    if tags and not text.strip():
        raise ctx.fail(prompt_line, shot_id, "prompt", "nothing is left once its <lora:...> tags are removed")
    return text, scales


def lora_set(scales: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """((name, scale), ...) sorted by name, zero scales left out: a shot's LoRA set (Shot.loras)."""
    return tuple(sorted((n, s) for n, s in scales.items() if s != 0))


def resolve_loras(ctx: Context, raw: Any, line: int | None, job_dir: Path, model: str) -> dict[str, LoraFile]:
    """The top-level `loras: {name: file.safetensors}`: every file read (header and hash, no torch) and
    checked against the job's model, so `bcg plan` finds a bad one before any model loads."""
    if raw is None:
        return {}
    if not isinstance(raw, Located):
        raise ctx.fail(line, None, "loras", f"must be a mapping of name: file.safetensors, got {type_name(raw)}")
    out = {}
    for name, rel in raw.items():
        name_line = line_of(raw, name, line)
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ctx.fail(name_line, None, f"loras.{name}", f"a LoRA name {SAFE_NAME_RULE}")
        field_name = f"loras.{name}"
        rel = as_str(ctx, rel, name_line, None, field_name, empty_ok=False)
        path, shown = ctx.input_file(rel, job_dir, name_line, None, field_name, is_file=False)
        problem = lora_problem(path, model)
        if problem:
            raise ctx.fail(name_line, None, field_name, problem.replace(path.name, Path(shown).name))
        info = inspect_lora(path)
        out[name] = LoraFile(name, path, shown, info.hash, info.shorthash, info.text_encoders)
    return out


def declared_inputs(ctx: Context, raw: Any, line: int | None) -> None:
    """The job's `inputs: {name as the job writes it: sha256}` (what `bcg submit` uploaded), added to what the
    caller knows; the caller's digest wins where both name a file."""
    if raw is None:
        return
    if not isinstance(raw, Located):
        raise ctx.fail(line, None, INPUTS_KEY, f"must be a mapping of file name: sha256, got {type_name(raw)}")
    if ctx.inputs is None:
        ctx.inputs = Inputs()
    for name, digest in raw.items():
        name_line = line_of(raw, name, line)
        if not isinstance(name, str) or not name.strip() or unicode_text(name) is None:
            raise ctx.fail(name_line, None, INPUTS_KEY, "each key must be a file name as the job writes it")
        name = unicode_text(name)
        if not is_digest(digest):
            raise ctx.fail(name_line, None, f"{INPUTS_KEY}.{name[:80]}", f"must be {DIGEST_RULE}")
        ctx.inputs.digests.setdefault(name, digest)


def check_image(ctx: Context, raw: Any, line: int | None, shot_id: str | None, field: str, job_dir: Path,
                use: str) -> tuple[Path, str, str]:
    """An image the job names (a control image, a reference) at `field`: (the file to read, the name the outputs
    record, the sha256 of its bytes). Every pixel is decoded, once per job however many shots use it; `use` says what
    a render does with it (the warning about a very large file quotes it)."""
    rel = as_str(ctx, raw, line, shot_id, field, empty_ok=False)
    path, shown = ctx.input_file(rel, job_dir, line, shot_id, field)
    if path not in ctx.images_checked:
        _decode_image(ctx, path, line, shot_id, shown, field, use)
        ctx.images_checked.add(path)
    try:
        return path, shown, file_sha256(path)  # cached by _decode_image: no second read
    except OSError as e:
        raise ctx.fail(line, shot_id, field, f"not a readable image: {shown} ({e.strerror or e})") from None


def _decode_image(ctx: Context, path: Path, line: int | None, shot_id: str | None, shown: str, field: str,
                  use: str) -> None:
    """Decodes every pixel, so a truncated file or a broken PNG stream fails here, before any model loads,
    not in the middle of a render; the bytes read are hashed for the skip check on the way."""
    from PIL import Image, UnidentifiedImageError

    def bad(why: str) -> JobError:
        return ctx.fail(line, shot_id, field, f"not a readable image: {shown} ({why})")

    try:
        data = path.read_bytes()
    except OSError as e:
        raise bad(e.strerror or e.__class__.__name__) from None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                pixels = im.width * im.height
        if any(issubclass(w.category, Image.DecompressionBombWarning) for w in caught):
            # said once, in our words (the process ignores PIL's own warning: cli.main)
            ctx.warn(line, shot_id, field, f"{shown} is {pixels / 1e6:.0f} megapixels: {use}; a smaller file "
                     f"loads faster")
    except Image.DecompressionBombError as e:
        raise bad(f"too many pixels: {e}") from None
    except UnidentifiedImageError:
        raise bad("empty file" if not data else "not a PNG, JPEG, WebP or other image file this can read") from None
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error) as e:
        raise bad(one_line(e, 120)) from None
    remember_sha256(path, data)
