"""The ControlNet guide kind: the job's nets (the top-level `controlnet: X`, one net named by convention
`SHORTHAND_NET`, or `controlnets: {name: X}`) and a shot's `control:` (one mapping, or a list of one guide per net: the
residuals are summed in the job's order of nets), and all an image records of them. The one net of the shorthand
keeps the settings, fingerprint and A1111 field it always had (`control_image`, ...); named nets are a `controls`
list. No torch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from storyboard_cli.errors import did_you_mean
from storyboard_cli.job.digests import SHORT, file_sha256
from storyboard_cli.job.files import check_image
from storyboard_cli.job.kind import Guide, Quiet, ShotSource, Unit, Weights, entries, number, sortable
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_str, check_keys, line_of,
                                       type_name)
from storyboard_cli.job.yaml_loader import Located, clip, short_repr
from storyboard_cli.steps import control_steps

SHORTHAND_NET = "controlnet"  # the one net of a job's `controlnet: X`
CONTROL_KEYS = ("image", "scale", "end", "net")
CONTROL_SCALE = (0.0, 2.0)
GUIDE_USE = "each shot resizes it to its own size"  # what a render does with a guide (a very large one's warning)
CONTROL = "control"  # a guide's word on the sheet
Nets = tuple[tuple[str, str], ...]  # ((name, model spec), ...) in file order: Job.controlnets


@dataclass(frozen=True)
class ShotControl:
    """One ControlNet a shot runs, from its `control:` (the tensors a batch is conditioned on are
    conditioning.Control)."""

    image: Path  # absolute, resolved against the job file's folder
    scale: float
    file: str = ""  # the image as seen from the job file's folder: what the outputs record
    end: float = 1.0  # the fraction of the steps the ControlNet runs, as diffusers' control_guidance_end
    net: str = SHORTHAND_NET  # a name in Job.controlnets
    model: str = ""  # that net's model spec, so the outputs record it without the job
    index: int = 0  # the net's place in Job.controlnets (BucketKey.nets)


@dataclass(frozen=True, kw_only=True)
class JobPart:
    controlnets: Nets = ()  # ((name, model spec), ...) in file order; `controlnet: X` is (("controlnet", X),)


@dataclass(frozen=True, kw_only=True)
class ShotPart:
    controls: tuple[ShotControl, ...] = ()  # every net it runs, in the job's net order (their residuals' sum's)


@dataclass(frozen=True, kw_only=True)
class ItemPart:
    controls: tuple[ShotControl, ...] = ()  # every net, in the job's order; each end 1.0 where it runs every step


@dataclass(frozen=True, kw_only=True)
class KeyPart:
    """A bucket key's nets: a batch's rows run the same nets (their guides are per row)."""

    control_end: float = 1.0  # the fraction of the steps the ControlNets run (a batch with control): the last's end
    nets: tuple[int, ...] = ()  # the nets the batch runs, sorted indices into Job.controlnets
    control_ends: tuple[float, ...] = ()  # one per entry of `nets` where they end at different fractions; else ()

    @property
    def control_mask(self) -> int:
        """Bit i set for net i of Job.controlnets."""
        return sum(1 << i for i in self.nets)


@dataclass(frozen=True, kw_only=True)
class SummaryPart:
    """Nothing beyond the bucket table: `bcg plan` shows each bucket's nets."""


def first_net(nets: Nets) -> str | None:
    """The first net's model spec (the shorthand's one net): what `bcg plan --json`'s `controlnet` and the service's mix
    key have always held."""
    return nets[0][1] if nets else None


def shorthand(controls: tuple[ShotControl, ...]) -> bool:
    """Whether an image's guides are the one net of the `controlnet:` shorthand (recorded in its own keys)."""
    return [c.net for c in controls] == [SHORTHAND_NET]


def _ran_end(steps: int, end: float) -> float:
    """A ControlNet's end as it applies: 1.0 where it runs every step."""
    return end if control_steps(steps, end) < steps else 1.0


class Control(Quiet):
    """The kind's row (job/conditions/__init__.py's `Kind`)."""

    name = "control"
    job_keys = ("controlnet", "controlnets")
    shot_keys = ("control",)
    settings_keys = ("controlnet", "control_image", "control_scale", "control_sha256", "controlnet_weights")
    manifest_keys = ()
    report_keys = ("controlnets",)
    names = ("ShotControl", "SHORTHAND_NET", "control_mask")
    shown = 1  # after the references
    kept_unused = True  # a net runs only for an image with a control image: the others run the UNet alone
    JobPart, ShotPart, ItemPart, KeyPart, SummaryPart = JobPart, ShotPart, ItemPart, KeyPart, SummaryPart

    # ------------------------------------------------------------ the YAML

    def resolve_job(self, ctx: Context, doc: Located, model: str, job_dir: Path, loras: dict) -> dict:
        return {"controlnets": resolve_nets(ctx, doc)}

    def resolve_shot(self, ctx: Context, src: ShotSource) -> tuple[dict, dict[str, float]]:
        controls = resolve_controls(ctx, *src.get("control"), src.shot_id, src.job_dir, src.job.controlnets)
        return {"controls": controls}, src.lora_scales

    def draft(self, shot: Any, end: float) -> dict:
        """A draft's nets end where its guidance does (or earlier, where the shot says so)."""
        return {"controls": tuple(replace(c, end=min(c.end, end)) for c in shot.controls)}

    def shot_files(self, key: str, value: Any) -> list:
        if key != "control":
            return []
        return [c.get("image") for c in (value if isinstance(value, list) else [value]) if isinstance(c, dict)]

    # ------------------------------------------------------------ images and batches

    def item(self, shot: Any, job: Any) -> dict:
        return {"controls": tuple(replace(c, end=_ran_end(shot.steps, c.end)) for c in shot.controls)}

    def identity(self, item: Any) -> tuple:
        return tuple((str(c.image), c.scale, c.end, c.net) for c in item.controls)

    def key(self, item: Any) -> dict:
        ends = tuple(c.end for c in item.controls)
        return {"nets": tuple(c.index for c in item.controls), "control_end": max(ends, default=1.0),
                "control_ends": ends if len(set(ends)) > 1 else ()}

    def side(self, key: Any) -> tuple[int, float]:
        """(the ControlNets a batch runs, where the last of them ends)."""
        return len(key.nets), key.control_end

    def side_ends(self, item: Any) -> list[float]:
        """Each net's end for an image (the service's work estimate counts each net's steps)."""
        return [c.end for c in item.controls]

    def shot_side(self, shot: Any) -> tuple[int, float]:
        """The same for a shot's images: its nets and where the last ends, as it applies."""
        return len(shot.controls), _ran_end(shot.steps, max((c.end for c in shot.controls), default=1.0))

    def label(self, key: Any) -> str:
        return f" +{len(key.nets)} controls" if len(key.nets) > 1 else " +control" if key.nets else ""

    # ------------------------------------------------------------ what an image records

    def settings(self, item: Any, weights: Weights) -> dict:
        """The shorthand's one net: the `control_*` keys it always had; named or several nets: a `controls` list."""
        s: dict = {}
        if shorthand(item.controls):
            c = item.controls[0]
            s.update(controlnet=c.model, control_image=c.file or str(c.image), control_scale=c.scale,
                     control_sha256=_content(c.image))
            weights(s, "controlnet_weights", c.model)
            if c.end < 1:
                s["control_end"] = c.end
        elif item.controls:
            s["controls"] = [_control_settings(c, weights) for c in item.controls]
        return s

    def unplaced(self, settings: dict) -> None:
        """Where the guides live does not decide the pixels: a moved project folder keeps its images."""
        settings.pop("control_image", None)
        for entry in settings.get("controls", ()):
            entry.pop("image")

    def units(self, settings: dict) -> list[Unit]:
        """One unit per net, in the job's order (the shorthand's one net too)."""
        one = {"controlnet": settings.get("controlnet"), "scale": settings.get("control_scale"),
               "end": settings.get("control_end", 1.0)}
        nets = settings.get("controls") or ([one] if "control_image" in settings else [])
        return [("none", n["controlnet"], n["scale"], n.get("end", 1.0)) for n in nets]

    def plain(self, settings: dict) -> str | None:
        """The shorthand's one net as the `ControlNet:` field it always was, where it is the image's only unit."""
        if "control_image" not in settings:
            return None
        end = settings.get("control_end", 1.0)
        end = f", end {end:.3g}" if end < 1 else ""
        return f"ControlNet: {Path(settings['control_image']).name} (scale {settings['control_scale']:g}{end})"

    def meta_side(self, meta: dict) -> tuple[bool, float]:
        """(whether an image's settings record a net, where the last ends) for the sheet's levers."""
        ends = [c.get("end", 1.0) for c in meta.get("controls") or () if isinstance(c, dict)]  # named nets: the last's
        end = max(ends, default=meta.get("control_end", 1.0), key=sortable)
        return bool(meta.get("control_image") or ends), end

    def models(self, job: Any) -> list[tuple[str, str | None]]:
        """(field, spec) of each net: `controlnet` for the shorthand's one, else `controlnets.<name>`."""
        return [(f"controlnets.{name}" if f"controlnets.{name}" in job.lines else "controlnet", spec)
                for name, spec in job.controlnets]

    def mix(self, job: Any) -> tuple[list, list]:
        """Its models in the service's mix key: the first net's (None without one) beside the model, the further nets'
        after the rest (as the key always read)."""
        specs = [spec for _, spec in job.controlnets]
        return [specs[0] if specs else None], [specs[1:]]

    def used_models(self, job: Any, items: list) -> tuple:
        """(the nets' specs,) where an item runs one, else ((),): the loader loads none."""
        return (tuple(spec for _, spec in job.controlnets) if any(i.controls for i in items) else (),)

    def needs(self, job: Any) -> bool:
        return bool(job.controlnets)

    def loaded(self, models: Any, job: Any) -> bool:
        """Whether loaded models (models/loader.py's SdxlModels) hold the job's nets."""
        return bool(models.controlnets)

    # ------------------------------------------------------------ the report, the sheet, `bcg plan`

    def report(self, job: Any) -> dict:
        """The named `controlnets` (name, model, shots); None for a `controlnet:` job's one net."""
        named = [n for n, _ in job.controlnets] != [SHORTHAND_NET]
        nets = [{"name": name, "model": model, "shots": [s.id for s in job.shots if any(c.net == name
                                                                                         for c in s.controls)]}
                for name, model in job.controlnets] if named else []
        return {"controlnets": nets or None}

    def report_md(self, r: dict) -> list[str]:
        if not r.get("controlnets"):
            return []
        out = ["", "## ControlNets", "", "| net | model | shots |", "|---|---|---|"]
        return out + [f"| {n['name']} | `{n['model']}` | {', '.join(n['shots'])} |" for n in r["controlnets"]]

    def guides(self, shot: Any) -> list[Guide]:
        """Its guides, in the job's net order."""
        return [Guide(CONTROL, c.image, c.net, c.scale, c.end, c.file or c.image.name) for c in shot.controls]

    def meta_guides(self, meta: dict, at: Callable[[str], Path]) -> list[Guide]:
        """The same from an image's settings: `controls`, or the shorthand's `control_image`."""
        controls = entries(meta.get("controls"), "image")
        if not controls and isinstance(meta.get("control_image"), str) and meta["control_image"]:
            controls = [{"net": SHORTHAND_NET, "image": meta["control_image"], "scale": meta.get("control_scale"),
                         "end": meta.get("control_end")}]
        return [Guide(CONTROL, at(c["image"]), str(c.get("net") or SHORTHAND_NET), number(c.get("scale"), 0.0),
                      number(c.get("end"), 1.0), c["image"]) for c in controls]

    def summary(self, job: Any) -> dict:
        return {}

    def plan_json(self, job: Any, summary: Any) -> tuple[dict, dict]:
        """`bcg plan --json`: `controlnet` (the first net's model) beside the model always, `controlnets` at the end
        for named nets."""
        named = job.controlnets and job.controlnets[0][0] != SHORTHAND_NET
        return {"controlnet": first_net(job.controlnets)}, {"controlnets": dict(job.controlnets)} if named else {}


KIND = Control()


def _control_settings(c: ShotControl, weights: Weights) -> dict:
    """One net's entry in the settings' `controls` (`weights`: the digest of the weights a spec names)."""
    entry = {"net": c.net, "controlnet": c.model, "image": c.file or str(c.image), "scale": c.scale,
             "sha256": _content(c.image)}
    weights(entry, "controlnet_weights", c.model)
    if c.end < 1:
        entry["end"] = c.end
    return entry


def _content(path: Path) -> str:
    try:
        return file_sha256(path)[:SHORT]
    except OSError as e:  # gone since the job was loaded: the render fails this image and names the file
        return f"unreadable: {e.strerror or e.__class__.__name__}"


# ---------------------------------------------------------------- reading the YAML


def resolve_nets(ctx: Context, doc: Located) -> Nets:
    """The top-level `controlnet: X` (the one net SHORTHAND_NET) or `controlnets: {name: X, ...}`, each spec
    confined as the model is."""
    shorthand_spec = doc.get("controlnet")
    named, named_line = doc.get("controlnets"), line_of(doc, "controlnets")
    if shorthand_spec is not None and named is not None:
        raise ctx.fail(named_line, None, "controlnets", f"give 'controlnet:' (one model) or 'controlnets:' (named "
                       f"models), not both ('controlnet:' is on line {line_of(doc, 'controlnet')})")
    if shorthand_spec is not None:
        line = line_of(doc, "controlnet")
        spec = as_str(ctx, shorthand_spec, line, None, "controlnet", empty_ok=False)
        ctx.model_spec(spec, line, "controlnet")
        return ((SHORTHAND_NET, spec),)
    if named is None:
        return ()
    if not isinstance(named, Located) or not named:
        raise ctx.fail(named_line, None, "controlnets", f"must be a mapping of name: model, like {{pose: tiny, "
                       f"depth: path/to/controlnet}}, got {type_name(named) if named != {} else 'an empty mapping'}")
    nets = []
    for name, spec in named.items():
        line = line_of(named, name, named_line)
        if not isinstance(name, str) or not SAFE_NAME.fullmatch(name):
            raise ctx.fail(line, None, clip(f"controlnets.{name}"), f"a ControlNet name {SAFE_NAME_RULE}")
        spec = as_str(ctx, spec, line, None, f"controlnets.{name}", empty_ok=False)
        ctx.model_spec(spec, line, f"controlnets.{name}")
        nets.append((name, spec))
    return tuple(nets)


def resolve_controls(ctx: Context, raw: Any, line: int | None, shot_id: str, job_dir: Path,
                     nets: Nets) -> tuple[ShotControl, ...]:
    """A shot's `control:`: one mapping (the one net it runs), or a list of them, each naming its net (which it
    may leave out where the job has one). Ordered by the job's nets, not the shot's listing: the residuals'
    summation order is the job's."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        return (resolve_control(ctx, raw, line, shot_id, job_dir, nets, "control"),)
    if raw and not nets:
        raise ctx.fail(line, shot_id, "control", "the job sets no top-level 'controlnet' model")
    if len(raw) > len(nets):
        raise ctx.fail(line, shot_id, "control", f"{len(raw)} entries, but the job defines {len(nets)} ControlNet"
                       f"{'s' if len(nets) > 1 else ''} ({', '.join(n for n, _ in nets)}): one entry per net")
    controls: dict[str, tuple[int, ShotControl]] = {}
    for i, entry in enumerate(raw):
        at = entry.line if isinstance(entry, Located) else line
        control = resolve_control(ctx, entry, at, shot_id, job_dir, nets, f"control[{i}]")
        if control.net in controls:
            raise ctx.fail(line_of(entry, "net", at), shot_id, f"control[{i}].net", f"the net '{control.net}' is "
                           f"named twice (control[{controls[control.net][0]}] too); one entry per net")
        controls[control.net] = i, control
    return tuple(sorted((c for _, c in controls.values()), key=lambda c: c.index))


def resolve_control(ctx: Context, raw: Any, line: int | None, shot_id: str, job_dir: Path, nets: Nets,
                    field: str) -> ShotControl:
    """One control entry at `field` (`control`, `control[1]`): its net, image, scale and end."""
    if not isinstance(raw, Located):
        raise ctx.fail(line, shot_id, field, f"must be a mapping with 'image' and 'scale', got {type_name(raw)}")
    check_keys(ctx, raw, CONTROL_KEYS, shot_id, prefix=f"{field}.")
    if not nets:
        raise ctx.fail(line, shot_id, field, "the job sets no top-level 'controlnet' model")
    names = [n for n, _ in nets]
    if "net" in raw:
        net_line = line_of(raw, "net", line)
        net = as_str(ctx, raw["net"], net_line, shot_id, f"{field}.net", empty_ok=False)
        if net not in names:
            raise ctx.fail(net_line, shot_id, f"{field}.net", f"unknown net {short_repr(net)} (the job's "
                           f"controlnets: {clip(', '.join(names))}){did_you_mean(net, names)}")
    elif len(nets) > 1:
        raise ctx.fail(raw.line, shot_id, f"{field}.net", f"missing: the job has {len(nets)} ControlNets "
                       f"({clip(', '.join(names))}); name the one this image is for")
    else:
        net = names[0]
    if "image" not in raw:
        raise ctx.fail(raw.line, shot_id, f"{field}.image", "missing")
    path, shown, _ = check_image(ctx, raw["image"], line_of(raw, "image", line), shot_id, f"{field}.image", job_dir,
                                 GUIDE_USE)
    scale = as_float(ctx, raw.get("scale", 1.0), line_of(raw, "scale", line), shot_id, f"{field}.scale",
                     *CONTROL_SCALE)
    end_line = line_of(raw, "end", line)
    end = as_float(ctx, raw.get("end", 1.0), end_line, shot_id, f"{field}.end", 0.0, 1.0)
    if end <= 0:
        raise ctx.fail(end_line, shot_id, f"{field}.end", "must be above 0 (the fraction of the steps the "
                                                          "ControlNet runs; leave out `control` for none)")
    index = names.index(net)
    return ShotControl(path, scale, shown, end, net, nets[index][1], index)
