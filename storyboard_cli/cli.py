"""`bcg`: parses options, calls one library function, prints. With cli_common.py (the consoles, the shared options,
the error mapping), cli_progress.py (progress on stderr) and cli_engine.py (`capture`, `bench`), the only modules
that print or exit."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterable, Optional

import typer
from rich.table import Table
from rich.text import Text

from storyboard_cli import __version__
from storyboard_cli.cli_common import (CPU_KERNELS, CompileOpt, DeviceOpt, DtypeOpt, EngineOpt, Fp8Opt, JobArg, JobOpt,
                                       JsonOpt, KernelsOpt, OutOpt, err, kernels_name, out)
from storyboard_cli.cli_common import domain_errors as _domain_errors
from storyboard_cli.cli_common import flag as _flag
from storyboard_cli.cli_common import styled as _styled
from storyboard_cli.cli_common import user_path as _user_path
from storyboard_cli.cli_engine import bench, capture
from storyboard_cli.cli_progress import render_progress
from storyboard_cli.cuda_env import launch_queues
from storyboard_cli.errors import BadInput, Interrupted, Status, exit_code, plural
from storyboard_cli.folder.layout import INDEX, REPLACED, REPORT_JSON, REPORT_MD, SELECTS
from storyboard_cli.job.conditions import KINDS
from storyboard_cli.job.file import DRAFT_CUTOFF, DRAFT_DEEPCACHE
from storyboard_cli.job.plan import decimal_size as _size
from storyboard_cli.run.signals import STOP_SIGNALS

if TYPE_CHECKING:
    from storyboard_cli.folder.report import Report

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch SDXL storyboard renderer: a YAML job of shots in, PNGs and a timing report out.")


def _version(value: bool) -> None:
    if value:
        out.print(f"bcg {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", metavar="", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Batch SDXL storyboard renderer: a YAML job of shots in, PNGs and a timing report out."""


@app.command()
def plan(job: JobArg, json_out: JsonOpt = False,
         draft: Annotated[bool, _flag("--draft", "The job as `bcg render --draft` renders it.")] = False,
         gpus: Annotated[int, typer.Option(min=1, help="The time on this many GPUs (`bcg render --gpus N`).")] = 1,
         kernels: KernelsOpt = None, fp8: Fp8Opt = False,
         on: Annotated[Optional[str], typer.Option("--on", help="The time on this GPU's measurements (its name as "
                                                               "nvidia-smi gives it, e.g. 'NVIDIA H200', or cpu; "
                                                               "default: this machine's).")] = None) -> None:
    """Validate a job and print its bucket table and how long it takes, without loading a model."""
    from storyboard_cli.costs import local_device
    from storyboard_cli.job.estimate import adapted, estimate
    from storyboard_cli.job.file import as_draft, load_job
    from storyboard_cli.job.plan import render_batches, summary, work_items

    with _domain_errors():
        j = load_job(job)
        planned = as_draft(j) if draft else j
        s = summary(planned)
        est = estimate(render_batches(planned, work_items(planned)), j.model, on or local_device(),
                       kernels_name(kernels, fp8), gpus, adapted(j))
    if json_out:
        out.print_json(json.dumps(s.to_json() | {"estimate": est.to_json()}))
        return
    _warn(j.warnings + s.warnings)
    table = Table(title=f"{j.name}: {plural(len(j.shots), 'shot')}, {plural(s.images, 'image')} "
                        f"({s.unique_images} distinct), model {j.model}", title_justify="left")
    rows, levered = s.buckets, s.levered
    cols = ("size", "steps", "sampler", "control", "images", "batches", "UNet rows", "padding", "rows x steps")
    for col in cols + (("levers", "saving (est.)") if levered else ()):
        table.add_column(col, justify="left" if col in ("size", "sampler", "batches", "levers") else "right")
    for r in rows:
        k = r.key
        batches = ", ".join(f"{n}x{b}" for b, n in sorted(Counter(r.batches).items(), reverse=True))
        extra = (k.levers, f"{100 * k.flops_saved:.0f}%" if k.levers else "") if levered else ()
        control = (f"{len(k.nets)} nets" if len(k.nets) > 1 else "yes") if k.control else ""
        steps = f"{k.runs} of {k.steps}" if k.first else str(k.steps)  # an init's strength: the tail that runs
        table.add_row(f"{k.width}x{k.height}", steps, k.sampler, control, str(r.images),
                      batches, str(r.rows), f"{r.padded_rows} ({100 * r.waste:.0f}%)", f"{r.row_steps:,}", *extra)
    table.add_section()
    table.add_row("total", "", "", "", str(sum(r.images for r in rows)), str(sum(len(r.batches) for r in rows)),
                  str(sum(r.rows for r in rows)), str(sum(r.padded_rows for r in rows)),
                  f"{sum(r.row_steps for r in rows):,}", *(("", f"{100 * s.flops_saved:.0f}%") if levered else ()))
    out.print(table)
    if levered:
        out.print("saving (est.): the UNet and ControlNet FLOPs the draft levers skip against full steps (a guided "
                  "step counts 2 rows per image, a conditional one 1, a DeepCache shallow step its share of the UNet, "
                  "a step after the ControlNet's end saves the ControlNet's); the time saved is smaller "
                  "(docs/PERFORMANCE.md, \"Draft renders\")")
    if s.note:
        out.print(s.note)
    out.print(f"output: {j.output_dir} (about {_size(s.disk_bytes)} of PNGs)   buckets: {list(j.buckets)}   "
              "(UNet rows count CFG: 2 per image)")
    if j.loras:
        out.print("LoRA sets, in render order: " + "; ".join(f"{r.label} ({plural(r.images, 'image')})"
                                                            for r in s.lora_sets) + f"; {plural(s.lora_swaps, 'swap')}")
    if s.references:
        characters = f"; characters: {', '.join(s.characters)}" if s.characters else ""
        out.print(f"references: {plural(s.references, 'reference')}, encoded once (ip_adapter {j.ip_adapter})"
                  f"{characters}")
    for note in s.kind_notes:  # the references' scales, the shots that start from a source
        out.print(note)
    for h in s.hires:
        out.print(f"hires {h['shot']}: {h['size']} -> {h['hires_size']} ({h['upscaler']} x{h['scale']:g}), "
                  f"{h['steps_run']} of {h['steps']} steps at strength {h['strength']:g}, "
                  f"{plural(h['images'], 'image')}")
    out.print(est.line())


def _warn(warnings: Iterable[str]) -> None:
    for w in warnings:
        err.print(Text.assemble(("warning: ", "yellow"), w))


@app.command()
def render(ctx: typer.Context, job: JobArg, out_dir: OutOpt = None,
           force: Annotated[bool, _flag("--force", "Render images again even if they exist (edited ones are "
                                                   f"moved to <out>/{REPLACED}/ first).")] = False,
           retry_failed: Annotated[bool, _flag("--retry-failed", "Render only the images the last run failed.")] = False,
           shot: Annotated[Optional[list[str]], typer.Option("--shot", help="Only this shot (an id or a glob "
                                                                           "like 'ep1_*'); repeatable.")] = None,
           reroll: Annotated[Optional[Path], typer.Option("--reroll", help="A picks.yaml: new candidates for the "
                                                                          "shots it marks for reroll.",
                                                                          callback=_user_path)] = None,
           draft: Annotated[bool, _flag("--draft", "Draft candidates, faster: every shot with cfg_cutoff "
                                                   f"{DRAFT_CUTOFF:g} and DeepCache interval "
                                                   f"{DRAFT_DEEPCACHE.interval}, "
                                                   "into <out>/draft/, marked as drafts.")] = False,
           draft_out: Annotated[Optional[Path], typer.Option("--draft-out", help="The draft folder (default: "
                                                                                "<out>/draft).",
                                                             callback=_user_path)] = None,
           final: Annotated[Optional[Path], typer.Option("--final", help="A picks.yaml saved from the draft sheet: "
                                                                        "the picked candidates at full quality, same "
                                                                        "seeds, into <out>.",
                                                         callback=_user_path)] = None,
           json_out: JsonOpt = False, quiet: Annotated[bool, _flag("--quiet", "No progress output.")] = False,
           device: DeviceOpt = None, dtype: DtypeOpt = None,
           engine: EngineOpt = "auto", compile: CompileOpt = "auto", kernels: KernelsOpt = None, fp8: Fp8Opt = False,
           gpus: Annotated[int, typer.Option(min=1, help="GPUs of this machine to render on, one worker each "
                                                        "(started through torchrun).")] = 1) -> None:
    """Render a job: every image not already on disk."""
    from storyboard_cli.job.file import load_job
    from storyboard_cli.run import dist
    from storyboard_cli.run import render as rendering

    with _domain_errors():
        kernels = kernels_name(kernels, fp8)  # before anything is read (under --gpus, before a worker starts)
    if gpus > 1 and dist.worker() is None:
        note = dist.launch_note(gpus, device)
        if note and not quiet:
            err.print(Text(note, style="dim"))
        with _domain_errors():
            from storyboard_cli.folder.picks import render_target

            j, folder = render_target(load_job(job), out_dir, reroll=reroll, draft=draft, draft_out=draft_out,
                                      final=final)  # as each worker makes them (a reroll's rounds are idempotent)
            code, report = dist.launch(gpus, _command_line(ctx), folder, j)
        if report is not None:  # the workers' outcome, merged: rank 0 left it to the launcher
            paths = [p for p in (folder / REPORT_JSON, folder / REPORT_MD) if p.exists()]
            _outcome(report, json_out, paths, folder / INDEX if (folder / INDEX).exists() else None)
        raise typer.Exit(code)
    with _domain_errors():
        from storyboard_cli.folder.picks import render_target

        j, out_dir = render_target(load_job(job), out_dir, reroll=reroll, draft=draft, draft_out=draft_out,
                                   final=final)
        if dist.leader():  # once, not per worker
            _warn(j.warnings)
        opts = rendering.RenderOptions(out_dir=out_dir, force=force, device=device, dtype=dtype, engine=engine,
                                       retry_failed=retry_failed, compile=compile, shots=tuple(shot or ()),
                                       kernels=kernels)
        with render_progress(quiet or not dist.leader()) as on_event:
            result = dist.render(job=j, opts=opts, on_event=on_event)
    if not dist.leader() or dist.launched():  # rank 0 speaks for the job; under --gpus, once merged, its launcher
        raise typer.Exit(exit_code(result.status, result.signal))
    _outcome(result.report, json_out, result.report_paths or (), result.sheet)
    code = exit_code(result.status, result.signal)
    if code:
        raise typer.Exit(code)


def _outcome(report: Report, json_out: bool, report_paths: Iterable[Path], sheet: Path | None) -> None:
    """How a render ended, from its report: its notes, its failed images, then one summary line (or `--json`)."""
    for note in report.notes:
        err.print(Text(note, style="dim"))
    for f in report.failures:
        err.print(_styled("failed:", "yellow", f"{f['path']}: {f['reason']}"))
    if json_out:
        data = report.to_json()
        out.print_json(json.dumps({k: data[k] for k in ("status", "output_dir", "device", "dtype", "engine",
                                                         "wall_s", "images_rendered", "images_skipped",
                                                         "images_failed", "images_per_s", "steps_per_s",
                                                         "peak_memory_mb", "stages_s", "run", "stopped_by")}
                                  | {"report": [str(p) for p in report_paths], "sheet": str(sheet) if sheet else None}))
    else:
        err.print(f"{report.status}: {report.images_rendered} rendered, {report.images_skipped} skipped, "
                  f"{len(report.failures)} failed in {report.wall_s:.1f} s on {report.device} "
                  f"({report.engine}) -> {report.output_dir}")


def _command_line(ctx: typer.Context) -> list[str]:
    """The command rebuilt from what was parsed, for the workers `--gpus` starts (they ignore --gpus)."""
    argv = [ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value is False or value == ():
            continue
        if param.param_type_name == "argument":
            argv.append(str(value))
        elif param.is_flag:
            argv.append(param.opts[0])
        else:
            for v in value if param.multiple else [value]:
                argv += [param.opts[0], str(v)]
    return argv


FolderArg = Annotated[Path, typer.Argument(help="A render's output folder.", show_default=False, callback=_user_path)]


@app.command()
def sheet(out_dir: FolderArg,
          job: JobOpt = None) -> None:
    """(Re)build the contact sheet, <out>/index.html, from what is on disk."""
    from storyboard_cli.folder.sheet import write_sheet
    from storyboard_cli.job.file import load_job

    notes: list[str] = []
    with _domain_errors():
        path = write_sheet(out_dir, load_job(job) if job else None, notes)
    _warn(notes)
    out.print(str(path))


@app.command()
def pick(out_dir: FolderArg,
         picks: Annotated[Path, typer.Argument(help="The picks.yaml saved from the contact sheet.",
                                               show_default=False, callback=_user_path)],
         job: JobOpt = None) -> None:
    """Copy the picked candidates, in shot order, to <out>/selects/NNN_<shot>.png."""
    from storyboard_cli.folder.picks import apply_picks, load_picks
    from storyboard_cli.folder.sheet import write_sheet
    from storyboard_cli.job.file import load_job

    with _domain_errors():
        j = load_job(job) if job else None
        written = apply_picks(out_dir, load_picks(picks, out_dir, j), j)
        write_sheet(out_dir, j)
    for path in written:
        out.print(str(path))
    err.print(f"{len(written)} selects in {Path(out_dir) / SELECTS}")


@app.command()
def refine(out_dir: FolderArg,
           refines: Annotated[Path, typer.Argument(help="REFINES.yaml, or the contact sheet's picks file with a "
                                                        "`refine:` list.", show_default=False, callback=_user_path)],
           draft: Annotated[bool, _flag("--draft", "Refinements with the draft levers, marked as drafts.")] = False,
           job_out: Annotated[Optional[Path], typer.Option(
               "--job-out", callback=_user_path, help="Write the refinements as a job file (for `bcg submit`; "
               "beside the folder's job file, whose relative paths it keeps) instead of rendering them.")] = None,
           json_out: JsonOpt = False, quiet: Annotated[bool, _flag("--quiet", "No progress output.")] = False,
           device: DeviceOpt = None, dtype: DtypeOpt = None,
           engine: EngineOpt = "auto", compile: CompileOpt = "auto", kernels: KernelsOpt = None,
           fp8: Fp8Opt = False) -> None:
    """Refine picked candidates (img2img, a masked area repainted, a hires pass), written beside them."""
    if job_out is not None:
        from storyboard_cli.folder.refines import refine_job_file

        with _domain_errors():
            out.print(str(refine_job_file(out_dir, refines, job_out)))
        return
    from storyboard_cli.run import render as rendering
    from storyboard_cli.run.refine import refine as refining

    with _domain_errors():
        kernels = kernels_name(kernels, fp8)
        opts = rendering.RenderOptions(out_dir=out_dir, device=device, dtype=dtype, engine=engine,
                                       compile=compile, kernels=kernels)
        with render_progress(quiet) as on_event:
            result = refining(out_dir, refines, opts, draft, on_event)
    _outcome(result.report, json_out, result.report_paths or (), result.sheet)
    code = exit_code(result.status, result.signal)
    if code:
        raise typer.Exit(code)


app.command()(capture)
app.command()(bench)


ServerOpt = Annotated[str, typer.Option("--server", help="The bcg serve URL, e.g. http://gpu-box:8188.")]
TokenOpt = Annotated[Optional[str], typer.Option("--token", envvar="BCG_TOKEN", show_envvar=True,
                                                 help="Bearer token of the server (needed off loopback).")]
WorkerTokenOpt = Annotated[Optional[str], typer.Option("--token", envvar=["BCG_WORKER_TOKEN", "BCG_TOKEN"],
                                                       show_envvar=True, help="The server's worker token (its "
                                                       "--worker-token, else its --token).")]
PriorityOpt = Annotated[str, typer.Option(help="urgent, normal or bulk (bulk jobs age into urgent over 30 min).")]
WarmOpt = Annotated[Optional[Path], typer.Option("--warm", callback=_user_path,
                                                 help="A job (YAML) whose model is loaded and whose shapes are "
                                                      "captured before the first lease: ready at once.")]


@app.command()
def serve(root: Annotated[Path, typer.Option(help="Folder of the queue (SQLite) and the job folders.")] = Path(
              "bcg-serve"),
          host: Annotated[str, typer.Option(help="Address to bind (not loopback: needs --token).")] = "127.0.0.1",
          port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind.")] = 8188,
          gpus: Annotated[str, typer.Option(help="One worker per entry: GPU indices (0,1), cpu, or auto.")] = "auto",
          max_queue_images: Annotated[int, typer.Option(min=1, help="Refuse submissions (503) above this many "
                                                                    "queued images.")] = 1000,
          lease_s: Annotated[float, typer.Option(min=1, help="Seconds a batch stays leased without a heartbeat.")] = 60.0,
          grace_s: Annotated[float, typer.Option(min=0, help="On SIGTERM, seconds the running batches get to "
                                                              "finish.")] = 60.0,
          allow_dir: Annotated[Optional[list[Path]], typer.Option(help="A folder jobs may read control images, "
                                                                  "LoRAs and models from, besides --root (repeat).")] = None,
          allow_model: Annotated[Optional[list[str]], typer.Option(help="A hub id (owner/name) jobs may name as "
                                                                   "model or controlnet (repeat; none by default).")] = None,
          max_job_kb: Annotated[int, typer.Option(min=1, help="Largest job body accepted (413 above).")] = 1024,
          max_blob_mb: Annotated[int, typer.Option(min=1, help="Largest input file (control image, LoRA) "
                                                                "accepted (413 above).")] = 2048,
          max_workers: Annotated[int, typer.Option(min=1, help="Workers registered at once.")] = 64,
          min_free_mb: Annotated[int, typer.Option(min=0, help="Free space kept on --root's disk for the accepted "
                                                                "jobs: below it, new jobs and input files are refused "
                                                                "(507) and /readyz is 503.")] = 512,
          max_blobs_gb: Annotated[float, typer.Option(min=0, help="Total size of the stored input files (507 "
                                                                   "above).")] = 100.0,
          blob_grace_s: Annotated[float, typer.Option(min=0, help="Seconds an input file no job names is kept "
                                                                   "(from its upload or last use).")] = 3600.0,
          worker_token: Annotated[Optional[str], typer.Option("--worker-token", envvar="BCG_WORKER_TOKEN",
                                                              show_envvar=True, help="Bearer token of the worker "
                                                              "routes (default: --token).")] = None,
          stall_s: Annotated[float, typer.Option(min=0, help="Each local worker's --stall-s: seconds its render may "
                                                  "show no progress before it exits 75 and is started again; 0: "
                                                  "never.")] = 600.0,
          warm: WarmOpt = None, token: TokenOpt = None, dtype: DtypeOpt = None, engine: EngineOpt = "auto",
          compile: CompileOpt = "auto", kernels: KernelsOpt = None, fp8: Fp8Opt = False) -> None:
    """Run the render service: the HTTP API, the queue, and one hot worker per GPU."""
    from storyboard_cli.job.file import load_job
    from storyboard_cli.serve.server import ServeOptions, Service

    with _domain_errors():
        kernels = kernels_name(kernels, fp8)
        if warm is not None:
            load_job(warm)  # a bad file is one line here, not a worker that dies and is restarted
            warm = warm.resolve()
        if kernels not in CPU_KERNELS and "cpu" in gpus.split(","):
            raise BadInput(f"--kernels {kernels} runs on CUDA GPUs: drop the cpu workers from --gpus")
        opts = ServeOptions(root=root, host=host, port=port, gpus=tuple(g.strip() for g in gpus.split(",") if g.strip()),
                            max_queue_images=max_queue_images, lease_s=lease_s, grace_s=grace_s, token=token,
                            dtype=dtype, engine=engine, compile=compile, inputs=tuple(allow_dir or ()), warm=warm,
                            kernels=kernels, worker_token=worker_token, max_job_kb=max_job_kb, max_blob_mb=max_blob_mb,
                            max_workers=max_workers, allow_models=tuple(allow_model or ()), min_free_mb=min_free_mb,
                            max_blobs_gb=max_blobs_gb, blob_grace_s=blob_grace_s, stall_s=stall_s)
        service = Service(opts)  # the queue opened and the port bound: a start-up error is one line, before this
        err.print(f"bcg serve: {service.url} (docs at {service.url}/docs), root {root}, workers: "
                  f"{', '.join(opts.gpus)}")
        code = service.run()
    raise typer.Exit(code)


@app.command()
def worker(server: ServerOpt, name: Annotated[str, typer.Option(help="This worker's name in the server's "
                                                                     "leases (default: host and process).")] = "",
           gpu: Annotated[Optional[str], typer.Option(help="GPU index to render on (sets CUDA_VISIBLE_DEVICES).")] = None,
           upload: Annotated[bool, _flag("--upload", "Send the PNGs to the server even when its job folders are "
                                                     "visible here (they are sent whenever they are not).")] = False,
           root: Annotated[Path, typer.Option(help="Where this worker keeps its copies of job folders when it does "
                                                   "not share the server's filesystem.")] = Path("bcg-worker"),
           max_inputs_gb: Annotated[float, typer.Option(min=0, help="Most disk the input files downloaded into "
                                                        "--root (control images, LoRAs) may take: the least recently "
                                                        "used go first, and come again when a job needs them.")] = 20.0,
           stall_s: Annotated[float, typer.Option(min=0, help="Seconds a lease's render may show no progress (no batch "
                                                  "begun or delivered, no kernel build it waits for running) before "
                                                  "the worker takes its device for hung and exits with status 75, "
                                                  "for its supervisor to start it again; 0: never.")] = 600.0,
           warm: WarmOpt = None, token: WorkerTokenOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
           engine: EngineOpt = "auto", compile: CompileOpt = "auto", kernels: KernelsOpt = None,
           fp8: Fp8Opt = False) -> None:
    """Render the server's queue on this machine (job folders shared with the server, or uploaded)."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from storyboard_cli.serve.worker import STALLED, WorkerOptions, run_worker

    with _domain_errors():  # a device or options it cannot render with: one line, exit 2, before it registers
        run_worker(WorkerOptions(server=server, name=name, device=device, dtype=dtype, engine=engine,
                                 compile=compile, token=token, upload=upload, root=root, warm=warm,
                                 kernels=kernels_name(kernels, fp8), max_inputs_gb=max_inputs_gb, stall_s=stall_s),
                   on_stall=lambda: os._exit(STALLED))  # from the heartbeat's thread: the main one is stuck


@app.command()
def submit(job: JobArg, server: ServerOpt, priority: PriorityOpt = "normal",
           key: Annotated[Optional[str], typer.Option("--key", help="Idempotency-Key: a retry with the same key "
                                                                    "returns the same job.")] = None,
           wait: Annotated[bool, _flag("--wait", "Wait until the job is done; exit as `bcg render` would.")] = False,
           token: TokenOpt = None, json_out: JsonOpt = False) -> None:
    """Submit a job to a bcg serve server; print its id and URL (with --wait, its outcome)."""
    from storyboard_cli.serve import client
    from storyboard_cli.serve.schedule import ImageState

    with _domain_errors():
        j = client.submit(job, server, priority=priority, key=key, token=token, on_inputs=lambda sent, present: err.print(
            f"inputs: {len(sent)} uploaded ({_size(sum(n for _, n in sent))}), {present} already on the server"))
        err.print(f"{j['id']}: {j['state']} ({len(j['images'])} images) {j['url']}")
        if wait:
            j = client.wait(server, j["id"], token=token, on_event=lambda e: err.print(
                f"{e.kind}: {e.data['images_by_state'].get('done', 0)}/{sum(e.data['images_by_state'].values())} done"))
    if json_out:
        out.print_json(json.dumps(j))
    else:
        out.print(j["id"])
    if wait:
        states = Counter(i["state"] for i in j["images"])
        for i in j["images"]:
            if i["state"] == ImageState.FAILED:  # one line each, as `bcg render` prints its failed images
                reason = " ".join(str(i["reason"]).split())
                err.print(_styled("failed:", "yellow", f"shot {i['shot']} candidate {i['candidate']}: {reason}"))
        canceled = f", {states[ImageState.CANCELED]} canceled" if states[ImageState.CANCELED] else ""
        err.print(f"{j['state']}: {states[ImageState.DONE]} images done, {states[ImageState.FAILED]} failed"
                  f"{canceled} -> {j['sheet_url']}")
        if j["state"] != client.JobState.SUCCEEDED:  # as `bcg render` exits when images failed
            raise typer.Exit(exit_code(Status.FAILED))


def main() -> None:
    launch_queues()  # before anything starts CUDA
    logging.basicConfig(level=os.environ.get("BCG_LOG", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    # a large control image is the artist's, not an attack: the job file says so once (job/file.py)
    warnings.filterwarnings("ignore", message=r"Image size \(\d+ pixels\) exceeds limit", module="PIL")
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        _exiting_on_a_stop()
        sys.exit(Interrupted.exit_code)
    except SystemExit as e:
        if e.code in {128 + sig for sig in STOP_SIGNALS}:
            _exiting_on_a_stop()
        raise


def _exiting_on_a_stop() -> None:
    """The process ends on a stop (Ctrl-C, SIGTERM, SIGHUP): one more of them while the interpreter exits (its exit
    handlers, torch's among them, run after the render restored the default handlers) would end it with a traceback
    where the render had ended cleanly; once stopping, further stop signals change nothing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    main()
