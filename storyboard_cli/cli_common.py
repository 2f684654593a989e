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

from storyboard_cli.errors import BadInput, StoryboardError

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
# the names of engine/variants.py's rows, which the commands do not import (only its drivers import the engine):
# tests/test_kernels.py holds them to the table
AUTO_KERNELS, FP8_KERNELS = "auto", "fp8"
CPU_KERNELS = (AUTO_KERNELS, "plain")  # what a worker on the CPU renders with: no compiled kernels
KernelsOpt = Annotated[Optional[str], typer.Option(
    "--kernels", help="The kernels inside the CUDA graphs, by name: auto (the default: compiled where the GPU and "
    "--compile allow, else plain), compiled (fp16), fp8 (the compiled UNet's transformer layers in FP8, static scales "
    "calibrated once per model: faster steps, slightly different pictures; Ada, Hopper or later) or plain (the "
    "modules as they are).")]
Fp8Opt = Annotated[bool, flag("--fp8", "Short for --kernels fp8.")]
JobOpt = Annotated[Optional[Path], typer.Option("--job", help="The job that rendered the folder (default: the "
                                                                "one its report names).", callback=user_path)]


def kernels_name(kernels: str | None, fp8: bool) -> str:
    """`--kernels` with its alias `--fp8` (given both, they must agree); raises BadInput where they do not."""
    if fp8 and kernels not in (None, FP8_KERNELS):
        raise BadInput(f"--fp8 is --kernels {FP8_KERNELS}, and --kernels {kernels} was given too: give one of them")
    return FP8_KERNELS if fp8 else kernels or AUTO_KERNELS


@contextmanager
def domain_errors():
    """A StoryboardError raised inside becomes one red line on stderr and its exit code."""
    try:
        yield
    except StoryboardError as e:
        err.print(styled("error:", "bold red", str(e)))
        raise typer.Exit(e.exit_code)
