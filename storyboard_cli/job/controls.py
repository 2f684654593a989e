"""A job's ControlNets: the top-level `controlnet: X` (one net, the shorthand) or `controlnets: {name: X}` (named
nets), and a shot's `control:`: one mapping, or a list of them, one per net it runs (their residuals are summed).
No torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from storyboard_cli.errors import did_you_mean
from storyboard_cli.job.references import SHORTHAND_NET, ShotControl, check_image
from storyboard_cli.job.values import (SAFE_NAME, SAFE_NAME_RULE, Context, as_float, as_str, check_keys, line_of,
                                       type_name)
from storyboard_cli.job.yaml_loader import Located, clip, short_repr

CONTROL_KEYS = ("image", "scale", "end", "net")
CONTROL_SCALE = (0.0, 2.0)
GUIDE_USE = "each shot resizes it to its own size"  # what a render does with a guide (a very large one's warning)
Nets = tuple[tuple[str, str], ...]  # ((name, model spec), ...) in file order: Job.controlnets


def first_net(nets: Nets) -> str | None:
    """The first net's model spec (the shorthand's one net): what `bcg plan --json`'s `controlnet` and the service's mix
    key have always held."""
    return nets[0][1] if nets else None


def resolve_nets(ctx: Context, doc: Located) -> Nets:
    """The top-level `controlnet: X` (the one net SHORTHAND_NET) or `controlnets: {name: X, ...}`, each spec
    confined as the model is."""
    shorthand = doc.get("controlnet")
    named, named_line = doc.get("controlnets"), line_of(doc, "controlnets")
    if shorthand is not None and named is not None:
        raise ctx.fail(named_line, None, "controlnets", f"give 'controlnet:' (one model) or 'controlnets:' (named "
                       f"models), not both ('controlnet:' is on line {line_of(doc, 'controlnet')})")
    if shorthand is not None:
        line = line_of(doc, "controlnet")
        spec = as_str(ctx, shorthand, line, None, "controlnet", empty_ok=False)
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
