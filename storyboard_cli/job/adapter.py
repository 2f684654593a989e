"""A job's IP-Adapter: the top-level `ip_adapter:` (a preset, a folder in the h94/IP-Adapter layout, or a weights
file with `image_encoder:`) and `image_encoder:`, confined as the model is and held against the job's model
(adapter_files.adapter_problem) before any model loads. No torch."""

from __future__ import annotations

from storyboard_cli.job.preflight import ADAPTER_PRESETS, job_spec
from storyboard_cli.job.values import Context, as_str, line_of
from storyboard_cli.job.yaml_loader import Located, clip


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
    try:
        from storyboard_cli.job.adapter_files import adapter_problem
    except ModuleNotFoundError as e:  # the check's module is not part of this tree yet: nothing to hold it to
        if e.name != "storyboard_cli.job.adapter_files":
            raise
        return None
    return adapter_problem(adapter, encoder, model)
