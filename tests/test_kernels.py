"""The kernels' row chosen by name (`--kernels auto|compiled|fp8|plain`, `--fp8` its alias): what `auto` takes on each
device and with each option, a named row refused in one line where its capability or its exclusions rule it out, the
device's compute capability asked once per process, and the name carried from the command line to the engine. A GPU
is faked where one is needed (its capability, its name); nothing here loads a model."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from conftest import ROOT
from storyboard_cli import cli_common
from storyboard_cli.cli import app
from storyboard_cli.engine import device as dev
from storyboard_cli.engine.build import check_engine
from storyboard_cli.engine.variants import AUTO, COMPILED, FP8, INSTEAD, PARTS, PLAIN, VARIANTS, choose, fit
from storyboard_cli.errors import BadInput

JOB = str(ROOT / "jobs" / "episode1.yaml")
CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of the capability `fake_gpu.capability` (8.9 unless a test sets it), counting the driver's
    capability queries; the process's memo is emptied before and after."""
    state = SimpleNamespace(capability=(8, 9), queries=0)

    def query(index):
        state.queries += 1
        return state.capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", query)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    dev._capability.cache_clear()
    yield state
    dev._capability.cache_clear()


def one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize("capability,engine,compile,want", [
    ((9, 0), "auto", "auto", COMPILED),  # an FP8 GPU: auto never takes a row only used when asked
    ((8, 0), "graph", "on", COMPILED),
    ((6, 1), "auto", "auto", PLAIN),  # older than the compiler's kernels
    ((9, 0), "auto", "off", PLAIN),
    ((9, 0), "eager", "auto", PLAIN),
])
def test_auto_is_the_best_row_the_gpu_and_the_options_allow(fake_gpu, capability, engine, compile, want):
    fake_gpu.capability = capability
    assert choose(AUTO, engine, compile, GPU) == want
    assert check_engine(engine, compile, GPU) == want


def test_auto_on_the_cpu_is_plain_and_asks_no_driver(fake_gpu):
    assert choose(AUTO, "auto", "auto", CPU) == PLAIN
    assert choose(PLAIN, "auto", "auto", CPU) == PLAIN
    assert fake_gpu.queries == 0


@pytest.mark.parametrize("name,capability,needle", [
    (FP8, (8, 0), "--kernels fp8 needs compute capability 8.9 or later (FP8 tensor cores: Ada, Hopper or later); "
                  "Fake GPU has 8.0"),
    (COMPILED, (6, 1), "--kernels compiled needs compute capability 7.0 or later"),
])
def test_a_named_row_the_gpu_cannot_run_is_refused(fake_gpu, name, capability, needle):
    fake_gpu.capability = capability
    with pytest.raises(BadInput) as e:
        check_engine("auto", "auto", GPU, name)
    assert str(e.value).startswith(needle), e.value


@pytest.mark.parametrize("engine,compile,needle", [
    ("auto", "off", "--kernels compiled cannot run with --compile off (use --compile auto or on)"),
    ("eager", "off", "--kernels compiled cannot run with --engine eager and --compile off (use --engine auto or "
                     "graph, and --compile auto or on)"),
])
def test_a_named_row_refuses_the_options_it_excludes(fake_gpu, engine, compile, needle):
    with pytest.raises(BadInput) as e:
        check_engine(engine, compile, GPU, COMPILED)
    assert str(e.value) == needle


def test_an_unknown_name_lists_the_rows():
    with pytest.raises(BadInput, match=r"unknown kernels 'fp88'; did you mean 'fp8'\? \(use auto, fp8, compiled, "
                                       r"plain\)"):
        check_engine("auto", "auto", CPU, "fp88")


def test_the_capability_is_asked_once_per_process(fake_gpu):
    """Every check of a run (the render's options, its session, build_engine; a worker's too) and every artifact key
    read one answer."""
    for name in (AUTO, FP8, COMPILED, AUTO):
        check_engine("auto", "auto", GPU, name)
    check_engine("graph", "on", torch.device("cuda:0"), FP8)
    assert dev.capability(torch.device("cuda", 0)) == (8, 9)
    assert fake_gpu.queries == 1


def test_a_row_not_built_with_a_models_part_falls_back_with_a_note():
    notes: list[str] = []
    assert fit(FP8, SimpleNamespace(ip_adapter=object()), notes) == COMPILED
    assert notes == ["--kernels fp8: its kernels are not built with an IP-Adapter (ip_adapter:); compiled kernels "
                     "instead"]
    assert fit(FP8, SimpleNamespace(ip_adapter=None), notes) == FP8
    assert fit(COMPILED, SimpleNamespace(ip_adapter=object()), notes) == COMPILED and len(notes) == 1
    # compiled kernels take regions, with an IP-Adapter too (regional references); FP8's do not
    assert fit(COMPILED, SimpleNamespace(ip_adapter=object(), region_layout=object()), notes) == COMPILED
    assert fit(FP8, SimpleNamespace(ip_adapter=None, region_layout=object()), notes) == COMPILED
    assert notes[-1] == "--kernels fp8: its kernels are not built with regional prompts (regions:); compiled kernels " \
                        "instead"


def test_every_exclusion_is_one_the_table_can_say():
    """A row's refusals are options with an alternative to give, its parts are SdxlModels' attributes; a row with
    compiled kernels needs CUDA (a capability) and refuses what never runs them."""
    from storyboard_cli.models.loader import SdxlModels

    fields = {f.name for f in dataclasses.fields(SdxlModels)}
    for row in VARIANTS.values():
        assert set(row.refuses) <= set(INSTEAD) and set(row.without) <= set(PARTS) <= fields, row.name
        assert (row.capability is not None) == row.compiled == bool(row.refuses), row.name


# ---------------------------------------------------------------- the command line


def test_the_commands_names_are_the_tables():
    """The commands do not import the engine: their spelling of its names is held to the table here."""
    assert cli_common.AUTO_KERNELS == AUTO and cli_common.FP8_KERNELS == FP8 and VARIANTS[FP8].asked
    assert set(cli_common.CPU_KERNELS) == {AUTO} | {v.name for v in VARIANTS.values() if v.capability is None}
    help_text = cli_common.KernelsOpt.__metadata__[0].help
    assert all(name in help_text for name in (AUTO, *VARIANTS))
    from storyboard_cli.run.render import RenderOptions
    from storyboard_cli.serve.server import ServeOptions
    from storyboard_cli.serve.worker_options import WorkerOptions

    assert RenderOptions().kernels == WorkerOptions("x").kernels == ServeOptions(ROOT).kernels == AUTO


@pytest.mark.parametrize("argv,want", [([], AUTO), (["--fp8"], FP8), (["--kernels", "compiled"], COMPILED),
                                       (["--kernels", "fp8", "--fp8"], FP8), (["--kernels", "plain"], PLAIN)])
def test_render_carries_the_name_to_the_session(argv, want, monkeypatch, tmp_path):
    from storyboard_cli.run import dist

    seen = []

    def render(job, opts, on_event):
        seen.append(opts.kernels)
        raise BadInput("stop here")

    monkeypatch.setattr(dist, "render", render)
    result = CliRunner().invoke(app, ["render", JOB, "--out", str(tmp_path / "out"), *argv])
    assert result.exit_code == 2 and "stop here" in result.output, result.output
    assert seen == [want]


@pytest.mark.parametrize("command", [["render", JOB, "--device", "cpu"], ["capture", "--device", "cpu"],
                                     ["worker", "--server", "http://127.0.0.1:9", "--device", "cpu"],
                                     ["serve", "--gpus", "cpu"]])
def test_fp8_and_a_different_kernels_name_are_one_line_exit_2(command, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*command, "--fp8", "--kernels", "compiled"])
    one_line_error(result, "--fp8 is --kernels fp8, and --kernels compiled was given too: give one of them")


@pytest.mark.parametrize("command", [["render", JOB, "--device", "cpu", "--out", "out"], ["capture", "--device", "cpu"],
                                     ["worker", "--server", "http://127.0.0.1:9", "--device", "cpu"]])
@pytest.mark.parametrize("name,needle", [("fp8", "--kernels fp8 needs a CUDA GPU"),
                                         ("compiled", "--kernels compiled needs a CUDA GPU"),
                                         ("fp16", "--kernels: unknown kernels 'fp16'")])
def test_a_name_the_cpu_cannot_run_is_one_line_exit_2(command, name, needle, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    one_line_error(CliRunner().invoke(app, [*command, "--kernels", name]), needle)
    assert not (tmp_path / "out").exists()


def test_serve_refuses_compiled_kernels_on_cpu_workers(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    one_line_error(CliRunner().invoke(app, ["serve", "--gpus", "0,cpu", "--kernels", "compiled"]),
                   "--kernels compiled runs on CUDA GPUs: drop the cpu workers from --gpus")


@pytest.mark.parametrize("argv,want", [([], AUTO), (["--fp8"], FP8), (["--kernels", "plain"], PLAIN)])
def test_worker_and_capture_carry_the_name(argv, want, monkeypatch, tmp_path):
    from storyboard_cli.run import capture
    from storyboard_cli.serve import worker

    seen = []
    monkeypatch.setattr(worker, "run_worker", lambda opts, on_stall: seen.append(opts.kernels))
    monkeypatch.setattr(capture, "capture", lambda **kw: (seen.append(kw["kernels"]), ([], [], []))[1])
    runner = CliRunner()
    assert runner.invoke(app, ["worker", "--server", "http://127.0.0.1:9", *argv]).exit_code == 0
    assert runner.invoke(app, ["capture", "--json", *argv]).exit_code == 0
    assert seen == [want, want]
