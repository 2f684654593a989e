"""Compiled denoiser artifacts on the CPU (AOTInductor builds CPU code too): the child-process builds,
one per module and size, the cache key, the lock that keeps two processes from building one artifact,
loading with the rendering modules' own weights (fused attention views, channels_last conv copies),
in-place weight writes reaching them, the zero residuals, fallbacks.

The tiny UNet and ControlNet artifacts (128x128) are conftest's `artifacts`, built once a session (about a minute
on two cores; the tests that ask for them are `slow`); the GPU side (compiled kernels inside CUDA graphs) is tests/test_gpu_compiled.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from storyboard_cli.bench.synthetic_lora import unet_targets
from storyboard_cli.engine.base import Shape
from storyboard_cli.engine.eager import StepCalls
from storyboard_cli.engine.kernels.artifacts import (Target, artifact_key, artifact_path, fits, loads_here, module_of,
                                                     targets)
from storyboard_cli.engine.kernels.builds import Builds
from storyboard_cli.engine.kernels.calls import CompiledKernels
from storyboard_cli.engine.kernels.export import example_inputs
from storyboard_cli.models.loader import load_sdxl

from helpers.kernels import H100_SXM, SIDE, OnGpu, fake_gpu, loads_in_a_new_process, run_calls, step_inputs
from helpers.reference import rel_error


def kernels(models, root, builds=None) -> CompiledKernels:
    k = CompiledKernels(models, builds, root=root)
    k.want(targets([Shape(4, SIDE, SIDE, True)], bool(models.controlnets)))
    return k


@pytest.fixture(scope="module")
def models_cn():
    return load_sdxl("tiny", "tiny", "cpu", torch.float32)


@pytest.mark.parametrize("rows,control", [(2, False), (8, False), (4, True), (16, True)])
def test_compiled_calls_match_the_modules_at_any_row_count(artifacts, models_cn, rows, control):
    k = kernels(models_cn, artifacts)
    assert k.waiting == [] and k.ready(rows // 2, SIDE, SIDE, control) is None
    k.reserve(rows // 2, SIDE * SIDE)
    inputs = step_inputs(models_cn, rows, control)
    with torch.no_grad():
        got, expect = run_calls(k, *inputs), run_calls(StepCalls.eager(models_cn), *inputs)
    assert got.shape == expect.shape
    assert rel_error(got, expect) < 1e-4


def test_the_rendering_modules_keep_their_own_attention_and_layout(artifacts):
    """The plain step must not change by a bit: q/k/v are views into the fused weight, convolutions
    keep their NCHW weights (the channels_last ones are copies)."""
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    attn = models.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1
    processor = type(attn.processor)
    inputs = step_inputs(models, 2, False)
    with torch.no_grad():
        before = run_calls(StepCalls.eager(models), *inputs)
        kernels(models, artifacts)
        after = run_calls(StepCalls.eager(models), *inputs)
    assert torch.equal(before, after)
    assert type(attn.processor) is processor
    assert attn.to_q.weight.data_ptr() == attn.to_qkv.weight.data_ptr()
    assert models.unet.conv_in.weight.is_contiguous()
    # a LoRA names the projections, never the fused weight (the GPU LoRA test's synthetic file is made so)
    names = unet_targets(models.unet)
    assert "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q" in names
    assert not [n for n in names if n.endswith(("to_qkv", "to_kv"))]


def test_a_lora_swap_reaches_the_compiled_kernels(artifacts):
    """A LoRA swap writes in place: into to_q (a view of the fused weight) and into a convolution
    (whose channels_last copy follows); the artifact sees both, with no pointer changed, and the
    empty set restores them bit for bit."""
    from pathlib import Path

    from storyboard_cli.models.lora import LoraApplier, LoraLayer, LoraWeights

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = kernels(models, artifacts)
    k.reserve(1, SIDE * SIDE)
    inputs = step_inputs(models, 2, False, seed=3)
    attn = "down_blocks.1.attentions.0.transformer_blocks.0.attn1"
    conv = models.unet.down_blocks[0].resnets[0].conv1
    g = torch.Generator().manual_seed(5)
    q_in = models.unet.get_submodule(f"{attn}.to_q").weight.shape[1]
    c_out, c_in = conv.weight.shape[:2]
    layers = [LoraLayer("unet", f"{attn}.to_q", torch.randn(4, q_in, generator=g), torch.randn(q_in, 4, generator=g), 4.0),
              LoraLayer("unet", "down_blocks.0.resnets.0.conv1", torch.randn(4, c_in, 3, 3, generator=g),
                        torch.randn(c_out, 4, 1, 1, generator=g), 4.0)]
    lora = LoraWeights("x", Path("x.safetensors"), "0" * 64, layers)
    copy = models.copy_of(conv.weight, None)  # registered when the artifact was bound
    fused = models.unet.get_submodule(attn).to_qkv.weight
    ptrs = (fused.data_ptr(), copy.data_ptr(), conv.weight.data_ptr())
    applier = LoraApplier(models)
    with torch.no_grad():
        before = run_calls(k, *inputs)
        applier.apply({"x": (lora, 0.5)})
        after, expect = run_calls(k, *inputs), run_calls(StepCalls.eager(models), *inputs)
        assert torch.equal(copy, conv.weight) and copy.is_contiguous(memory_format=torch.channels_last)
        applier.restore()
        restored = run_calls(k, *inputs)
    assert (fused.data_ptr(), copy.data_ptr(), conv.weight.data_ptr()) == ptrs
    assert rel_error(after, before) > 1e-3
    assert rel_error(after, expect) < 1e-4
    assert torch.equal(restored, before)


@pytest.mark.parametrize("module", ["unet", "controlnet"])
def test_the_timestep_is_exported_as_float32_whatever_the_default_dtype(models_cn, module):
    """A build child sets the default dtype to the model's; the step passes a float32 timestep, and an artifact reads
    each input as the dtype it was exported with, unchecked (an fp16 timestep read 500.0 as 0.0 on the H200)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        args = example_inputs(module, module_of(models_cn, module), 2, 16, 16)
    finally:
        torch.set_default_dtype(before)
    assert args[1].dtype == torch.float32 and args[1].dim() == 0


def test_shapes_outside_the_compiled_ranges_are_named():
    assert fits(8, 1024, 1024) is None
    assert fits(1, 832, 1216) is None
    assert "exceed" in fits(16, 1024, 1024)
    assert "outside" in fits(1, 1000, 1000)
    assert "outside" in fits(1, 4096, 1024)


def test_one_artifact_per_module_and_size():
    shapes = [Shape(8, 1024, 1024, False), Shape(1, 1024, 1024, True), Shape(2, 832, 1216, False),
              Shape(4, 1000, 1000, False)]
    assert [t.label for t in targets(shapes, controlnet=True)] == ["unet 1024x1024", "unet 1216x832",
                                                                  "controlnet 1024x1024"]
    assert [t.label for t in targets(shapes, controlnet=False)] == ["unet 1024x1024", "unet 1216x832"]


def test_the_key_follows_what_changes_the_code(models_cn):
    unet, square = models_cn.unet, Target("unet", 128, 128)
    key = artifact_key(square, unet)
    assert key == artifact_key(square, unet)
    assert key != artifact_key(Target("unet", 128, 192), unet)
    assert key != artifact_key(Target("controlnet", 128, 128), unet)
    half = load_sdxl("tiny", None, "cpu", torch.bfloat16).unet
    assert artifact_key(square, half) != key


def test_a_gpus_key_names_its_chip_not_its_name(models_cn, monkeypatch):
    """An artifact built on one card is the one another card of the same chip and configuration looks up (an H100
    SXM's and an H200's: the same 132 SMs, other memory, L2 and name; the H200's properties as its device call read
    them), never one whose SMs, capability or shared memory differ; a property an older torch lacks counts as None."""
    from storyboard_cli.engine.kernels import artifacts

    card: dict = {}
    fake_gpu(monkeypatch, card)
    square = Target("unet", 128, 128)

    def key(**change) -> str:
        card.clear()
        card.update(H100_SXM, **change)
        return artifact_key(square, OnGpu(models_cn.unet))

    built = key()
    assert key(name="NVIDIA H200", total_memory=141 << 30, L2_cache_size=60 << 20) == built
    assert key(multi_processor_count=114, name="NVIDIA H100 PCIe") != built
    assert key(capability=(8, 9)) != built
    assert key(shared_memory_per_block_optin=101376) != built
    assert built != artifact_key(square, models_cn.unet)  # the CPU's
    card.pop("regs_per_multiprocessor")
    assert artifacts.gpu_facts(torch.device("cuda", 0))["regs_per_multiprocessor"] is None


def test_the_unets_skip_concatenations_are_exported_nhwc(models_cn):
    """The up blocks' torch.cat of hidden states and skip, exported while SkipCatNhwc is on: the same values, laid out
    NHWC (the buffer the GroupNorm and the 1x1 shortcut read); other concatenations as they were."""
    import copy

    from storyboard_cli.engine.kernels.export import SkipCatNhwc, export

    a, b = torch.randn(2, 6, 4, 5), torch.randn(2, 3, 4, 5)
    with SkipCatNhwc():
        got = torch.cat([a, b], dim=1)
        flat = torch.cat([a.flatten(1), b.flatten(1)], dim=1)  # not 4-d
        rows = torch.cat([a, a], dim=0)  # not the channels
    assert torch.equal(got, torch.cat([a, b], dim=1)) and got.is_contiguous(memory_format=torch.channels_last)
    assert not got.is_contiguous()
    assert flat.is_contiguous() and rows.is_contiguous() and torch.equal(rows, torch.cat([a, a]))

    def cats(module: str) -> list[tuple[int, int]]:  # (dim, rank) of each aten.cat in the export
        model = copy.deepcopy(module_of(models_cn, module))
        graph = export(Target(module, SIDE, SIDE), model).graph_module.graph
        nodes = [n for n in graph.nodes if n.target == torch.ops.aten.cat.default]
        return [(n.args[1], n.args[0][0].meta["val"].dim()) for n in nodes]

    unet = cats("unet")
    skips = sum(len(block.resnets) for block in models_cn.unet.up_blocks)
    assert sorted(c for c in unet if c[1] == 4) == [(3, 4)] * skips  # each along NHWC's channels
    assert all(rank != 4 for _, rank in cats("controlnet"))  # its key stays: tests/test_conditions.py PINNED_KEYS


def test_a_corrupt_artifact_is_reported_and_never_crashes(tmp_path, artifacts):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    unet = Target("unet", SIDE, SIDE)
    good = artifact_path(unet, models.unet, artifacts)
    bad = artifact_path(unet, models.unet, tmp_path)
    bad.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 3])  # a truncated copy
    k = kernels(models, tmp_path)
    assert k.ready(1, SIDE, SIDE, False) is not None and "not used" in k.notes[0]
    assert k.waiting == [unet] and not bad.exists()  # out of the way: a build replaces it, no render tries it again


def test_a_copied_cache_keeps_its_load_markers(tmp_path, artifacts, monkeypatch):
    """A cache copied to another folder or machine (newer file times, markers copied first) is trusted by
    its digests: no child-process load check per artifact (tens of seconds each on a GPU)."""
    import shutil

    for f in sorted(artifacts.glob("unet-128x128-*"), key=lambda f: f.suffix != ".ok"):  # markers first, as `cp *` does
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr("storyboard_cli.engine.kernels.artifacts.subprocess.run",
                        lambda *a, **k: pytest.fail("a load check ran"))
    (path,) = tmp_path.glob("unet-*.pt2")
    assert loads_here(path)
    path.write_bytes(path.read_bytes()[:4096])  # not the artifact the marker vouches for
    monkeypatch.undo()
    assert not loads_here(path) and path.with_suffix(".bad").is_file()


def test_no_artifact_means_plain_with_a_reason(tmp_path):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    k = kernels(models, tmp_path)
    assert "no compiled kernels for unet 128x128 yet" in k.ready(1, SIDE, SIDE, False)


def test_a_second_build_of_one_artifact_waits_for_the_first(tmp_path):
    """Two processes wanting one artifact: the second sees the first's lock and never starts a build."""
    import fcntl

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    target = Target("unet", SIDE, SIDE)
    path = artifact_path(target, models.unet, tmp_path)
    with open(path.with_suffix(".lock"), "a+") as held:  # another process's build, in progress
        fcntl.flock(held, fcntl.LOCK_EX)
        builds = Builds(models.device)
        builds.want([(target, path, models.unet)])
        assert builds.builds[target].state == "elsewhere" and builds.builds[target].proc is None
        path.write_bytes(b"built")  # the other build finishes...
        assert builds.poll() == []  # ...but holds the lock until its process is done
    (ready,) = builds.poll()
    assert ready[0] == target and builds.active == []


def test_a_build_that_fails_is_remembered_and_named(tmp_path):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    target = Target("unet", SIDE, SIDE)
    path = artifact_path(target, models.unet, tmp_path)
    path.with_suffix(".failed").write_text("the compiler said no\n")
    notes = []
    builds = Builds(models.device, notes=notes)
    builds.want([(target, path, models.unet)])
    assert builds.active == [] and "the compiler said no" in notes[0] and "--warm" in notes[0]


@pytest.mark.slow
def test_a_killed_build_child_fails_with_its_signal(tmp_path, monkeypatch):
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    target = Target("unet", SIDE, SIDE)
    path = artifact_path(target, models.unet, tmp_path)
    notes = []
    builds = Builds(models.device, notes=notes)
    builds.want([(target, path, models.unet)])
    proc = builds.builds[target].proc
    proc.kill()
    proc.wait()
    deadline = time.time() + 30
    while builds.active and time.time() < deadline:
        builds.poll()
    assert "killed by signal 9" in notes[0] and path.with_suffix(".failed").is_file() and not path.exists()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the child's environment through /proc")
@pytest.mark.parametrize("threads", [None, "1"])
def test_a_build_child_gets_every_core_for_its_compile_workers_unless_the_environment_says(tmp_path, monkeypatch,
                                                                                           threads):
    if threads is None:
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", threads)
    models = load_sdxl("tiny", None, "cpu", torch.float32)
    target = Target("unet", SIDE, SIDE)
    builds = Builds(models.device)
    builds.want([(target, artifact_path(target, models.unet, tmp_path), models.unet)])
    proc = builds.builds[target].proc
    try:
        # until the child has exec'd the build module, /proc shows the forked parent's image (or nothing)
        deadline = time.time() + 30
        while b"storyboard_cli.engine.kernels.builds" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.time() < deadline and proc.poll() is None, "the build child never started"
            time.sleep(0.01)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        proc.kill()
        proc.wait()
    want = threads or str(len(os.sched_getaffinity(0)))
    assert f"TORCHINDUCTOR_COMPILE_THREADS={want}".encode() in environ


def test_a_size_switches_to_its_compiled_kernels_when_its_build_lands(artifacts, tmp_path):
    """Between batches the runner looks at the builds: a size is plain until its kernels land, then
    compiled (a graph of its own, captured and checked on its next batch)."""
    from storyboard_cli.engine.graph.runner import GraphRunner

    class Later:  # builds that finish at their second poll, into the session's artifacts
        def __init__(self):
            self.builds, self.polls = {}, 0

        def want(self, wanted):
            self.builds.update({t: artifacts / path.name for t, path, _ in wanted})

        def poll(self):
            self.polls += 1
            return [(t, path, 12.0) for t, path in self.builds.items()] if self.polls == 2 else []

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    notes = []
    runner = GraphRunner(models, max_batch=1, max_hw=(SIDE, SIDE),
                         compiled=CompiledKernels(models, Later(), notes, root=tmp_path))
    runner.capturer = lambda key: object()  # the bookkeeping of a capture, without a GPU
    runner.prepare([Shape(1, SIDE, SIDE, False)])  # nothing cached: the plain graph, and a build started
    assert runner.shape_key(1, SIDE, SIDE, False).variant == "plain" and "in the background" in notes[0]
    runner.compiled.poll()  # not finished yet
    assert runner.shape_key(1, SIDE, SIDE, False).variant == "plain"
    runner.compiled.poll()
    key = runner.shape_key(1, SIDE, SIDE, False)
    assert key.variant == "compiled" and "ready after 12 s" in notes[-1]
    runner.graph(key)
    assert runner.stats[key].compile_s == 12.0


def test_a_builds_record_says_where_its_compile_time_went(artifacts):
    """Each build's record has the compiler's timed phases (`artifacts.compile_phases`), which nest inside its compile:
    the longest holds most of `compile_s`, none more than all of it."""
    records = [json.loads(f.read_text()) for f in artifacts.glob("*.build.json")]
    assert len(records) == 7, records
    for r in records:
        phases = r["phases_s"]
        assert phases and list(phases.values()) == sorted(phases.values(), reverse=True), r
        assert 0.5 * r["compile_s"] <= max(phases.values()) <= r["compile_s"] + 0.1, r


def test_a_second_process_loads_from_the_cache(artifacts):
    assert loads_in_a_new_process(artifacts, "cpu", "float32", "tiny") == "loaded"


@pytest.mark.parametrize("rows", [2, 8])
def test_a_unet_with_an_ip_adapter_compiles_with_the_reference_inputs(artifacts, rows):
    """The adapter's UNet artifact takes the step's tokens, per-row scales and slot masks: rows with one, two and no
    references (scale 0) give what the modules give, and its key is not the plain UNet's."""
    from storyboard_cli.engine.conditions.reference import references

    models = load_sdxl("tiny", None, "cpu", torch.float32, "tiny")
    k = CompiledKernels(models, None, root=artifacts)
    k.want(k.targets([Shape(rows // 2, SIDE, SIDE, False)]))
    assert k.waiting == [] and k.ready(rows // 2, SIDE, SIDE, False) is None
    plain = Target("unet", SIDE, SIDE)
    assert artifact_key(k.unet_target(SIDE, SIDE), models.unet) != artifact_key(plain, models.unet)
    k.reserve(rows // 2, SIDE * SIDE)
    latents, t, embeds, pooled, time_ids, _, _ = step_inputs(models, rows, False)
    g = torch.Generator().manual_seed(2)
    adapter = models.ip_adapter
    tokens = [torch.randn(adapter.tokens, adapter.dim, generator=g) for _ in range(3)]
    per_row = [[tokens[0]], tokens[1:], []] * rows
    refs = references(per_row[: rows // 2], adapter.negative, [0.9, 0.5, 0.0] * rows, 4).attention()
    with torch.no_grad():
        got = k.unet(latents, t, embeds, pooled, time_ids, None, None, refs)
        want = StepCalls.eager(models).unet(latents, t, embeds, pooled, time_ids, None, None, refs)
        without = StepCalls.eager(models).unet(latents, t, embeds, pooled, time_ids, None, None)
    assert rel_error(got, want) < 1e-4
    assert rel_error(without, want) > 1e-3  # the references are in the comparison


@pytest.mark.parametrize("adapter,tag", [(None, "regions2"), ("tiny", "regions2x4x4")])
def test_a_unet_with_regions_runs_compiled_and_its_replays_equal_eager(artifacts, adapter, tag):
    """The regions' UNet artifact takes the prompts' keys and the per-level masks (with an IP-Adapter, the regional
    references' tokens and weights too) as the graphs hand them over (views of the static buffers, the masks' rows
    padded): a batch with 2, 0 and 1 regions on the compiled graph gives the eager loop's latents, and the regions are
    in the comparison."""
    from storyboard_cli.engine.conditioning import PromptCache, conditioning
    from storyboard_cli.engine.conditions.kind import Conditions
    from storyboard_cli.engine.conditions.region import regions_value
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import draw_noise, schedule

    from helpers.graphs import cpu_replays

    models = load_sdxl("tiny", None, "cpu", torch.float32, adapter, regions=2)
    k = CompiledKernels(models, None, root=artifacts)
    assert k.unet_target(SIDE, SIDE).tags == (tag,)
    runner = GraphRunner(models, max_batch=3, max_hw=(SIDE, SIDE), compiled=k)
    captured = cpu_replays(runner)
    runner.prepare([Shape(3, SIDE, SIDE, 0)])
    assert [n for n in k.notes if n.startswith("compiled kernels: 1 artifacts loaded in ")], k.notes  # the cache's
    sched = schedule("euler", 3, models.scheduler_config)
    x, noise = draw_noise([1, 2, 3], 3, (4, SIDE // 8, SIDE // 8), sched)
    cache = PromptCache(models)
    cond = conditioning(cache, ["a harbour"] * 3, ["blurry"] * 3, SIDE, SIDE)
    pixels = [torch.zeros(2, SIDE, SIDE), torch.zeros(0, SIDE, SIDE), torch.zeros(1, SIDE, SIDE)]
    pixels[0][0, :, :64], pixels[0][1, :, 64:], pixels[2][0, 32:96, 32:96] = 1, 1, 1
    embeds = [list(cache.get(["a red coat", "a blue hat"])[0]), [], list(cache.get(["a lantern"])[0])]
    refs = negative = None
    if models.ip_adapter is not None:  # the first row's second region and the third row's region with a reference
        g = torch.Generator().manual_seed(3)
        tokens = [torch.randn(models.ip_adapter.tokens, models.ip_adapter.dim, generator=g) for _ in range(2)]
        refs, negative = [[(1, tokens[0], 0.8)], [], [(0, tokens[1], 0.6)]], models.ip_adapter.negative
    value = regions_value(models.region_layout, models.unet.config.cross_attention_dim, embeds, pixels, refs,
                          negative, models.dtype, models.device)
    guidance = torch.full((3,), 5.0)
    with torch.no_grad():
        want = EagerEngine(models).sample(x, sched, noise, cond, Conditions.of(value), guidance)
        got = runner.sample(x, sched, noise, cond, Conditions.of(value), guidance)
        without = EagerEngine(models).sample(x, sched, noise, cond, Conditions.of(), guidance)
    assert [key.variant for key in captured] == ["compiled"]
    assert rel_error(got, want) < 1e-4
    assert rel_error(without[:1], want[:1]) > 1e-3  # the regions are in the comparison
    if refs is not None:  # and the regional references
        plain = regions_value(models.region_layout, models.unet.config.cross_attention_dim, embeds, pixels, None,
                              None, models.dtype, models.device)
        with torch.no_grad():
            no_refs = EagerEngine(models).sample(x, sched, noise, cond, Conditions.of(plain), guidance)
        assert rel_error(no_refs[2:], want[2:]) > 1e-3


def test_two_nets_run_the_first_nets_kernels_and_the_second_nets_module(artifacts):
    """The ControlNet artifact is bound to the first net's weights; a second net (other weights) runs its own module
    beside it, and the summed residuals feed the compiled UNet: what the modules give."""
    import copy

    from storyboard_cli.engine.conditions.control import Control, embed_guide
    from storyboard_cli.engine.conditions.kind import Step
    from storyboard_cli.steps import FULL

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    other = copy.deepcopy(models.controlnets[0])
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.05)
    models.controlnets = (models.controlnets[0], other)
    k = CompiledKernels(models, None, root=artifacts)
    k.want(k.targets([Shape(2, SIDE, SIDE, 0b11)]))
    assert k.waiting == [] and k.variants(2, SIDE, SIDE, 0b11) == ["compiled"]
    k.reserve(2, SIDE * SIDE)
    latents, t, embeds, pooled, time_ids, guide, scale = step_inputs(models, 4, True)
    image = torch.rand(4, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(5))
    ctl = Control(torch.stack([guide, embed_guide(other, image)]), torch.stack([scale, 0.5 * scale]), (0, 1))

    def run(calls):
        mid, down = ctl.residuals(Step(calls, FULL, latents, t, embeds, pooled, time_ids))
        return calls.unet(latents, t, embeds, pooled, time_ids, mid, down)

    with torch.no_grad():
        got, expect = run(k), run(StepCalls.eager(models))
        wrong = run(StepCalls(k.unet, k.controlnet, (k.controlnet,)))  # the first net's kernels for both guides
    assert rel_error(got, expect) < 1e-4
    assert rel_error(wrong, expect) > 1e-3  # the second net's own weights are in the comparison


def _runner_at_two_row_counts(artifacts, control: int = 0):
    """A graph runner over the tiny UNet's compiled kernels (CPU replays), both shapes of one size prepared, and the
    inputs of a batch of 4 and of 2 (`control`: with the tiny ControlNet's guide, its kernels too)."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    from helpers.graphs import cpu_replays

    models = load_sdxl("tiny", "tiny" if control else None, "cpu", torch.float32)
    k = CompiledKernels(models, None, root=artifacts)
    k.want(k.targets([Shape(4, SIDE, SIDE, control)]))
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k)
    cpu_replays(runner)
    runner.prepare([Shape(4, SIDE, SIDE, control), Shape(2, SIDE, SIDE, control)])
    sched = schedule("euler", 3, models.scheduler_config)
    four, two = ((x, sched, None, cond, conds, guidance)
                 for x, cond, conds, guidance in (synthetic_inputs(models, n, SIDE, SIDE, control) for n in (4, 2)))
    return models, runner, four, two


def test_a_compiled_graph_at_other_rows_is_checked_against_its_kernels_outside_the_graph(artifacts):
    """The first compiled graph of a size is checked against the eager step; the same kernels' graph at other rows
    against its own step run outside the graph (no host-bound eager pass), and both loops equal the eager loop's."""
    from storyboard_cli.engine.eager import EagerEngine

    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    with torch.no_grad():
        got = [runner.sample(*four), runner.sample(*two)]
        want = [EagerEngine(models).sample(*four), EagerEngine(models).sample(*two)]
    assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want))
    reasons = {s.key.batch: (s.key.variant, s.state, s.reason) for s in runner.stats.values()}
    assert reasons[4][:2] == reasons[2][:2] == ("compiled", "graph")
    assert "against" not in reasons[4][2], reasons
    assert reasons[2][2].endswith(
        "against its kernels outside the graph at 1 image (against eager at 4 images)"), reasons


def test_the_one_image_check_runs_the_batchs_guide_for_its_first_image(artifacts):
    """With a ControlNet guide, the check at other rows runs the compiled UNet and ControlNet for the batch's first
    image alone (its guide's rows, its text's): it holds, and the loop equals the eager loop."""
    from storyboard_cli.engine.eager import EagerEngine

    models, runner, four, two = _runner_at_two_row_counts(artifacts, control=1)
    rows = []
    part = runner.part_step
    runner.part_step = lambda v, x, noise, n, *at: (rows.append(v.conds.first_images(n, v.key.batch)),
                                                    part(v, x, noise, n, *at))[1]
    with torch.no_grad():
        got = [runner.sample(*four), runner.sample(*two)]
        want = [EagerEngine(models).sample(*four), EagerEngine(models).sample(*two)]
    assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want))
    (guide,) = [c for c in rows[0] if c.kind == "control"]
    assert guide.guide.shape[1] == 2 and torch.equal(guide.guide, two[4].get("control").guide[:, [0, 2]])
    reasons = {s.key.batch: (s.key.variant, s.state, s.reason) for s in runner.stats.values()}
    assert reasons[2][:2] == ("compiled", "graph") and "at 1 image (against eager at 4 images)" in reasons[2][2]


def test_a_row_whose_rounding_forbids_the_one_image_check_steps_the_whole_batch(artifacts, monkeypatch):
    """A row without `alone_rtol` (FP8's: its first image alone rounds too near its limit) checks the batch's first
    step against the whole batch's step outside the graph, never the first image alone."""
    from dataclasses import replace

    from storyboard_cli.engine import variants
    from storyboard_cli.engine.eager import EagerEngine

    assert variants.VARIANTS["fp8"].alone_rtol is None and variants.VARIANTS["compiled"].alone_rtol is not None
    monkeypatch.setitem(variants.VARIANTS, "compiled", replace(variants.VARIANTS["compiled"], alone_rtol=None))
    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    alone = []
    runner.part_step = lambda *a: alone.append(a)
    with torch.no_grad():
        got = [runner.sample(*four), runner.sample(*two)]
        want = [EagerEngine(models).sample(*four), EagerEngine(models).sample(*two)]
    assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want))
    assert not alone
    reasons = {s.key.batch: (s.key.variant, s.state, s.reason) for s in runner.stats.values()}
    assert reasons[2][:2] == ("compiled", "graph"), reasons
    assert reasons[2][2].endswith("against its kernels outside the graph (against eager at 4 images)"), reasons


def test_the_one_image_check_holds_the_replay_to_its_rows_alone_rtol(artifacts, monkeypatch):
    """The one-image comparison's limit is the row's `alone_rtol`, not its `check_rtol`: under a limit no rounding
    meets, the graph at 2 images fails its one-image check and falls back with that limit in its reason, while the
    graph at 4 images, checked against eager at `check_rtol`, holds."""
    from dataclasses import replace

    from storyboard_cli.engine import variants

    monkeypatch.setitem(variants.VARIANTS, "compiled", replace(variants.VARIANTS["compiled"], alone_rtol=-1.0))
    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    with torch.no_grad():
        runner.sample(*four)
        runner.sample(*two)
    stats = {s.key.batch: s for s in runner.stats.values() if s.key.variant == "compiled"}
    assert stats[4].state == "graph", stats[4].reason
    assert stats[2].state == "plain", stats[2].reason
    assert "replay check failed: relative error" in stats[2].reason and "> -1e+00" in stats[2].reason, stats[2].reason
    assert "outside the graph at 1 image" in stats[2].reason, stats[2].reason


def test_a_broken_capture_at_other_rows_fails_its_check_against_the_kernels(artifacts):
    """The reference outside the graph is the step itself, not the graph: a replay that writes wrong latents at the
    second row count fails its check and falls back, as a failed eager check does."""
    from storyboard_cli.engine.eager import EagerEngine

    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    runner.stepper = lambda v: (runner.step(v), v.x.mul_(1.5) if v.key.batch == 2 else None)
    with torch.no_grad():
        runner.sample(*four)
        got = runner.sample(*two)
        want = EagerEngine(models).sample(*two)
    assert torch.equal(got, want)  # every graph of the 2 rows fell back: the eager engine ran them
    failed = {s.key.variant: s for s in runner.stats.values() if s.key.batch == 2}
    assert failed["compiled"].state == "plain", failed
    assert "replay check failed" in failed["compiled"].reason and "against its kernels" in failed["compiled"].reason


def test_a_capture_that_breaks_only_the_other_images_rows_with_nan_fails_the_one_image_check(artifacts):
    """The first-step check at other rows compares the first image alone: a replay that leaves another image's
    latents NaN fails it too (every image's latents must be finite), and the shape falls back."""
    from storyboard_cli.engine.eager import EagerEngine

    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    runner.stepper = lambda v: (runner.step(v), v.x[1:].fill_(float("nan")) if v.key.batch == 2 else None)
    with torch.no_grad():
        runner.sample(*four)
        got = runner.sample(*two)
        want = EagerEngine(models).sample(*two)
    assert torch.equal(got, want)
    failed = next(s for s in runner.stats.values() if s.key.batch == 2 and s.key.variant == "compiled")
    assert failed.state == "plain" and "NaN/inf in the latents of the batch's other images" in failed.reason


def test_after_a_weight_write_a_graph_at_other_rows_is_checked_against_eager_again(artifacts):
    """The check against the kernels outside the graph holds for the weights the eager check saw: after an in-place
    write (a LoRA swap, SdxlModels.written) the next shape's first replay is compared with the eager step again."""
    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    with torch.no_grad():
        runner.sample(*four)
        models.written(models.unet.conv_in.weight)
        runner.sample(*two)
    reasons = {s.key.batch: s.reason for s in runner.stats.values()}
    assert reasons[2].startswith("checked: ") and "against" not in reasons[2], reasons


@pytest.mark.parametrize("sampler", ["euler", "euler_a"])
def test_a_graph_checked_against_its_kernels_is_checked_on_its_batchs_first_step(artifacts, sampler):
    """Where the check's reference is the graph's own kernels outside the graph, the check is the batch's first step
    (its noise too, with an ancestral sampler): one step outside the graph beside the batch's replays (no extra replay
    at guidance 1), and the batch keeps the graph's own first step, so its latents do not depend on whether it was its
    shape's first batch; both equal the eager loop's."""
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.sampling import draw_noise, schedule

    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    if sampler != "euler":
        sched = schedule(sampler, 3, models.scheduler_config)
        x, noise = draw_noise([5, 6], 3, tuple(two[0].shape[1:]), sched)
        two = (x, sched, noise, *two[3:])
        assert noise is not None
    replays, direct = [], []
    step, part = runner.step, runner.part_step
    runner.step = lambda v: (direct.append(v.key.batch), step(v))[1]
    runner.part_step = lambda v, x, noise, n, *at: (direct.append(n), part(v, x, noise, n, *at))[1]
    # each replay a hair off the step outside the graph (within the check's limit): what the batch keeps is visible
    runner.stepper = lambda v: (replays.append(v.key.batch), step(v), v.x.mul_(1 + 1e-5))
    steps = four[1].steps
    with torch.no_grad():
        runner.sample(*four)
        replays.clear()
        direct.clear()
        first = runner.sample(*two)
        assert (replays, direct) == ([2] * steps, [1])  # the check: one image's step outside the graph, no replay more
        again = runner.sample(*two)
        assert replays == [2] * 2 * steps and direct == [1]  # checked once
    assert torch.equal(first, again)
    with torch.no_grad():
        assert rel_error(first, EagerEngine(models).sample(*two)) < 1e-3
    stats = next(s for s in runner.stats.values() if s.key.batch == 2)
    assert stats.replays == 2 * steps and stats.state == "graph"
    assert stats.reason.endswith("against its kernels outside the graph at 1 image (against eager at 4 images)"), (
        stats.reason)


def _runs_with_a_ledger(artifacts, root):
    """`_runner_at_two_row_counts` with the checks of earlier runs under `root` read and written (a run: new models
    loaded from the cache, new kernels, a new runner)."""
    from storyboard_cli.engine.graph.ledger import CheckLedger

    models, runner, four, two = _runner_at_two_row_counts(artifacts)
    runner.ledger = CheckLedger(models, runner.compiled, root)
    return models, runner, four, two


def _first_reason(runner, batch: int) -> str:
    return next(s.reason for s in runner.stats.values() if s.key.batch == batch and s.key.variant == "compiled")


def test_a_later_run_on_the_same_kernels_and_weights_checks_against_its_kernels_not_eager(artifacts, tmp_path):
    """A run's check against the eager step is kept beside the artifacts; the next run on the same artifacts, weights
    and machine checks its graph of that size against its kernels outside the graph, on its batch's first step (no
    eager step, no extra replay), and its loop equals the eager loop as the first run's did."""
    from storyboard_cli.engine.eager import EagerEngine

    models, first, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    with torch.no_grad():
        was = first.sample(*four)
    assert "against" not in _first_reason(first, 4)
    (record,) = tmp_path.glob("checked-*.json")
    assert '"batch": 4' in record.read_text()

    models, later, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    replays, direct = [], []
    step, part = later.step, later.part_step
    later.step = lambda v: (direct.append(v.key.batch), step(v))[1]
    later.part_step = lambda v, x, noise, n, *at: (direct.append(n), part(v, x, noise, n, *at))[1]
    later.stepper = lambda v: (replays.append(v.key.batch), step(v))
    with torch.no_grad():
        got = later.sample(*four)
        want = EagerEngine(models).sample(*four)
    assert (replays, direct) == ([4] * four[1].steps, [1])
    assert _first_reason(later, 4).endswith("against its kernels outside the graph at 1 image (against eager at 4 "
                                            "images in an earlier run)"), _first_reason(later, 4)
    assert torch.equal(got, was) and rel_error(got, want) < 1e-4


def test_a_later_render_reads_its_record_before_its_kernels_load_and_leaves_its_first_graph_to_its_batch(artifacts,
                                                                                                         tmp_path):
    """A render loads its first batch's kernels just before that batch (CompiledKernels.want's `defer`): the record of
    an earlier run's eager check is read before they load, so `prepare(beside=True)` leaves the first graph to its
    batch (GraphRunner._behind), captured beside the batch's first steps and checked against its kernels, not against
    the eager step; the latents are the earlier run's bits."""
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import OWN_STEPS, GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs
    from storyboard_cli.steps import FULL

    from helpers.graphs import cpu_replays

    models, first, _, _ = _runs_with_a_ledger(artifacts, tmp_path)
    x, cond, conds, guidance = synthetic_inputs(models, 4, SIDE, SIDE, 0)
    four = (x, schedule("euler", OWN_STEPS + 3, models.scheduler_config), None, cond, conds, guidance)
    with torch.no_grad():
        was = first.sample(*four)
    assert "against" not in _first_reason(first, 4)  # checked against the eager step, and recorded

    models = load_sdxl("tiny", None, "cpu", torch.float32)  # the later run: new models, kernels and runner
    k = CompiledKernels(models, None, root=artifacts)
    later = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=k, ledger=CheckLedger(models, k, tmp_path))
    cpu_replays(later)
    later.beside_ready, later.beside_recorder = (lambda: True), (lambda v: later.capturer(v.key))
    shape = Shape(4, SIDE, SIDE, 0)
    later.prepare([shape], beside=True)
    key = later.shape_key(*shape, FULL)
    assert not k.calls and k.deferred() and key not in later.graphs  # its kernels not loaded yet, its graph left
    with torch.no_grad():
        got = later.sample(*four)
    stats = later.stats[key]
    assert (stats.state, stats.beside, stats.beside_of) == ("graph", True, key.label), later.describe()
    assert f"beside its batch's first {OWN_STEPS} steps" in stats.reason and "at 4 images in an earlier run" in (
        stats.reason), stats.reason
    assert torch.equal(got, was)


def test_a_check_record_holds_only_for_its_weights_and_limit_and_a_broken_one_is_none(artifacts, tmp_path,
                                                                                        monkeypatch):
    """Other weights (a fine-tune, a LoRA written in place), another limit for the variant's check, or a record that
    cannot be read: the graph is checked against the eager step again. A check after an in-place write is not kept."""
    from dataclasses import replace

    from storyboard_cli.engine.variants import VARIANTS

    _, first, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    with torch.no_grad():
        first.sample(*four)

    models, other, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    with torch.no_grad():
        models.unet.conv_in.weight.mul_(1.01)
        models.written(models.unet.conv_in.weight)
        other.sample(*four)
    assert "against" not in _first_reason(other, 4)
    assert len(list(tmp_path.glob("checked-*.json"))) == 1  # after an in-place write nothing is kept

    monkeypatch.setitem(VARIANTS, "compiled", replace(VARIANTS["compiled"], check_rtol=0.5))
    _, looser, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    with torch.no_grad():
        looser.sample(*four)
    assert "against" not in _first_reason(looser, 4)
    monkeypatch.undo()

    for record in tmp_path.glob("checked-*.json"):
        record.write_text("{")
    _, broken, four, _ = _runs_with_a_ledger(artifacts, tmp_path)
    with torch.no_grad():
        broken.sample(*four)
    assert "against" not in _first_reason(broken, 4)
    records = [r.read_text() for r in tmp_path.glob("checked-*.json")]
    assert len(records) == 2 and sum('"batch": 4' in r for r in records) == 1  # its own written again


def test_the_kernels_say_what_their_loads_and_constants_took(artifacts):
    """The line a `--compile on` run's notes get: the artifacts loaded and the seconds they and the row's constants
    (FP8's input scales) took, a part of the capture stage before any graph."""
    import re

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    k = CompiledKernels(models, None, root=artifacts, variant="fp8")
    k.want(k.targets([Shape(2, SIDE, SIDE, 1)]))
    assert len(k.calls) == 2 and len(k.spare) == 2  # the FP8 UNet and ControlNet; the fp16 ones to fall back on
    assert re.fullmatch(r"compiled kernels: 2 artifacts loaded in \d+\.\d\d s, the fp8 constants prepared in "
                        r"\d+\.\d\d s; 2 to fall back on, loaded if a size needs them", k.load_note()), k.load_note()
    # a render's: each deferred to its graph's first capture (GraphRunner._bind), its load checks already run
    k = CompiledKernels(models, None, root=artifacts, variant="fp8")
    assert k.want(k.targets([Shape(2, SIDE, SIDE, 1)]), defer=True) == []
    assert not k.calls and [t.module for t in k.deferred()] == ["unet", "controlnet"] and len(k.spare) == 4
    assert k.variants(2, SIDE, SIDE, 1) == ["fp8", "compiled"]
    assert re.fullmatch(r"compiled kernels: 2 in the cache, each loaded before its graph's first capture, the fp8 "
                        r"constants prepared in \d+\.\d\d s; 2 to fall back on, loaded if a size needs them",
                        k.load_note()), k.load_note()
    assert k.bind("fp8", SIDE, SIDE, False) and [t.module for t in k.calls] == ["unet"]
    assert re.fullmatch(r"compiled kernels: 1 artifacts loaded in \d+\.\d\d s, 1 more in the cache, each loaded "
                        r"before its graph's first capture, .*", k.load_note()), k.load_note()


def test_a_unets_build_makes_inner_reductions_persistent_up_to_2048_elements(tmp_path, monkeypatch):
    """The UNet's LayerNorms over 1280 channels: one pass over their input (artifacts.persistent_choices), where
    inductor's own choice loops twice past 1024; the ControlNet's build keeps inductor's choices (its key is
    unchanged)."""
    import sympy
    import torch._inductor
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    from storyboard_cli.engine.kernels import artifacts

    class Features:  # what the choice reads of a kernel's features
        def __init__(self, n, hint=ReductionHint.INNER):
            self.reduction_numel, self.hint = sympy.Integer(n), hint

        def get_reduction_hint(self):
            return self.hint

    seen = {}

    class Graph:  # inductor's own choice reads the graph's sizes
        class sizevars:
            statically_known_leq = staticmethod(lambda a, b: bool(a <= b))

    def persistent(n):
        with V.set_graph_handler(Graph):
            return V.choices.should_use_persistent_reduction(Features(n), False)

    def compile_and_package(exported, package_path, inductor_configs):
        seen[exported] = [persistent(n) for n in (1024, 1280, 2048, 4096)]
        raise RuntimeError("only the choices were wanted")

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_and_package)
    monkeypatch.setattr(artifacts, "export", lambda target, model: target.module)
    for module in ("unet", "controlnet"):
        target = Target(module, SIDE, SIDE)
        with pytest.raises(RuntimeError, match="only the choices"):
            artifacts.build(target, module_of(models, module), artifact_path(target, models.unet, tmp_path))
    assert seen == {"unet": [True, True, True, False], "controlnet": [True, False, False, False]}
    assert (persistent(1024), persistent(1280)) == (True, False)  # the build's choices end with it


def _four_then_two_beside(models, runner, shapes):
    """A batch of 4 images of `shapes[0]` with `shapes[1]`'s graphs ahead beside its loop, then one of 2 of
    `shapes[1]`: the runner's final latents, and the eager engine's."""
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs
    from storyboard_cli.steps import FULL

    sched = schedule("euler", 3, models.scheduler_config)
    four, two = ((x, sched, None, cond, conds, guidance)
                 for x, cond, conds, guidance in (synthetic_inputs(models, n, SIDE, SIDE, s.control)
                                                  for n, s in zip((4, 2), shapes)))
    with torch.no_grad():
        got = [runner.sample(*four, None, runner.ahead(shapes[1], {FULL})), runner.sample(*two)]
        want = [EagerEngine(models).sample(*four), EagerEngine(models).sample(*two)]
    return got, want


def test_a_compiled_graph_that_needs_a_warm_up_gets_it_beside_the_loop_before(artifacts):
    """The ControlNet batch's compiled graph runs kernels no graph before ran (the ControlNet's): its warm-up runs
    between the replays of the batch before, on scratch buffers at its artifact's fewest rows, and its capture in the
    next piece. Both loops equal the eager loop's: the loop in flight reads the static buffers and their step counter,
    which the warm-up leaves alone. Its kernels are loaded there too, in a piece before the warm-up: `prepare` loads
    only the first batch's (the ControlNet's artifact is deferred to its graph's capture)."""
    from dataclasses import replace

    from storyboard_cli.engine.graph.keys import Warmed
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.steps import FULL

    from helpers.graphs import cpu_replays

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    shapes = [Shape(4, SIDE, SIDE, 0), Shape(2, SIDE, SIDE, 1)]
    kernels = CompiledKernels(models, None, root=artifacts)
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=kernels)
    captured = cpu_replays(runner)
    replay, warmed = runner.capturer, []

    def capture(key):  # the bookkeeping of a real capture (GraphRunner._capture): what it ran
        graph = replay(key)
        runner.warmed.append(Warmed.of(key))
        return graph

    def warm(small):
        warmed.append(small)
        GraphRunner._warm_on_scratch(runner, small)

    runner.capturer, runner.beside_warmer = capture, warm
    runner.beside_ready = lambda: True
    runner.beside_recorder = lambda v: replay(v.key)
    runner.prepare(shapes, beside=True)
    control = runner.shape_key(*shapes[1], FULL)
    assert captured == [runner.shape_key(*shapes[0], FULL)]  # the ControlNet batch's graph is left to the loop
    assert [t.module for t in kernels.calls] == ["unet"] and [t.module for t in kernels.deferred()] == ["controlnet"]
    got, want = _four_then_two_beside(models, runner, shapes)
    assert warmed == [replace(control, batch=1)]  # one guided image: the artifact's fewest rows
    assert captured[1:] == [control]
    stats = runner.stats[control]
    assert (stats.state, stats.beside, stats.warmup, stats.warmup_rows) == ("graph", True, True, 2), runner.describe()
    assert stats.load_s > 0 and not kernels.deferred()  # the ControlNet's artifact, loaded by the piece before
    assert stats.checked and "against" not in stats.reason  # the ControlNet's kernels: checked against eager
    assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want))


def _plans_beside(artifacts, monkeypatch, ledger_root: Path | None = None):
    """`_four_then_two_beside` on the tiny compiled kernels with the library plans made ahead (the CPU's convolutions
    standing for cuDNN's), in a fresh process's state (no plan made yet): the runner, the order of its warm-ups, plan
    pieces and captures beside the loop, the ControlNet batch's key, and the loops' latents against eager's.
    `ledger_root`: the runner's check ledger there (the plans' records kept across runs beside it)."""
    from storyboard_cli.engine.graph import runner as runner_mod
    from storyboard_cli.engine.graph.keys import Warmed
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels import plans as plans_mod
    from storyboard_cli.steps import FULL

    from helpers.graphs import cpu_replays

    monkeypatch.setattr(plans_mod, "MADE", set())
    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    shapes = [Shape(4, SIDE, SIDE, 0), Shape(2, SIDE, SIDE, 1)]
    kernels = CompiledKernels(models, None, root=artifacts)
    ledger = None if ledger_root is None else CheckLedger(models, kernels, ledger_root)
    runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=kernels, ledger=ledger)
    runner.plans.enabled = True  # the CPU's convolutions stand for cuDNN's
    captured = cpu_replays(runner)
    replay, order = runner.capturer, []

    def capture(key):
        graph = replay(key)
        runner.warmed.append(Warmed.of(key))
        return graph

    def beside(v):
        if v.key.control:  # the ControlNet batch's (the first batch's may be captured beside its own steps)
            order.append(("capture", v.key))
        return replay(v.key)

    def warm(small):
        order.append(("warm", small))
        GraphRunner._warm_on_scratch(runner, small)

    def make(call):
        order.append(("plan", call))
        plans_mod.make(call)

    monkeypatch.setattr(runner_mod, "make", make)
    runner.capturer, runner.beside_warmer, runner.beside_recorder = capture, warm, beside
    runner.beside_ready = lambda: True
    runner.prepare(shapes, beside=True)
    control = runner.shape_key(*shapes[1], FULL)
    got, want = _four_then_two_beside(models, runner, shapes)
    assert captured[-1] == control and runner.stats[control].beside
    assert all(rel_error(g, w) < 1e-4 for g, w in zip(got, want))
    return runner, order, control


def test_a_graph_captured_beside_a_loop_gets_its_library_plans_at_its_rows_first_one_call_a_piece(artifacts, monkeypatch):
    """The ControlNet batch's warm-up beside the loop before records its step's library calls (the convolutions, at
    its artifact's fewest rows); before its capture, each of them at the batch's own rows runs in a piece of its own
    (engine/kernels/plans.py: the libraries' per-shape setup out of the capture's one piece), once per process. Both
    loops still equal the eager loop's."""
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels import plans as plans_mod

    runner, order, control = _plans_beside(artifacts, monkeypatch)
    identity, rows = GraphRunner._plan_id(control)
    recorded = runner.plans.records[identity]
    assert rows == 4 and {c.rows for c in recorded} == {2}  # recorded at the warm-up's rows: one guided image
    assert {c.op for c in recorded} == {"aten._convolution.default"} and len(recorded) > 10
    planned = [c for what, c in order if what == "plan"]
    assert [what for what, _ in order] == ["warm"] + ["plan"] * len(recorded) + ["capture"], order
    assert planned == [c.at(4) for c in recorded] and all(c in plans_mod.MADE for c in planned)
    assert all(a.shape[0] == 2 * b.shape[0] for c, r in zip(planned, recorded)
               for a, b in zip(c.args, r.args) if isinstance(a, plans_mod.Operand) and a.batched)
    assert runner.plans.to_make(identity, 4) == []  # made once: a second graph at these rows plans nothing
    assert runner.stats[control].planned == len(recorded)  # the report's `planned`


def test_a_later_run_makes_a_new_sizes_plans_ahead_of_its_warm_up_from_the_record_an_earlier_run_kept(
        artifacts, monkeypatch, tmp_path):
    """The first run's warm-up beside the loop keeps its library calls beside the check ledger (`plans-<id>.json`:
    the artifacts it ran and the machine name it). A later run, a new process that has made none of them, makes each
    at the warm-up's rows in a piece of its own before that warm-up (whose setup at a new size is otherwise one piece
    of host time), then at the batch's rows before the capture; the warm-up records the same calls and leaves the
    file as it was. Both runs' loops equal the eager loop's."""
    from storyboard_cli.engine.graph.keys import Warmed
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels.plans import LibraryCall

    first, order, control = _plans_beside(artifacts, monkeypatch, tmp_path)
    identity, rows = GraphRunner._plan_id(control)
    kept = first.ledger.plans_path(identity)
    recorded = first.plans.records[identity]
    assert kept is not None and kept.parent == tmp_path and kept.name.startswith("plans-"), kept
    assert [LibraryCall.from_json(d) for d in json.loads(kept.read_text())["calls"]] == recorded
    assert [what for what, _ in order] == ["warm"] + ["plan"] * len(recorded) + ["capture"]  # nothing kept before
    # the UNet's warm-up has its own record: another artifact set, another file; a plain graph's (the modules'
    # kernels: no artifact names them) and eager have none
    assert first.ledger.plans_path(Warmed("compiled", 0, SIDE, SIDE, True, 0)) not in (None, kept)
    assert first.ledger.plans_path(Warmed("plain", 0, SIDE, SIDE, True, 1)) is None
    assert first.ledger.plans_path(Warmed("eager", 0, SIDE, SIDE, True, 0)) is None
    written = kept.stat().st_mtime_ns

    later, order, _ = _plans_beside(artifacts, monkeypatch, tmp_path)
    n = len(recorded)
    assert [what for what, _ in order] == ["plan"] * n + ["warm"] + ["plan"] * n + ["capture"], order
    planned = [c for what, c in order if what == "plan"]
    assert planned[:n] == recorded and planned[n:] == [c.at(rows) for c in recorded]
    assert later.plans.records[identity] == recorded and kept.stat().st_mtime_ns == written
    assert later.stats[control].planned == 2 * n and first.stats[control].planned == n


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "euler_a"])
def test_a_graph_whose_kernels_were_checked_is_captured_beside_its_own_batchs_first_steps(artifacts, sampler):
    """A 4-image batch whose kernels were checked against the eager step at other rows (a render's first batch with the
    ledger's check): `prepare(beside=True)` leaves its graph to its batch, whose `sample` runs its first OWN_STEPS steps
    on the kernels outside the graph, captures the graph beside them and checks its first replay against the first
    image's step alone, from the latents and prediction the steps before left (a multistep sampler reads the
    prediction; an ancestral one each step's noise). The latents are the bits of the same batch on a graph captured
    before its loop. A capture that fails there is logged and the batch runs again from its start on a graph captured
    before its loop; a replay that fails the check sends the shape a row down, the batch again from its start."""
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.keys import Warmed
    from storyboard_cli.engine.graph.runner import OWN_STEPS, GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs
    from storyboard_cli.steps import FULL

    from helpers.graphs import cpu_replays

    models = load_sdxl("tiny", "tiny", "cpu", torch.float32)
    one, four = Shape(1, SIDE, SIDE, 0), Shape(4, SIDE, SIDE, 0)
    sched = schedule(sampler, 6, models.scheduler_config)

    def inputs(n: int) -> tuple:
        x, cond, conds, guidance = synthetic_inputs(models, n, SIDE, SIDE, 0)
        g = torch.Generator().manual_seed(n)
        noise = torch.randn((sched.steps, *x.shape), generator=g) if sched.ancestral else None
        return x, sched, noise, cond, conds, guidance

    def runner_of(behind: bool, recorder=None, part=None):
        runner = GraphRunner(models, max_batch=4, max_hw=(SIDE, SIDE), compiled=CompiledKernels(models, None,
                                                                                                 root=artifacts))
        captured, steps = cpu_replays(runner), []
        replay, stepper = runner.capturer, runner.stepper

        def capture(key):  # the bookkeeping of a real capture (GraphRunner._capture): what it ran
            graph = replay(key)
            runner.warmed.append(Warmed.of(key))
            return graph

        def step(v):
            steps.append((v.key, int(v.buf.index)))
            stepper(v)

        runner.capturer, runner.stepper, runner.beside_ready = capture, step, lambda: behind
        runner.beside_recorder = recorder or (lambda v: replay(v.key))
        if part is not None:
            runner.part_step = part(runner.part_step)
        runner.prepare([one])
        with torch.no_grad():  # the kernels checked against eager at 1 image: the ledger's "earlier run"
            runner.sample(*inputs(1))
        assert runner.against_eager and captured == [runner.shape_key(*one, FULL)]
        steps.clear()
        runner.prepare([four], beside=True)
        return runner, captured, steps

    ahead, captured_a, _ = runner_of(False)
    behind, captured_b, steps = runner_of(True)
    key = behind.shape_key(*four, FULL)
    assert key.variant == "compiled" and key.batch == 4
    assert captured_a == captured_b[:1] + [key] and captured_b == captured_a[:1]  # left to its batch by `prepare`
    with torch.no_grad():
        want = ahead.sample(*inputs(4))
        got = behind.sample(*inputs(4))
        eager = EagerEngine(models).sample(*inputs(4))
    assert torch.equal(got, want) and rel_error(got, eager) < 1e-4
    # its first steps outside the graph, then its capture (here a 'graph' records nothing), then the replays
    assert steps[:OWN_STEPS] == [(key, i) for i in range(OWN_STEPS)] and captured_b[1:] == [key]
    stats = behind.stats[key]
    assert (stats.state, stats.beside, stats.beside_of, stats.warmup, stats.warmup_rows) == (
        "graph", True, key.label, True, 8), behind.describe()
    assert stats.checked and f"beside its batch's first {OWN_STEPS} steps" in stats.reason
    assert "at 1 image" in stats.reason and "at 1 images" in stats.reason  # checked at 1 image; against eager at 1
    assert stats.replays == sched.steps - OWN_STEPS
    with torch.no_grad():  # the next batch of the shape replays the graph from its first step
        assert torch.equal(behind.sample(*inputs(4)), want) and stats.replays == 2 * sched.steps - OWN_STEPS

    def broken(v):
        raise RuntimeError("operation not permitted when stream is capturing")

    failed, captured_f, steps = runner_of(True, recorder=broken)
    with torch.no_grad():
        assert torch.equal(failed.sample(*inputs(4)), want)
    stats = failed.stats[key]
    assert stats.state == "graph" and stats.checked and not stats.beside and captured_f[1:] == [key]
    assert key in failed._not_behind and [i for _, i in steps[:OWN_STEPS + 1]] == [0, 1, 0]  # again from its start

    def off(part_step):  # the first image's reference step, wrong: the replay fails its check
        return lambda *a, **k: tuple(t + 1 for t in part_step(*a, **k))

    down, _, _ = runner_of(True, part=off)
    with torch.no_grad():
        plain = down.sample(*inputs(4))
    stats = down.stats[key]
    assert stats.state == "plain" and "replay check failed" in stats.reason and key not in down.graphs
    assert down.stats[down.shape_key(*four, FULL)].checked and rel_error(plain, eager) < 1e-4


def test_a_plain_graph_in_a_run_with_the_ledger_is_checked_against_eager_and_keeps_no_record(tmp_path):
    """A size without kernels (still building, or none for it) runs a plain graph in a render whose runner has the
    check ledger: its check against the eager step has no artifact to name a record by, so none is kept, and its loop
    equals the eager loop (before, naming the record raised KeyError out of the batch, found on a GPU)."""
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.sampling import schedule
    from storyboard_cli.run.capture import synthetic_inputs

    from helpers.graphs import cpu_replays

    models = load_sdxl("tiny", None, "cpu", torch.float32)
    kernels = CompiledKernels(models, None, root=tmp_path / "empty")  # an empty cache: every size plain
    runner = GraphRunner(models, max_batch=2, max_hw=(SIDE, SIDE), compiled=kernels,
                         ledger=CheckLedger(models, kernels, tmp_path))
    cpu_replays(runner)
    x, cond, conds, guidance = synthetic_inputs(models, 2, SIDE, SIDE, 0)
    args = (x, schedule("euler", 3, models.scheduler_config), None, cond, conds, guidance)
    with torch.no_grad():
        got, want = runner.sample(*args), EagerEngine(models).sample(*args)
    stats = runner.stats[runner.shape_key(2, SIDE, SIDE, False)]
    assert (stats.key.variant, stats.state, stats.checked) == ("plain", "graph", True), stats.reason
    assert not list(tmp_path.glob("checked-*.json")) and not list(tmp_path.glob("plans-*.json"))
    assert rel_error(got, want) < 1e-4


def test_a_check_record_whose_name_fails_is_no_record_and_the_batch_renders(artifacts, tmp_path, caplog):
    """Naming a check's record can fail (a plain graph's once raised KeyError there): the graph is checked against the
    eager step, nothing is kept, a warning says so, and the batch renders what the eager loop computes."""
    from storyboard_cli.engine.eager import EagerEngine

    models, runner, four, _ = _runs_with_a_ledger(artifacts, tmp_path)

    def broken(*_):
        raise RuntimeError("a marker that cannot be read")

    runner.ledger._artifacts = broken
    with torch.no_grad(), caplog.at_level("WARNING"):
        got, want = runner.sample(*four), EagerEngine(models).sample(*four)
    assert "against" not in _first_reason(runner, 4) and _first_reason(runner, 4).startswith("checked")
    assert not list(tmp_path.glob("checked-*.json"))
    assert caplog.text.count("no check record for") == 1 and "a marker that cannot be read" in caplog.text
    assert rel_error(got, want) < 1e-4
