"""The IP-Adapter reference kind: a job's image references, for its IP-Adapter (job/adapter.py): the top-level `characters:` (named bundles of a
reference image and LoRAs that shots use by name), a shot's `characters: [...]` and its one-off `reference:`.
No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyboard_cli.errors import did_you_mean
from storyboard_cli.job.references import LoraFile, check_image, lora_scales
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, check_keys, line_of,
                                       type_name)
from storyboard_cli.job.yaml_loader import Located, clip, short_repr

REFERENCE_SLOTS = 4  # references one shot may use (the models stage holds as many image embeddings per row)
REFERENCE_SCALE = (0.0, 2.0)
REFERENCE_KEYS = ("image", "scale")
CHARACTER_KEYS = ("reference", "scale", "lora")
NO_ADAPTER = "the job sets no top-level 'ip_adapter' model"
# what a render does with a reference (a very large one's warning): models/ip_adapter.py encodes it through diffusers'
# CLIPImageProcessor at the encoder's image_size (224 for h94's encoders): short side resized, centre cropped
REFERENCE_USE = ("the IP-Adapter's image encoder sees it at 224x224 (its short side resized to 224, its centre "
                 "cropped), so its extra pixels add nothing")


@dataclass(frozen=True)
class Reference:
    """One image an IP-Adapter conditions a shot's images on."""

    image: Path  # absolute, resolved like a control image (Context.input_file)
    file: str  # as seen from the job file's folder: what the outputs record
    scale: float  # 0..2
    sha256: str  # full hex sha256 of the image's bytes
    character: str | None = None  # the character it comes from; None: a shot's one-off `reference:`


@dataclass(frozen=True)
class Character:
    """One entry of the job's `characters:`: what a shot that names it gets."""

    name: str
    reference: Reference
    loras: tuple[tuple[str, float], ...]  # (name in Job.loras, scale) sorted by name, zeros kept (they merge too)
    line: int


def resolve_reference(ctx: Context, raw: Any, line: int | None, shot_id: str | None, field: str, job_dir: Path,
                      character: str | None = None, scale: float = 1.0) -> Reference:
    """A reference at `field`: an image's path, or `{image: PATH, scale: S}` (S, else `scale`)."""
    if isinstance(raw, Located):
        check_keys(ctx, raw, REFERENCE_KEYS, shot_id, prefix=f"{field}.")
        if "image" not in raw:
            raise ctx.fail(raw.line, shot_id, f"{field}.image", "missing")
        if "scale" in raw:
            scale = as_float(ctx, raw["scale"], line_of(raw, "scale"), shot_id, f"{field}.scale", *REFERENCE_SCALE)
        image, image_line, image_field = raw["image"], line_of(raw, "image"), f"{field}.image"
    elif isinstance(raw, str):
        image, image_line, image_field = raw, line, field
    else:
        raise ctx.fail(line, shot_id, field, f"must be an image's path or a mapping like {{image: refs/mei.png, "
                       f"scale: 0.6}}, got {type_name(raw)}")
    path, shown, sha256 = check_image(ctx, image, image_line, shot_id, image_field, job_dir, REFERENCE_USE)
    return Reference(path, shown, scale, sha256, character)


def resolve_characters(ctx: Context, raw: Any, line: int | None, job_dir: Path, loras: dict[str, LoraFile],
                       ip_adapter: str | None) -> dict[str, Character]:
    """The top-level `characters: {name: {reference: PATH, scale: S, lora: {name: scale}}}`."""
    if raw is None:
        return {}
    if not isinstance(raw, Located):
        raise ctx.fail(line, None, "characters", f"must be a mapping of name: {{reference: ..., scale: ..., lora: "
                       f"...}}, got {type_name(raw)}")
    if raw and ip_adapter is None:
        raise ctx.fail(line, None, "characters", NO_ADAPTER)
    out = {}
    for name, entry in raw.items():
        at = line_of(raw, name, line)
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ctx.fail(at, None, clip(f"characters.{name}"), f"a character name {SAFE_NAME_RULE}")
        field = f"characters.{name}"
        if not isinstance(entry, Located):
            raise ctx.fail(at, None, field, f"must be a mapping like {{reference: refs/{name}.png, scale: 0.6}}, "
                           f"got {type_name(entry)}")
        check_keys(ctx, entry, CHARACTER_KEYS, None, prefix=f"{field}.")
        if entry.get("reference") is None:
            raise ctx.fail(entry.line, None, f"{field}.reference", "missing (the image the character is drawn "
                                                                   "after)")
        scale = 1.0
        if "scale" in entry:
            if isinstance(entry["reference"], Located) and "scale" in entry["reference"]:
                raise ctx.fail(line_of(entry, "scale"), None, f"{field}.scale", f"given twice (also in "
                               f"{field}.reference); give it once")
            scale = as_float(ctx, entry["scale"], line_of(entry, "scale"), None, f"{field}.scale", *REFERENCE_SCALE)
        reference = resolve_reference(ctx, entry["reference"], line_of(entry, "reference"), None,
                                      f"{field}.reference", job_dir, name, scale)
        scales = lora_scales(ctx, entry.get("lora"), line_of(entry, "lora"), None, f"{field}.lora", loras)
        out[name] = Character(name, reference, tuple(sorted(scales.items())), at or entry.line)
    return out


def shot_references(ctx: Context, names: Any, names_line: int | None, one_off: Any, one_off_line: int | None,
                    shot_id: str, job_dir: Path, characters: dict[str, Character],
                    ip_adapter: str | None) -> tuple[tuple[str, ...], tuple[Reference, ...]]:
    """A shot's `characters: [name, ...]` and `reference:`: (the characters, their references in the order the
    shot names them, then the one-off)."""
    if names is None:
        names = []
    elif isinstance(names, str):
        names = [names]
    elif not isinstance(names, list):
        raise ctx.fail(names_line, shot_id, "characters", f"must be a list of character names, like [mei], got "
                       f"{type_name(names)}")
    if names and ip_adapter is None:
        raise ctx.fail(names_line, shot_id, "characters", NO_ADAPTER)
    if one_off is not None and ip_adapter is None:
        raise ctx.fail(one_off_line, shot_id, "reference", NO_ADAPTER)
    for i, name in enumerate(names):
        if not isinstance(name, str) or name not in characters:
            known = (f"the job's characters: {clip(', '.join(characters))}" if characters
                     else "the job has no top-level 'characters:'")
            raise ctx.fail(names_line, shot_id, "characters", f"unknown character {short_repr(name)} ({known})"
                           f"{did_you_mean(str(name), characters)}")
        if name in names[:i]:
            raise ctx.fail(names_line, shot_id, "characters", f"'{name}' is named twice")
    references = [characters[n].reference for n in names]
    if one_off is not None:
        references.append(resolve_reference(ctx, one_off, one_off_line, shot_id, "reference", job_dir))
    if len(references) > REFERENCE_SLOTS:
        raise ctx.fail(names_line if names else one_off_line, shot_id, "characters", f"{len(references)} "
                       f"references (its characters' and its 'reference:'); a shot may use at most {REFERENCE_SLOTS}")
    return tuple(names), tuple(references)


def with_character_loras(ctx: Context, scales: dict[str, float], lora_raw: Any, lora_line: int | None,
                         prompt_line: int | None, names: tuple[str, ...], names_line: int | None, shot_id: str,
                         characters: dict[str, Character]) -> dict[str, float]:
    """The shot's LoRAs (`scales`: its `lora:` mapping `lora_raw` and its prompt's `<lora:...>` tags) and those of
    the characters it names, merged; the same LoRA at two scales is an error naming both places."""
    merged = dict(scales)
    given = {name: f"the shot's 'lora:' (line {lora_line})" if isinstance(lora_raw, dict) and name in lora_raw
             else f"a <lora:...> tag in the shot's prompt (line {prompt_line})" for name in scales}
    for c in (characters[n] for n in names):
        for lora, scale in c.loras:
            if merged.get(lora, scale) != scale:
                raise ctx.fail(names_line, shot_id, "characters", f"LoRA '{lora}' at {scale:g} from character "
                               f"'{c.name}' (line {c.line}) and at {merged[lora]:g} from {given[lora]}; give it one "
                               f"scale")
            merged[lora] = scale
            given.setdefault(lora, f"character '{c.name}' (line {c.line})")
    return merged


def reference_image(raw: Any) -> Any:
    """The image a `reference:` names (a path, or a mapping's `image`), unvalidated: job/file.py's `named_files`."""
    return raw.get("image") if isinstance(raw, dict) else raw
