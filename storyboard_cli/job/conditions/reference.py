"""The IP-Adapter reference kind: the job's `ip_adapter:` and `image_encoder:` (a preset, a folder in the
h94/IP-Adapter layout, or a weights file with its encoder; confined as the model is and held against the job's model
before any model loads), its `characters:` (named bundles of a reference image and LoRAs that shots use by name), a
shot's `characters: [...]` and its one-off `reference:` (at most REFERENCE_SLOTS, their LoRAs merged with the shot's),
and all an image records of them. No torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from storyboard_cli.errors import did_you_mean
from storyboard_cli.job.digests import SHORT
from storyboard_cli.job.files import LoraFile, check_image, lora_scales
from storyboard_cli.job.kind import Guide, Quiet, ShotSource, Unit, Weights, entries, number
from storyboard_cli.job.preflight import ADAPTER_PRESETS, job_spec
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_str, check_keys, line_of,
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


@dataclass(frozen=True, kw_only=True)
class JobPart:
    ip_adapter: str | None = None
    image_encoder: str | None = None
    characters: dict[str, Character] = dataclasses.field(default_factory=dict)  # the top-level `characters:`, by name


@dataclass(frozen=True, kw_only=True)
class ShotPart:
    references: tuple[Reference, ...] = ()  # its characters' in the order it names them, then its `reference:`
    characters: tuple[str, ...] = ()  # names in Job.characters


@dataclass(frozen=True, kw_only=True)
class ItemPart:
    references: tuple[Reference, ...] = ()
    reference_scale: float = 0.0  # the adapter's one scale for the row: its references' largest (0: none)
    ip_adapter: str | None = None  # the job's, where the item has references
    image_encoder: str | None = None  # the job's `image_encoder:`, where the item has references and it is given


@dataclass(frozen=True, kw_only=True)
class KeyPart:
    """Nothing: rows with and without references share a batch (and a graph: a row's empty slots are masked)."""


@dataclass(frozen=True, kw_only=True)
class SummaryPart:
    references: int = 0  # distinct reference images (by sha256): each encoded once
    characters: tuple[str, ...] = ()  # the characters the shots use, in order of first use
    reference_note: str | None = None  # about shots whose references' scales differ (reference_note)


ONE_OFF = "reference"  # the sheet's caption of a shot's own `reference:` (a character's reads its name)
REFERENCE = "reference"  # a reference's word on the sheet


class References(Quiet):
    """The kind's row (job/kind.py's `Kind`)."""

    name = "reference"
    job_keys = ("ip_adapter", "image_encoder", "characters")
    shot_keys = ("characters", "reference")
    settings_keys = ("references", "reference_scale", "ip_adapter_weights", "image_encoder_weights")
    manifest_keys = ("references",)
    report_keys = ("characters", "references")
    names = ("Reference", "Character", "REFERENCE_SLOTS")
    shown = 0  # a shot's references before its guides
    # the adapter's attention runs in every UNet step, with its own kernels: a job without references loads a plain UNet
    kept_unused = False
    JobPart, ShotPart, ItemPart, KeyPart, SummaryPart = JobPart, ShotPart, ItemPart, KeyPart, SummaryPart

    # ------------------------------------------------------------ the YAML

    def resolve_job(self, ctx: Context, doc: Located, model: str, job_dir: Path, loras: dict) -> dict:
        ip_adapter, image_encoder = resolve_adapter(ctx, doc, model)
        raw, line = doc.get("characters"), line_of(doc, "characters")
        characters = resolve_characters(ctx, raw, line, job_dir, loras, ip_adapter)
        return {"ip_adapter": ip_adapter, "image_encoder": image_encoder, "characters": characters}

    def resolve_shot(self, ctx: Context, src: ShotSource) -> tuple[dict, dict[str, float]]:
        names, names_line = src.get("characters")
        names, references = shot_references(ctx, names, names_line, *src.get("reference"), src.shot_id, src.job_dir,
                                            src.job.characters, src.job.ip_adapter)
        scales = with_character_loras(ctx, src.lora_scales, src.lora_raw, src.lora_line, src.prompt_line, names,
                                      names_line, src.shot_id, src.job.characters)
        return {"references": references, "characters": names}, scales

    def job_files(self, doc: dict) -> list:
        characters = doc.get("characters")
        if not isinstance(characters, dict):
            return []
        return [reference_image(c.get("reference")) for c in characters.values() if isinstance(c, dict)]

    def shot_files(self, key: str, value: Any) -> list:
        return [reference_image(value)] if key == "reference" else []

    # ------------------------------------------------------------ images and batches

    def item(self, shot: Any, job: Any) -> dict:
        refs = shot.references
        return {"references": refs, "reference_scale": max((r.scale for r in refs), default=0.0),
                "ip_adapter": job.ip_adapter if refs else None, "image_encoder": job.image_encoder if refs else None}

    def identity(self, item: Any) -> tuple:
        return tuple((r.sha256, r.scale) for r in item.references)

    # ------------------------------------------------------------ what an image records

    def settings(self, item: Any, weights: Weights) -> dict:
        s: dict = {}
        if item.references:
            s.update(adapter_settings(item.ip_adapter, item.image_encoder, weights))
            s["references"] = [{"file": r.file, "sha256": r.sha256[:SHORT], "scale": r.scale}
                               | ({"character": r.character} if r.character else {}) for r in item.references]
            s["reference_scale"] = item.reference_scale
        return s

    def unplaced(self, settings: dict) -> None:
        for entry in settings.get("references", ()):
            entry.pop("file")

    def units(self, settings: dict) -> list[Unit]:
        """One IP-Adapter unit per reference (module `ip-adapter-auto`, which picks the image encoder from the
        model), each at the scale the adapter applied (one per image: the references' largest)."""
        return [("ip-adapter-auto", settings["ip_adapter"], settings["reference_scale"], 1.0)
                for _ in settings.get("references", ())]

    def models(self, job: Any) -> list[tuple[str, str | None]]:
        return [("ip_adapter", job.ip_adapter), ("image_encoder", job.image_encoder)]

    def needs(self, job: Any) -> bool:
        return job.ip_adapter is not None

    def loaded(self, models: Any, job: Any) -> bool:
        """Whether loaded models (models/loader.py's SdxlModels) hold an IP-Adapter."""
        return models.ip_adapter is not None

    def mix(self, job: Any) -> tuple[list, list]:
        """Its models in the service's mix key, after the rest (as the key always read)."""
        return [], [job.ip_adapter, job.image_encoder]

    def used_models(self, job: Any, items: list) -> tuple:
        """(the adapter, its encoder) where an item has a reference (its own or a region's), else (None, None):
        nothing loads."""
        used = any(i.references or any(r.references for r in i.regions) for i in items)  # a region's too
        return (job.ip_adapter, job.image_encoder) if used else (None, None)

    # ------------------------------------------------------------ the report, the sheet, `bcg plan`

    def report(self, job: Any) -> dict:
        """`characters` (each with its reference: file, sha256, scale, and the shots that name it) and one-off
        `references` (one entry per image and scale, with the shots that use it); each None where the job has
        none."""
        characters = [{"name": c.name, "file": c.reference.file, "sha256": c.reference.sha256[:SHORT],
                       "scale": c.reference.scale, "shots": [s.id for s in job.shots if c.name in s.characters]}
                      for c in job.characters.values()]
        one_off: dict[tuple[str, str, float], list[str]] = {}  # (file, sha256, scale) -> the shots
        for s in job.shots:
            for r in s.references:
                if r.character is None:
                    one_off.setdefault((r.file, r.sha256[:SHORT], r.scale), []).append(s.id)
        references = [{"file": file, "sha256": sha256, "scale": scale, "shots": shots}
                      for (file, sha256, scale), shots in one_off.items()]
        return {"characters": characters or None, "references": references or None}

    def report_md(self, r: dict) -> list[str]:
        """The references (the characters', then the one-off ones), as a table."""
        refs = ([(c["name"], c) for c in r.get("characters") or ()]
                + [("(one-off)", x) for x in r.get("references") or ()])
        if not refs:
            return []
        out = ["", "## References", "", "| character | file | sha256 | scale | shots |", "|---|---|---|---:|---|"]
        return out + [f"| {name} | {x['file']} | `{x['sha256']}` | {x['scale']:g} | {', '.join(x['shots'])} |"
                      for name, x in refs]

    def guides(self, shot: Any) -> list[Guide]:
        """Its references in the order it names them, its one-off last."""
        return [Guide(REFERENCE, r.image, r.character or ONE_OFF, r.scale, file=r.file) for r in shot.references]

    def meta_guides(self, meta: dict, at: Callable[[str], Path]) -> list[Guide]:
        return [Guide(REFERENCE, at(r["file"]), str(r.get("character") or ONE_OFF), number(r.get("scale"), 0.0),
                      file=r["file"]) for r in entries(meta.get("references"), "file")]

    def summary(self, job: Any) -> dict:
        """What `bcg plan` says of the references: distinct images (each encoded once), the characters used in order
        of first use, and a note on shots whose references ask for different scales."""
        return {"references": len({r.sha256 for s in job.shots for r in (*s.references, *(x for g in s.regions
                                                                                        for x in g.references))}),
                "characters": tuple(dict.fromkeys(c for s in job.shots for c in s.characters)),
                "reference_note": reference_note(job)}

    def notes(self, summary: Any) -> list[str]:
        return [summary.reference_note] if summary.reference_note else []

    def plan_json(self, job: Any, summary: Any) -> tuple[dict, dict]:
        if job.ip_adapter is None:
            return {}, {}
        return {}, {"ip_adapter": job.ip_adapter, "image_encoder": job.image_encoder, "references": summary.references,
                "characters": list(summary.characters)}


KIND = References()


def adapter_settings(ip_adapter: str, image_encoder: str | None, weights: Weights) -> dict:
    """The IP-Adapter an image's references go through, as its settings record it (and its weights' digests)."""
    s: dict = {"ip_adapter": ip_adapter}
    weights(s, "ip_adapter_weights", ip_adapter)
    if image_encoder is not None:
        s["image_encoder"] = image_encoder
        weights(s, "image_encoder_weights", image_encoder)
    return s


def reference_note(job: Any) -> str | None:
    """A note, once, on shots whose references ask for different scales: the adapter applies one scale to an image's
    references (diffusers' one scale per adapter), their largest."""
    shots = [f"{s.id} ({', '.join(f'{r.character or Path(r.file).name} {r.scale:g}' for r in s.references)})"
             for s in job.shots if len({r.scale for r in s.references}) > 1]
    if not shots:
        return None
    listed = ", ".join(shots[:5]) + (f" and {len(shots) - 5} more" if len(shots) > 5 else "")
    return f"references at different scales in one shot: {listed}; each image gets their largest"


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
                    ip_adapter: str | None, prefix: str = "") -> tuple[tuple[str, ...], tuple[Reference, ...]]:
    """A shot's `characters: [name, ...]` and `reference:`: (the characters, their references in the order the
    shot names them, then the one-off). `prefix`: where the keys are (a region's: `regions[0].`)."""
    if names is None:
        names = []
    elif isinstance(names, str):
        names = [names]
    elif not isinstance(names, list):
        raise ctx.fail(names_line, shot_id, f"{prefix}characters", f"must be a list of character names, like [mei], "
                       f"got {type_name(names)}")
    if names and ip_adapter is None:
        raise ctx.fail(names_line, shot_id, f"{prefix}characters", NO_ADAPTER)
    if one_off is not None and ip_adapter is None:
        raise ctx.fail(one_off_line, shot_id, f"{prefix}reference", NO_ADAPTER)
    for i, name in enumerate(names):
        if not isinstance(name, str) or name not in characters:
            known = (f"the job's characters: {clip(', '.join(characters))}" if characters
                     else "the job has no top-level 'characters:'")
            raise ctx.fail(names_line, shot_id, f"{prefix}characters", f"unknown character {short_repr(name)} ({known})"
                           f"{did_you_mean(str(name), characters)}")
        if name in names[:i]:
            raise ctx.fail(names_line, shot_id, f"{prefix}characters", f"'{name}' is named twice")
    references = [characters[n].reference for n in names]
    if one_off is not None:
        references.append(resolve_reference(ctx, one_off, one_off_line, shot_id, f"{prefix}reference", job_dir))
    if len(references) > REFERENCE_SLOTS:
        raise ctx.fail(names_line if names else one_off_line, shot_id, f"{prefix}characters", f"{len(references)} "
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


# ---------------------------------------------------------------- the job's IP-Adapter

def resolve_adapter(ctx: Context, doc: Located, model: str) -> tuple[str | None, str | None]:
    """(ip_adapter, image_encoder) as the job gives them (None: not given); `model` as the loader opens it
    (preflight.job_spec). Each problem is named at its own field."""
    specs, lines = {}, {}
    for key in ("ip_adapter", "image_encoder"):
        raw, lines[key] = doc.get(key), line_of(doc, key)
        specs[key] = None if raw is None else as_str(ctx, raw, lines[key], None, key, empty_ok=False)
        ctx.model_spec(specs[key], lines[key], key)
    adapter, encoder = specs["ip_adapter"], specs["image_encoder"]
    if adapter is None:
        if encoder is not None:
            raise ctx.fail(lines["image_encoder"], None, "image_encoder", "the job sets no top-level 'ip_adapter' "
                                                                          "for it to serve")
        return None, None
    if encoder is not None:
        if adapter in ADAPTER_PRESETS:
            raise ctx.fail(lines["image_encoder"], None, "image_encoder", f"the preset ip_adapter '{adapter}' "
                           f"brings its own image encoder; leave image_encoder out")
        problem = _encoder_problem(job_spec(encoder, ctx.folder), clip(encoder), job_spec(adapter, ctx.folder))
        if problem:
            raise ctx.fail(lines["image_encoder"], None, "image_encoder", problem)
    problem = _adapter_problem(job_spec(adapter, ctx.folder), job_spec(encoder, ctx.folder), model)
    if problem:
        raise ctx.fail(lines["ip_adapter"], None, "ip_adapter", problem)
    return adapter, encoder


def _encoder_problem(encoder: str, shown: str, adapter: str) -> str | None:
    """What keeps the encoder `image_encoder:` names from serving the adapter (its folder, its width), or None."""
    from storyboard_cli.job.adapter_files import encoder_problem, given_encoder_problem

    return encoder_problem(encoder, shown) or given_encoder_problem(adapter, encoder)


def _adapter_problem(adapter: str, encoder: str | None, model: str) -> str | None:
    """What keeps the adapter from serving the model (its files, their layout, its widths), or None."""
    from storyboard_cli.job.adapter_files import adapter_problem

    return adapter_problem(adapter, encoder, model)
