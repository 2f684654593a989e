"""Conditioning kinds on the engine side, one row each (engine/conditions/kind.py Kind), joined to the job half's rows
(job/conditions/) by name. Adding a kind is one row here plus its module."""

from storyboard_cli.engine.conditions import control, reference, source
from storyboard_cli.engine.conditions.kind import Kind

KINDS: dict[str, Kind] = {k.name: k for k in (control.KIND, reference.KIND, source.KIND)}
