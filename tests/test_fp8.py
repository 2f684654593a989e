"""FP8 UNet kernels (`--fp8`, engine/kernels/fp8.py) on the CPU (AOTInductor builds CPU code, and torch._scaled_mm runs
there): which Linears go FP8, the artifact computing exactly the FP8 UNet, calibration stored once per model, a
LoRA swap re-quantising the FP8 weights in place, the options refused where they cannot run. The tiny FP8 UNet
artifact (128x128) is conftest's `artifacts`, built once a session; the GPU side is tests/test_gpu_fp8.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.build import check_engine
from storyboard_cli.engine.eager import StepCalls, unet_call
from storyboard_cli.engine.kernels import fp8 as F
from storyboard_cli.engine.kernels.artifacts import Target, artifact_key, artifact_path, options, targets
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.kernels.export import fuse_projections
from storyboard_cli.engine.variants import VARIANTS
from storyboard_cli.errors import BadInput
from storyboard_cli.models.loader import load_sdxl

from helpers.kernels import (FP8_TWINS, FP8_UNET_TWINS, SIDE, assert_computes_fp8, fp8_reference, run_calls,
                             step_inputs)
from helpers.reference import rel_error

ROOT = Path(__file__).resolve().parent.parent
SHAPE = Shape(4, SIDE, SIDE, False)
CHECK_RTOL = VARIANTS["fp8"].check_rtol  # the first-replay check's limit


def fp8_kernels(models, root, builds=None) -> CompiledKernels:
    k = CompiledKernels(models, builds, root=root, variant="fp8")
    k.want(k.targets([SHAPE]))
    k.reserve(SHAPE.batch, SIDE * SIDE)
    return k


def _unet_only(inputs):
    return (*inputs[:5], None, None)


def test_the_fp8_linears_are_the_transformers_image_token_layers():
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    fuse_projections(models.unet)
    names = F.linears(models.unet)
    blocks = [n for n, m in models.unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"]
    transformers = [n for n, m in models.unet.named_modules() if type(m).__name__ == "Transformer2DModel"]
    assert blocks and len(names) == 6 * len(blocks) + 2 * len(transformers)
    block = blocks[0]
    for kept in (f"{block}.attn2.to_kv", f"{block}.attn2.to_k", f"{block}.attn1.to_q"):
        assert kept not in names  # text tokens (77 a row) stay fp16; to_q is a view of the fused q/k/v
    assert names[f"{block}.attn1.to_qkv"] == f"{block}.attn1.to_q"  # calibrated on the same input
    assert names[f"{block}.attn2.to_q"] == f"{block}.attn2.to_q"
    assert {f"{block}.ff.net.0.proj", f"{block}.ff.net.2", f"{block}.attn1.to_out.0"} <= names.keys()
    assert not [n for n in names if n.startswith(("time_embedding", "add_embedding"))]


def test_the_artifact_computes_the_fp8_unet(artifacts):
    """Compiled against the same FP8 arithmetic in eager PyTorch: equal to rounding. Against the float UNet: the
    quantisation's error, real and inside the first-replay check's limit."""
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = fp8_kernels(models, artifacts)
    assert k.ready(*SHAPE) is None
    reference = fp8_reference(models, k.constants["fp8"])
    wrong = fp8_reference(models, k.constants["fp8"], convs=False)
    cases = []
    for rows, seed in ((2, 2), (2, 12), (8, 8), (8, 18)):
        inputs = _unet_only(step_inputs(models, rows, False, seed=seed))
        with torch.no_grad():
            cases.append((run_calls(k, *inputs), unet_call(reference, *inputs[:5], None, None),
                          unet_call(wrong, *inputs[:5], None, None), run_calls(StepCalls.eager(models), *inputs)))
    assert_computes_fp8(cases, CHECK_RTOL)


def test_scales_are_calibrated_once_per_model_and_stored(tmp_path):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    first, second = [], []
    CompiledKernels(models, None, first, root=tmp_path, variant="fp8")
    k = CompiledKernels(models, None, second, root=tmp_path, variant="fp8")
    assert "calibrated now" in first[0] and "stored" in second[0]
    scales = k.constants["fp8"]
    stored = json.loads(scales.file.read_text())
    assert set(stored["amax"]) == set(F.quantised(models.unet)) and all(a > 0 for a in stored["amax"].values())
    assert set(scales.x_scales) == {"unet"}  # no ControlNet loaded: none calibrated
    assert scales.x_scales["unet"][next(iter(scales.x_scales["unet"]))].dtype == torch.float32
    other = load_sdxl("tiny", None, "cpu", torch.float32)
    with torch.no_grad():
        other.unet.conv_in.weight.mul_(1.5)  # fine-tuned weights: another model
    assert F.fingerprint(other) != F.fingerprint(models)
    assert F.fingerprint(load_sdxl("tiny", None, "cpu", torch.float32)) == F.fingerprint(models)


def test_a_lora_swap_requantizes_the_fp8_weights_in_place(artifacts):
    """A LoRA on a q projection (a view into the fused q/k/v, whose FP8 copy is what the artifact reads) and on a
    feed-forward layer: the FP8 weights and their scales follow in place, the artifact computes the FP8 UNet of
    the new weights, and the empty set restores them bit for bit."""
    from storyboard_cli.models.lora import LoraApplier, LoraLayer, LoraWeights

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = fp8_kernels(models, artifacts)
    block = "down_blocks.1.attentions.0.transformer_blocks.0"
    g = torch.Generator().manual_seed(7)
    layers = []
    for name in (f"{block}.attn1.to_q", f"{block}.ff.net.2"):
        out_f, in_f = models.unet.get_submodule(name).weight.shape
        down, up = torch.randn(4, in_f, generator=g), torch.randn(out_f, 4, generator=g)
        layers.append(LoraLayer("unet", name, down, up, 4.0))
    lora = LoraWeights("x", Path("x.safetensors"), "0" * 64, layers)
    q, s = models.derived[f"fp8:unet:{block}.attn1.to_qkv"][0]
    ff = models.derived[f"fp8:unet:{block}.ff.net.2"][0][0]
    ptrs, q0, s0 = (q.data_ptr(), s.data_ptr(), ff.data_ptr()), q.clone(), s.clone()
    inputs = _unet_only(step_inputs(models, 4, False, seed=11))
    applier = LoraApplier(models)
    with torch.no_grad():
        before = run_calls(k, *inputs)
        applier.apply({"x": (lora, 0.8)})
        after = run_calls(k, *inputs)
        want = unet_call(fp8_reference(models, k.constants["fp8"]), *inputs[:5], None, None)
        full = run_calls(StepCalls.eager(models), *inputs)
        assert not torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
        applier.restore()
        restored = run_calls(k, *inputs)
    assert (q.data_ptr(), s.data_ptr(), ff.data_ptr()) == ptrs
    assert rel_error(after, before) > 1e-3 and rel_error(after, want) < FP8_UNET_TWINS * rel_error(want, full)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert torch.equal(restored, before)


def test_fp8_artifacts_have_their_own_key_and_name():
    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    t16, t8 = Target("unet", 1024, 1024), Target("unet", 1024, 1024, "fp8")
    assert (t16.label, t8.label) == ("unet 1024x1024", "unet 1024x1024 fp8")
    assert artifact_key(t16, models.unet) != artifact_key(t8, models.unet)
    assert artifact_path(t8, models.unet).name.startswith("unet-fp8-1024x1024-")
    assert "max_autotune_gemm_backends" not in options(t16) and options(t8)["max_autotune_gemm_backends"] == "ATEN"
    # the ControlNet's FP8 twin has its own too
    c16, c8 = Target("controlnet", 1024, 1024), Target("controlnet", 1024, 1024, "fp8")
    net = models.controlnets[0]
    assert artifact_key(c16, net) != artifact_key(c8, net)
    assert artifact_path(c8, net).name.startswith("controlnet-fp8-1024x1024-")
    labels = [t.label for t in targets([Shape(2, 1024, 1024, True)], True, "fp8")]
    assert labels == ["unet 1024x1024 fp8", "controlnet 1024x1024 fp8"]


CONTROL = Shape(4, SIDE, SIDE, True)


def test_the_fp8_controlnet_artifact_computes_the_fp8_net(artifacts):
    """The first ControlNet's FP8 artifact against the same FP8 arithmetic in eager PyTorch: equal to rounding; its
    residuals against the float net's, and the whole step's prediction against eager: the quantisation's error, real and
    inside the check's limit. Its input scales are calibrated on the net with a control image, stored apart from the
    UNet's."""
    from storyboard_cli.engine.conditions.control import embedding_apart
    from storyboard_cli.engine.eager import controlnet_call

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    k = CompiledKernels(models, None, root=artifacts, variant="fp8")
    assert k.want(k.targets([CONTROL])) == [] and k.ready(*CONTROL) is None
    assert k.variants(*CONTROL) == ["fp8", "compiled"]
    scales = k.constants["fp8"]
    assert set(scales.x_scales) == {"unet", "controlnet"} and len(scales.files) == 2
    assert "UNet and ControlNet kernels in FP8" in scales.note
    net = models.controlnets[0]
    assert set(json.loads(scales.files[1].read_text())["amax"]) == set(F.quantised(net)) == set(F.linears(net))
    reference = fp8_reference(models, scales, "controlnet")
    assert k.bind("compiled", SIDE, SIDE, True)  # the fp16 kernels to compare with: spare until a graph needs them
    k.reserve(CONTROL.batch, SIDE * SIDE)
    for rows in (2, 8):
        inputs = step_inputs(models, rows, True, seed=rows)
        with torch.no_grad():
            got = torch.cat([r.flatten() for r in k.calls_for("fp8").controlnet(*inputs)])
            want = torch.cat([r.flatten() for r in controlnet_call(embedding_apart(reference), *inputs)])
            full = torch.cat([r.flatten() for r in controlnet_call(embedding_apart(net), *inputs)])
            step = run_calls(k.calls_for("fp8"), *inputs)
            step_full = run_calls(StepCalls.eager(models), *inputs)
            step_fp16 = run_calls(k.calls_for("compiled"), *inputs)
        assert rel_error(got, want) < min(FP8_TWINS, rel_error(want, full) / 2)
        assert 1e-3 < rel_error(got, full) < CHECK_RTOL
        assert rel_error(step_fp16, step_full) < 1e-4 and 1e-3 < rel_error(step, step_full) < CHECK_RTOL


def test_a_control_shape_runs_fp8_only_with_the_fp8_controlnet(tmp_path, artifacts):
    """With --fp8 a shape with a control image runs FP8 once both FP8 artifacts of its size are loaded; with the FP8
    UNet alone it runs on the fp16 UNet and ControlNet the cache has (never built), and a shape without control runs FP8.
    A fresh cache wants both FP8 artifacts built."""
    import shutil

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    assert [t.label for t in k.want(k.targets([CONTROL]))] == ["unet 128x128 fp8", "controlnet 128x128 fp8"]
    for f in [*artifacts.glob("unet-128x128-*"), *artifacts.glob("unet-fp8-*"), *artifacts.glob("controlnet-128x128-*"),
              *artifacts.glob("fp8-scales-*")]:
        shutil.copy(f, tmp_path / f.name)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    assert [t.label for t in k.want(k.targets([CONTROL]))] == ["controlnet 128x128 fp8"]
    assert k.variants(*CONTROL) == ["compiled"] and k.variants(4, SIDE, SIDE, False) == ["fp8", "compiled"]
    assert k.ready(*CONTROL) == "no compiled kernels for controlnet 128x128 fp8 yet"


@pytest.mark.parametrize("kind,compile,device,needle", [
    ("auto", "off", "cuda", "--compile auto or on"), ("eager", "auto", "cuda", "--engine auto or graph"),
    ("auto", "auto", "cpu", "needs a CUDA GPU")])
def test_fp8_options_are_refused_where_they_cannot_run(kind, compile, device, needle, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no capability query on a machine without one
    with pytest.raises(BadInput, match=needle):
        check_engine(kind, compile, torch.device(device), kernels="fp8")


def test_render_fp8_on_the_cpu_is_one_line_exit_2(tmp_path):
    from storyboard_cli.cli import app

    result = CliRunner().invoke(app, ["render", str(ROOT / "jobs" / "episode1.yaml"), "--fp8", "--device", "cpu",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--kernels fp8 needs a CUDA GPU" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["worker", "--server", "http://127.0.0.1:9", "--fp8", "--device", "cpu"],
                                  ["serve", "--gpus", "cpu", "--fp8"]])
def test_a_service_with_fp8_on_the_cpu_is_refused_before_it_starts(argv, tmp_path, monkeypatch):
    from storyboard_cli.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert "--kernels fp8" in result.output and "Traceback" not in result.output


def test_serve_fp8_starts_its_workers_with_fp8(tmp_path):
    from storyboard_cli.serve.server import ServeOptions, worker_command

    def kernels(argv):
        return argv[argv.index("--kernels") + 1]

    argv, _ = worker_command("http://127.0.0.1:8188", "0", ServeOptions(root=tmp_path, kernels="fp8"))
    assert kernels(argv) == "fp8"
    assert kernels(worker_command("http://127.0.0.1:8188", "0", ServeOptions(root=tmp_path))[0]) == "auto"


def test_a_size_runs_fp8_then_fp16_compiled_then_plain(tmp_path):
    """With --fp8 a size runs on the best kernels loaded: its fp16 ones (from the cache) while the FP8 ones build,
    FP8 once they land; an FP8 graph that fails its capture or check falls back to the fp16 kernels, those to the
    plain graph, in one loop within the batch. (The kernels are stand-ins whose captures fail: which graph a shape
    gets is the runner's choice, made before any capture; the plain graph replays its step on the CPU.)"""

    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k)
    shape = (2, SIDE, SIDE, False)
    assert runner.shape_key(*shape).variant == "plain"
    k.calls[k.unet_target(SIDE, SIDE, "compiled")] = "fp16 kernels"
    assert runner.shape_key(*shape).variant == "compiled"  # the FP8 kernels are still building
    k.calls[k.unet_target(SIDE, SIDE)] = "fp8 kernels"
    fp8 = runner.shape_key(*shape)
    assert fp8.variant == "fp8" and fp8.label.endswith(" fp8")
    assert k.calls_for("fp8").unet.keywords == {"variant": "fp8"}
    captured = stand_in_captures(runner)
    x, cond, _, guidance = synthetic_inputs(models, 2, SIDE, SIDE, False)
    sched = schedule("euler", 3, models.scheduler_config)
    got = runner.sample(x, sched, None, cond, None, guidance)
    assert torch.equal(got, EagerEngine(models).sample(x, sched, None, cond, None, guidance))
    assert captured == ["fp8", "compiled", "plain"]
    compiled = replace(fp8, variant="compiled")
    assert runner.stats[fp8].state == "compiled" and "fp8 kernels are stand-ins" in runner.stats[fp8].reason
    assert runner.stats[compiled].state == "plain" and runner.shape_key(*shape).variant == "plain"
    assert runner.stats_of(Shape(*shape)).state == "graph" and runner.stats_of(Shape(*shape)).checked
    assert runner.graph(fp8) is None and runner.graph(compiled) is None  # a variant that fell back: never again
    # the other sizes keep their best variant; a shape with a ControlNet needs the ControlNet's kernels too
    assert runner.shape_key(2, 2 * SIDE, SIDE, False).variant == "plain"
    assert k.variants(2, SIDE, SIDE, True) == []


def test_the_kernels_to_fall_back_on_load_when_a_graph_first_needs_them(tmp_path):
    """With --fp8 the fp16 kernels the cache has are spare: listed as the size's next row but not loaded (a render
    whose FP8 graphs hold never pays their load). A graph that falls back to them loads them before its capture; a
    spare artifact that does not load sends the size past its row, with the reason, and stays out of the list."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k)
    fp16 = k.unet_target(SIDE, SIDE, "compiled")
    k.calls[k.unet_target(SIDE, SIDE)] = "fp8 kernels"
    k.spare[fp16] = tmp_path / "broken.pt2"
    (tmp_path / "broken.pt2").write_bytes(b"not an artifact")
    shape = (2, SIDE, SIDE, False)
    assert k.variants(*shape) == ["fp8", "compiled"] and k.loaded(SIDE, SIDE) == ["fp8"]
    captured = stand_in_captures(runner)
    x, cond, _, guidance = synthetic_inputs(models, 2, SIDE, SIDE, False)
    runner.sample(x, schedule("euler", 2, models.scheduler_config), None, cond, None, guidance)
    assert captured == ["fp8", "plain"]  # the fp16 row's capture never ran: its kernels did not load
    compiled = replace(runner.shape_key(2, SIDE, SIDE, False), variant="compiled")
    assert runner.stats[compiled].state == "plain" and "did not load" in runner.stats[compiled].reason
    assert not k.spare and fp16 not in k.calls and k.variants(*shape) == ["fp8"]
    assert any("broken.pt2" in n for n in k.notes)

    loaded = []
    k2 = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    k2.calls[k2.unet_target(SIDE, SIDE)] = "fp8 kernels"
    k2.spare[fp16] = tmp_path / "fp16.pt2"
    k2.add = lambda t, path: loaded.append((t, path.name)) or k2.calls.setdefault(t, "fp16 kernels") is not None
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k2)
    captured = stand_in_captures(runner)
    runner.sample(x, schedule("euler", 2, models.scheduler_config), None, cond, None, guidance)
    assert captured == ["fp8", "compiled", "plain"] and loaded == [(fp16, "fp16.pt2")] and not k2.spare


def test_a_deferred_artifact_that_does_not_load_at_its_capture_falls_back_and_is_built_again(tmp_path):
    """A render defers its best kernels to each graph's first capture (`want(defer=True)`). One that does not load
    then is what a broken one was at `want`: the size goes past its row (to plain here: no fp16 kernels), with the
    reason, and the artifact and its marker are removed and wanted again, for the background build."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels.artifacts import _digest
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    best = k.unet_target(SIDE, SIDE)
    path = k.path(best)
    path.write_bytes(b"not an artifact")
    path.with_suffix(".ok").write_text(f"loaded {_digest(path)}\n")  # it passed its load check
    assert k.want(k.targets([Shape(2, SIDE, SIDE, False)]), defer=True) == []
    assert k.deferred() == [best] and not k.calls and k.variants(2, SIDE, SIDE, False) == ["fp8"]
    assert "1 in the cache, each loaded before its graph's first capture" in k.load_note(), k.load_note()
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k)
    captured = stand_in_captures(runner)
    x, cond, _, guidance = synthetic_inputs(models, 2, SIDE, SIDE, False)
    runner.sample(x, schedule("euler", 2, models.scheduler_config), None, cond, None, guidance)
    assert captured == ["plain"]  # the FP8 capture never ran: its kernels did not load
    fp8 = replace(runner.shape_key(2, SIDE, SIDE, False), variant="fp8")
    assert runner.stats[fp8].state == "plain" and "did not load" in runner.stats[fp8].reason
    assert runner.stats[fp8].load_s > 0
    assert k.waiting == [best] and not path.exists() and not path.with_suffix(".ok").exists()
    assert not k.deferred() and k.variants(2, SIDE, SIDE, False) == []
    assert any(path.name in n and "not used" in n for n in k.notes), k.notes


def test_fp8_loads_the_fp16_unet_the_cache_has_and_builds_only_fp8(tmp_path, artifacts):
    """`want` with --fp8: a size's fp16 UNet is loaded where the cache has it (never built), its FP8 one is what is
    built; with both loaded the size runs FP8, and both compute what they should."""
    import shutil

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    assert [t.label for t in k.want(k.targets([SHAPE]))] == ["unet 128x128 fp8"]  # wanted: the FP8 one only
    for f in [*artifacts.glob("unet-128x128-*"), *artifacts.glob("unet-fp8-*")]:
        shutil.copy(f, tmp_path / f.name)
    k = CompiledKernels(models, None, root=tmp_path, variant="fp8")
    assert k.want(k.targets([SHAPE])) == []
    assert k.variants(*SHAPE) == ["fp8", "compiled"]
    assert k.loaded(SIDE, SIDE) == ["fp8"]  # the fp16 kernels are spare: loaded when a graph runs on them
    assert k.bind("compiled", SIDE, SIDE, False) and k.loaded(SIDE, SIDE) == ["fp8", "compiled"] and not k.spare
    k.reserve(SHAPE.batch, SIDE * SIDE)
    inputs = _unet_only(step_inputs(models, 4, False, seed=4))
    with torch.no_grad():
        full = run_calls(StepCalls.eager(models), *inputs)
        fp16 = run_calls(k.calls_for("compiled"), *inputs)
        fp8 = run_calls(k.calls_for("fp8"), *inputs)
    assert rel_error(fp16, full) < 1e-4 and 1e-3 < rel_error(fp8, full) < CHECK_RTOL


def stand_in_captures(runner):
    """Make `runner` capture only its plain graphs: a kernel variant's capture raises, as stand-in kernels would.
    Returns the list the variants tried are appended to, in order."""
    from types import SimpleNamespace

    captured = []

    def capture(key):
        captured.append(key.variant)
        if key.variant != "plain":
            raise RuntimeError(f"{key.variant} kernels are stand-ins")
        return SimpleNamespace(replay=lambda: runner.stepper(runner.buf.view(key)))

    runner.capturer = capture
    return captured
