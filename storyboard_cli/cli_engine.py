"""`bcg capture` and `bcg bench`: the commands that drive an engine without rendering a job. `cli.py` registers
them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from storyboard_cli.cli_common import (CompileOpt, DeviceOpt, DtypeOpt, Fp8Opt, JsonOpt, KernelsOpt, domain_errors, err,
                                       flag, kernels_name, out, user_path)
from storyboard_cli.cli_progress import compile_progress
from storyboard_cli.errors import BadInput


def capture(job: Annotated[Optional[Path], typer.Argument(help="Job whose shapes to capture (default: the named "
                                                               "sizes at --buckets).", show_default=False,
                                                               callback=user_path)] = None,
            warm: Annotated[bool, flag("--warm", "Capture, check and time every shape now.")] = False,
            model: Annotated[str, typer.Option(help="Model when no job is given.")] = "sdxl-random",
            controlnet: Annotated[Optional[str], typer.Option(help="Also capture ControlNet shapes with this "
                                                                   "ControlNet (no job given).")] = None,
            buckets: Annotated[str, typer.Option(help="Batch sizes when no job is given.")] = "1,2,4,8",
            steps: Annotated[int, typer.Option(min=2, max=200, help="Steps per timed loop.")] = 10,
            device: DeviceOpt = None, dtype: DtypeOpt = None, compile: CompileOpt = "auto",
            kernels: KernelsOpt = None, fp8: Fp8Opt = False, json_out: JsonOpt = False,
            draft: Annotated[bool, flag("--draft", "The job as `bcg render --draft` renders it: its draft "
                                                   "graphs too.")] = False,
            eager: Annotated[bool, flag("--eager", "Also time each shape's uncompiled step beside its graph "
                                                   "(the speedup column): about doubles --warm's time.")] = False,
            ) -> None:
    """List the shapes a job needs; with --warm, compile the kernels it needs (once per model, GPU and torch;
    kept under $BCG_CACHE), then capture its CUDA graphs (the step kinds of its draft levers too), check them
    against the uncompiled step and time them (with --eager, beside the uncompiled step)."""
    from storyboard_cli.job.file import as_draft, load_job

    with domain_errors():
        sizes = _bucket_sizes(buckets)
        if draft and job is None:
            raise BadInput("bcg capture --draft needs a job")
        j = load_job(job) if job else None
        j = as_draft(j) if draft and j else j
        with compile_progress(quiet=json_out, first="loading torch and the engine" if warm else None) as on_event:
            from storyboard_cli.run import capture as capturing  # torch, diffusers: 4-10 s of a process's start

            labels, loops, rows = capturing.capture(job=j, model=model, controlnet=controlnet, buckets=sizes,
                                             device=device, dtype=dtype, warm=warm, steps=steps, compile=compile,
                                             kernels=kernels_name(kernels, fp8), eager=eager, on_event=on_event)
    if json_out:
        timings = [r.__dict__ | {"speedup": r.speedup} for r in rows]
        out.print_json(json.dumps({"shapes": labels, "loops": loops, "timings": timings}))
        return
    if not warm:
        out.print(f"{len(labels)} shapes (batch x width x height): {', '.join(labels)}")
        if loops:
            out.print(f"{len(loops)} draft loops on them:\n  " + "\n  ".join(loops))
        out.print("run with --warm to capture, check and time them")
        return
    table = Table(title="CUDA graphs", title_justify="left")
    for col in ("shape", "state", "capture s", "pool MB", "eager ms/step", "graph ms/step", "speedup", "note"):
        table.add_column(col, justify="left" if col in ("shape", "state", "note") else "right")
    for r in rows:
        table.add_row(r.shape, r.state, f"{r.capture_s:.2f}", f"{r.pool_mb:.0f}",
                      f"{r.eager_ms:.1f}" if r.eager_ms else "-", f"{r.graph_ms:.1f}" if r.graph_ms else "-",
                      f"{r.speedup:.2f}x" if r.speedup else "-", r.reason)
    out.print(table)
    pools = [r.pool_mb for r in rows if r.state == "graph"]
    if pools:
        out.print(f"{len(pools)} graphs share one pool: {sum(pools):.0f} MB in all, "
                  f"{sum(pools) / max(max(pools), 1e-9):.2f}x the largest graph's {max(pools):.0f} MB")


def _bucket_sizes(text: str) -> tuple[int, ...]:
    from storyboard_cli.job.file import MAX_BUCKET

    try:
        sizes = tuple(sorted({int(b) for b in text.split(",")}))
    except ValueError:
        sizes = ()
    if not sizes or not all(1 <= b <= MAX_BUCKET for b in sizes):
        raise BadInput(f"--buckets: expected batch sizes from 1 to {MAX_BUCKET} like 1,2,4, got {text!r}")
    return sizes


def bench(job: Annotated[Path, typer.Argument(help="The bench job.")] = Path("jobs/bench.yaml"),
          quick: Annotated[bool, flag("--quick", "Tiny model on the CPU, a smoke run (< 1 min).")] = False,
          model: Annotated[Optional[str], typer.Option(help="Weights to bench (default: the job's model).")] = None,
          parts: Annotated[str, typer.Option(help="What to run: job, micro, lora, draft, curves, ... "
                                                  "(comma-separated).")] = "job,micro",
          with_compile: Annotated[bool, flag("--with-compile", "Also run diffusers + torch.compile "
                                             "(compiles per shape: many minutes).")] = False,
          results: Annotated[Path, typer.Option(help="Folder for the JSON and Markdown results.")] = Path("benchmarks/runs"),
          ) -> None:
    """Measure bcg against the plain diffusers loop (and torch.compile) on one job, in one run."""
    from storyboard_cli.bench import harness, report

    with domain_errors():
        rec = harness.run(job_path=job, model=model, quick=quick, parts=tuple(p.strip() for p in parts.split(",")),
                          with_compile=with_compile, results_dir=results,
                          log=lambda line: err.print(line))
    out.print(report.markdown(rec))
    out.print(f"written: {', '.join(rec['written'])}")
