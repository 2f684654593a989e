"""The engine's conditioning kinds as rows (engine/conditions/), on the tiny preset (CPU, fp32): the step's hooks
around the sampler's update (after_step, start) called with the step's number on the eager path and on the graph
runner's static buffers, a kind's static buffers loaded by its pairs in the one grouped copy, and the compiled
artifacts' keys and the export's inputs as they were before the kinds became rows (prebuilt kernels are keyed by
them)."""

import inspect
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from storyboard_cli.engine.conditioning import PromptCache, conditioning, guided_rows
from storyboard_cli.engine.conditions import KINDS
from storyboard_cli.engine.conditions.kind import Conditions, Kind, Plain
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.steps import step_plan

from helpers.graphs import cpu_replays

W, H, STEPS = 64, 48, 4


@dataclass(frozen=True)
class Pull(Plain):
    """A test kind with both hooks, as an inpainting mask and a per-row start will use them: after the update, each
    row's latents pulled toward its target by its weight (a per-row latent blend); a row held until its first step."""

    target: torch.Tensor  # [B, 4, h, w]
    weight: torch.Tensor  # [B]
    first: torch.Tensor  # [B] long
    kind: str = "pull"

    def half(self, b: int) -> "Pull":  # per image, not CFG-doubled: the conditional step has the same rows
        return self

    def after_step(self, x, x_next, denoised, index):
        return x_next + self.weight.view(-1, 1, 1, 1) * (self.target - x_next)

    def start(self):
        return self.first

    def pairs(self, value: "Pull"):
        return [(self.target, value.target), (self.weight, value.weight), (self.first, value.first)]


class PullBuffers:
    def __init__(self, models, max_batch, max_pixels):
        self.target = torch.zeros(max_batch * 4 * max_pixels // 64)
        self.weight = torch.zeros(max_batch)
        self.first = torch.zeros(max_batch, dtype=torch.long)
        self.views = 0

    def view(self, key):
        self.views += 1
        b, n = key.batch, key.batch * 4 * key.height * key.width // 64
        return Pull(self.target[:n].view(b, 4, key.height // 8, key.width // 8), self.weight[:b], self.first[:b])


def _inputs(models, rows):
    sched = schedule("euler", STEPS, models.scheduler_config)
    x, _ = draw_noise(list(range(rows)), STEPS, (4, H // 8, W // 8), sched)
    negatives, guidance = guided_rows(["a lighthouse"] * rows, ["blurry"] * rows, [6.5] * rows)
    cond = conditioning(PromptCache(models), ["a lighthouse"] * rows, negatives, W, H)
    return sched, x, cond, torch.tensor(guidance)


def _pull(x):
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    # row 0: untouched (weight 0, from the first step); row 1: held to the end; row 2: the target at every step;
    # row 3: half-way pulled from its second step
    return Pull(target, torch.tensor([0.0, 0.0, 1.0, 0.5]), torch.tensor([0, STEPS, 0, 1]))


def test_the_hooks_run_after_each_update_with_the_step_number(tiny_cpu):
    sched, x, cond, guidance = _inputs(tiny_cpu, 4)
    x = x * sched.init_sigma
    pull = _pull(x)
    plain = EagerEngine(tiny_cpu).sample(x, sched, None, cond, None, guidance)
    got = EagerEngine(tiny_cpu).sample(x, sched, None, cond, Conditions.of(pull), guidance)
    assert torch.equal(got[0], plain[0])  # weight 0: the hook leaves the update as it is
    assert torch.equal(got[1], x[1])  # never started: its latents as they came in
    torch.testing.assert_close(got[2], pull.target[2], rtol=0, atol=1e-6)  # pulled all the way after the last update
    assert not torch.equal(got[3], plain[3])
    # row 3 held at step 0 (`start` sees the step's number), pulled at steps 1..3: not the row started at 0
    started = EagerEngine(tiny_cpu).sample(x, sched, None, cond, Conditions.of(Pull(pull.target, pull.weight,
                                                                                      torch.zeros(4).long())), guidance)
    assert torch.equal(started[1], plain[1])
    assert not torch.equal(got[3], started[3]) and not torch.equal(got[3], x[3])
    # the conditional rows alone (guidance cut-off) call the hooks too
    plan = step_plan(STEPS, 2)
    cut = EagerEngine(tiny_cpu).sample(x, sched, None, cond, Conditions.of(pull), guidance, plan)
    assert torch.equal(cut[1], x[1])
    torch.testing.assert_close(cut[2], pull.target[2], rtol=0, atol=1e-6)


def test_a_kinds_static_buffers_and_hooks_on_the_graph_runner(tiny_cpu, monkeypatch):
    """A row's static buffers are allocated with the rest, viewed per graph, loaded by its pairs; the captured step
    calls its hooks with the graph's step counter: the replays equal the eager loop, and a second batch with other
    values replays the same graph."""
    made = []

    def static(models, max_batch, max_pixels):
        made.append(PullBuffers(models, max_batch, max_pixels))
        return made[-1]

    monkeypatch.setitem(KINDS, "pull", Kind("pull", ("target",), lambda models: None, static,
                                            lambda *a: None))
    runner = GraphRunner(tiny_cpu, max_batch=4, max_hw=(H, W))
    captured = cpu_replays(runner)
    sched, x, cond, guidance = _inputs(tiny_cpu, 4)
    x = x * sched.init_sigma
    for pull in (_pull(x), Pull(-_pull(x).target, torch.tensor([0.3, 1.0, 0.0, 0.0]), torch.tensor([2, 0, 3, 0]))):
        want = EagerEngine(tiny_cpu).sample(x, sched, None, cond, Conditions.of(pull), guidance)
        got = runner.sample(x, sched, None, cond, Conditions.of(pull), guidance)
        assert torch.equal(got, want)
        assert torch.equal(made[-1].weight, pull.weight)  # loaded into the kind's own buffer
    assert len(made) == 1 and len(captured) == 1


# artifact_key of tiny targets (tiny models with the tiny ControlNet and IP-Adapter, CPU, fp32, torch/platform facts
# fixed), computed before the conditioning kinds became rows: a change here retires prebuilt kernels, so it comes only
# with artifacts.FORMAT's bump or a new step of the recipe (export.RECIPE, UNET_RECIPE), and this table's new values.
# The UNet's keys changed with its skip concatenations exported NHWC and again with its inner reductions persistent up
# to 2048 elements (UNET_RECIPE); the ControlNet's did not
PINNED_KEYS = {
    ("unet", 128, 128, "fp16", 0): "0c33c812c2e4d798f33a",
    ("unet", 128, 192, "fp16", 16): "b0d4e1d9d744c29a1921",
    # the ControlNet's keys changed once, on purpose: its artifacts take the guide embedded (export.CONTROLNET_RECIPE)
    ("controlnet", 128, 128, "fp16", 0): "1a0866b5f4c717594e3f",
    # the CPU's FP8 keys changed once, on purpose: there FP8 is the dequantised matmul (fp8.Fp8Linear); a GPU's keys
    # hold no such field. And again with the FP8 row's recipe steps "fused-geglu" and "fp8-convs-inner" (both modules:
    # the row's recipe is in each key)
    ("unet", 128, 128, "fp8", 0): "4362e8fadbb1c23b1faa",
    ("controlnet", 128, 128, "fp8", 0): "607416535f3001b6ae79",
}


@pytest.fixture(scope="module")
def adapter_models():
    from storyboard_cli.models.loader import load_sdxl

    return load_sdxl("tiny", "tiny", "cpu", torch.float32, "tiny")


def test_artifact_keys_and_the_exported_inputs_are_unchanged(adapter_models):
    from storyboard_cli.engine.kernels import artifacts
    from storyboard_cli.engine.kernels.artifacts import Target, artifact_key, artifact_path
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.engine.kernels.export import ControlNetCall, UNetCall, example_inputs

    m = adapter_models
    with mock.patch.object(artifacts.torch, "__version__", "2.0.0"), \
            mock.patch.object(artifacts.platform, "machine", lambda: "x86_64"), \
            mock.patch.object(artifacts.platform, "python_compiler", lambda: "GCC"):
        for (module, h, w, precision, refs), key in PINNED_KEYS.items():
            model = m.unet if module == "unet" else m.controlnets[0]
            assert artifact_key(Target(module, h, w, precision, refs), model) == key
        assert artifact_path(Target("unet", 128, 192, "fp16", 16), m.unet).name == (
            "unet-refs16-192x128-b0d4e1d9d744c29a1921.pt2")
    # the tokens an adapter's UNet artifacts take (Target.refs): the adapter's slots x its tokens per image
    assert CompiledKernels(m).unet_target(128, 192) == Target("unet", 128, 192, "fp16", 16)
    # the traced signature: the wrappers' input names and the example inputs' shapes, dtypes and strides
    assert list(inspect.signature(UNetCall.forward).parameters) == [
        "self", "latents", "t", "embeds", "pooled", "time_ids", "mid", "down", "ref_tokens", "ref_scale", "ref_mask",
        "tagged"]
    assert list(inspect.signature(ControlNetCall.forward).parameters) == [
        "self", "latents", "t", "embeds", "pooled", "time_ids", "guide", "scale"]

    def spec(a):
        return tuple(spec(x) for x in a) if isinstance(a, tuple) else (tuple(a.shape), str(a.dtype), a.stride())

    f32 = "torch.float32"
    assert spec(example_inputs("unet", m.unet, 2, 16, 16, 16)) == (
        ((2, 4, 16, 16), f32, (1024, 256, 16, 1)), ((), f32, ()), ((2, 77, 80), f32, (6160, 80, 1)),
        ((2, 32), f32, (32, 1)), ((2, 6), f32, (6, 1)), ((2, 64, 8, 8), f32, (4096, 1, 512, 64)),
        (((2, 32, 16, 16), f32, (8192, 1, 512, 32)), ((2, 32, 16, 16), f32, (8192, 1, 512, 32)),
         ((2, 32, 8, 8), f32, (2048, 1, 256, 32)), ((2, 64, 8, 8), f32, (4096, 1, 512, 64))),
        ((2, 16, 80), f32, (1280, 80, 1)), ((2, 1, 1), f32, (1, 1, 1)), ((2, 1, 1, 16), f32, (16, 16, 16, 1)))
    assert spec(example_inputs("controlnet", m.controlnets[0], 2, 16, 16)) == (
        ((2, 4, 16, 16), f32, (1024, 256, 16, 1)), ((), f32, ()), ((2, 77, 80), f32, (6160, 80, 1)),
        ((2, 32), f32, (32, 1)), ((2, 6), f32, (6, 1)), ((2, 32, 16, 16), f32, (8192, 1, 512, 32)),
        ((2, 1, 1, 1), f32, (1, 1, 1, 1)))


def test_each_kind_gives_the_rows_of_its_first_images():
    """`first_images(n, b)`, what the one-image check runs (engine/graph/check.py first_step_of_part): of CFG-doubled
    rows (negative rows first) the first n of each half, of per-image rows the first n; the rest as it was."""
    from storyboard_cli.engine.conditioning import Cond
    from storyboard_cli.engine.conditions.control import Control
    from storyboard_cli.engine.conditions.reference import Refs
    from storyboard_cli.engine.conditions.region import Regions
    from storyboard_cli.engine.conditions.source import Blend

    b, n = 3, 1
    rows = torch.tensor([0, b])  # image 0's negative and conditional rows

    def doubled(*shape):
        return torch.rand(2 * b, *shape)

    def is_first(got, full, dim=0):
        return torch.equal(got, full.index_select(dim, rows)) and got.is_contiguous()

    cond = Cond(doubled(77, 4), doubled(5), doubled(6))
    one = cond.first_images(n, b)
    assert all(is_first(getattr(one, name), getattr(cond, name)) for name in ("embeds", "pooled", "time_ids"))

    keep = torch.ones(10, 2)
    control = Control(torch.rand(2, 2 * b, 32, 8, 8), torch.rand(2, 2 * b, 1, 1, 1), (0, 1), keep)
    got = control.first_images(n, b)
    assert is_first(got.guide, control.guide, 1) and is_first(got.scale, control.scale, 1)
    assert got.nets == (0, 1) and got.keep is keep

    refs = Refs(doubled(8, 4), doubled(1, 1), doubled(1, 1, 8))
    got = refs.first_images(n, b)
    assert is_first(got.tokens, refs.tokens) and is_first(got.scale, refs.scale) and is_first(got.mask, refs.mask)

    regions = Regions(doubled(154, 4), (doubled(1, 16, 231), doubled(1, 4, 231)), (0, 1), doubled(8, 4),
                      (doubled(16, 2), doubled(4, 2)))
    got = regions.first_images(n, b)
    assert is_first(got.embeds, regions.embeds) and is_first(got.ref_tokens, regions.ref_tokens)
    assert all(is_first(g, f) for g, f in zip(got.bias + got.weight, regions.bias + regions.weight))
    assert got.levels == (0, 1) and len(got.bias) == len(got.weight) == 2

    sigma = torch.rand(10)
    blend = Blend(torch.rand(b, 4, 8, 8), torch.rand(b, 4, 8, 8), torch.rand(b, 1, 8, 8), sigma, torch.rand(b, 4, 8, 8),
                  torch.tensor([True, False, True]).view(b, 1, 1, 1))
    got = blend.first_images(n, b)
    for name in ("source_latents", "source_noise", "source_mask", "first", "fresh"):
        assert torch.equal(getattr(got, name), getattr(blend, name)[:n]), name
    assert got.next_sigma is sigma
    both = Conditions.of(control, blend).first_images(n, b)
    assert [v.kind for v in both] == [control.kind, blend.kind]


def test_a_batchs_guides_go_to_the_device_as_uint8_and_become_the_hosts_pixels_bit_for_bit(tmp_path, monkeypatch):
    """The control reader hands its guides over as the decoded uint8 (a quarter of float32's bytes, no float
    conversion on the host between two loops), and the pixels made of them on the device are those the host made
    before (`control_pixels`, cast to the models' dtype), for every uint8 value and dtype."""
    from types import SimpleNamespace

    from PIL import Image

    import storyboard_cli.engine.conditions.control as control_mod
    from storyboard_cli.engine.conditioning import control_pixels, device_pixels, read_control_image

    every = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = device_pixels(every, torch.device("cpu"), dtype)
        assert got.dtype == dtype and torch.equal(got, control_pixels(every).to(dtype))
    pixels = torch.rand(1, 3, 4, 4)  # pixels already: taken as they are
    assert torch.equal(device_pixels(pixels, torch.device("cpu"), torch.float16), pixels.half())

    paths = []
    for i in range(2):
        path = tmp_path / f"guide{i}.png"
        Image.fromarray(torch.randint(0, 256, (40, 56, 3), dtype=torch.uint8).numpy()).save(path)
        paths.append(path)
    items = [SimpleNamespace(width=W, height=H, controls=[SimpleNamespace(image=p, scale=0.5, file=p.name)])
             for p in paths]
    handed = []
    real = control_mod.control
    monkeypatch.setattr(control_mod, "control",
                        lambda models, images, *a, **k: (handed.extend(images), real(models, images, *a, **k))[1])
    from diffusers.models.controlnets.controlnet import ControlNetConditioningEmbedding

    torch.manual_seed(0)
    embedding = ControlNetConditioningEmbedding(32, 3, (8, 16)).half()
    torch.nn.init.normal_(embedding.conv_out.weight)  # diffusers starts it at zero
    net = SimpleNamespace(controlnet_cond_embedding=embedding,
                          config=SimpleNamespace(controlnet_conditioning_channel_order="rgb", block_out_channels=(32,)))
    models = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float16, controlnets=(net,))
    got = control_mod.Reader(models).batch(items, SimpleNamespace(nets=(0,), control_ends=()))
    assert [t.dtype for t in handed] == [torch.uint8]
    with torch.no_grad():  # the guide the net embeds at every step is made of the host's pixels
        want = embedding(torch.stack([control_pixels(read_control_image(p, W, H)) for p in paths]).half())
    assert want.abs().amax() > 0 and torch.equal(got.guide[0], torch.cat([want, want]))  # negative rows first
