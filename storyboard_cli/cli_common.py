"""What every `bcg` command shares: the two consoles (results on stdout, everything else on stderr), words styled
without markup, the options declared once, and the one place a domain error becomes a red line and its exit code."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from storyboard_cli.errors import StoryboardError

# markup off: paths, prompts and ids are printed as they are (`[wip]` stays, `[/]` cannot break a line);
# styled words go through `styled`
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160, markup=False, highlight=False)
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def styled(label: str, style: str, text: str = "") -> Text:
    """`label` in `style`, then `text` verbatim (never read as markup)."""
    return Text.assemble((label, style), (f" {text}" if text else ""))


def flag(name: str, help: str):
    """A boolean option shown as a bare flag (`--force`, not `--force <bool>`)."""
    return typer.Option(name, metavar="", help=help)


def user_path(value: Path | None) -> Path | None:
    """`~` expanded in every path a user gives (`--out=~/x` and a script's quoted '~/x' reach us unexpanded)."""
    return value.expanduser() if value is not None else None


JobArg = Annotated[Path, typer.Argument(help="The job file (YAML).", show_default=False, callback=user_path)]
OutOpt = Annotated[Optional[Path], typer.Option("--out", help="Output folder (default: the job's output_dir).",
                                                callback=user_path)]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda when available).")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="fp16, bf16 or fp32 (default: fp16 on cuda, fp32 on cpu).")]
EngineOpt = Annotated[str, typer.Option(help="auto (graphs on CUDA, eager on CPU), graph or eager.")]
CompileOpt = Annotated[str, typer.Option(help="Compiled kernels inside the CUDA graphs: auto, on or off.")]
JsonOpt = Annotated[bool, flag("--json", "Print one JSON summary object on stdout.")]
Fp8Opt = Annotated[bool, flag("--fp8", "The compiled UNet's transformer layers in FP8 (static scales, calibrated "
                                       "once per model): faster steps, slightly different pictures (an FP8 GPU: "
                                       "Ada, Hopper or later).")]
JobOpt = Annotated[Optional[Path], typer.Option("--job", help="The job that rendered the folder (default: the "
                                                                "one its report names).", callback=user_path)]


@contextmanager
def domain_errors():
    """A StoryboardError raised inside becomes one red line on stderr and its exit code."""
    try:
        yield
    except StoryboardError as e:
        err.print(styled("error:", "bold red", str(e)))
        raise typer.Exit(e.exit_code)
