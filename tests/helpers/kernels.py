"""What the CPU compiled-kernel tests share (tests/test_compiled.py, test_fp8.py; test_gpu_compiled.py loads through a
new process too, test_gpu_fp8_kernels.py builds the FP8 twin on a GPU): the artifacts' image size, one step's module inputs
and calls, the eager FP8 module an FP8 artifact computes, a load in a second process, a GPU as an artifact's key sees
one (tests/test_compiled.py)."""

import copy
import subprocess
import sys
from types import SimpleNamespace

import torch

from storyboard_cli.engine.conditions.control import embed_guide
from storyboard_cli.engine.eager import StepCalls
from storyboard_cli.engine.kernels import conv8
from storyboard_cli.engine.kernels import fp8 as F
from storyboard_cli.engine.kernels.export import fuse_projections, text_dims

SIDE = 128  # pixels: latent 16 x 16
FP8_TWINS = 1.5e-2  # a compiled FP8 ControlNet against the same FP8 arithmetic in eager PyTorch (`fp8_reference`)
# a compiled FP8 UNet against the same arithmetic in eager PyTorch, as a share of the eager FP8 UNet's own error against
# the float one: with its inner convolutions FP8 too, the compiler's last-bit differences in the GroupNorms before them
# land as whole FP8 steps, which the random test model amplifies (on the CPU a 1e-6 change of its input moves the eager
# FP8 UNet 2.3e-2, at 5.2e-2 from float; the artifact is 2.7e-2 from it and 5.7e-2 from an eager UNet without FP8
# convolutions, 2026-12-06): an artifact that left them out would be as far off as FP8 itself
FP8_UNET_TWINS = 0.75


# an H100 SXM's properties as torch gives them, its capability, its name
H100_SXM = dict(name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, multi_processor_count=132,
                regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                warp_size=32, shared_memory_per_block_optin=232448, L2_cache_size=50 << 20, capability=(9, 0))


class OnGpu:
    """A model as `artifact_key` sees one on GPU 0: its config and parameters, its device CUDA."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def parameters(self):
        yield SimpleNamespace(device=torch.device("cuda", 0))

    def state_dict(self):
        return self.model.state_dict()


def fake_gpu(monkeypatch, card: dict) -> None:
    """torch and Triton as a machine with `card` (H100_SXM's fields) shows them to `artifact_key`, read at each call:
    changing the dict changes the card."""
    from storyboard_cli.engine.kernels import artifacts

    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.5.0"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**card))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: card["name"])
    monkeypatch.setattr(artifacts, "capability", lambda device: card["capability"])


def step_inputs(models, rows, control, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = w = SIDE // 8
    unet = models.unet
    text_dim, pooled_dim = text_dims(unet)
    latents = torch.randn(rows, 4, h, w, generator=g)
    t = torch.full((rows,), 500.0)  # as the step passes it
    embeds, pooled = torch.randn(rows, 77, text_dim, generator=g), torch.randn(rows, pooled_dim, generator=g)
    time_ids = torch.tensor([SIDE, SIDE, 0, 0, SIDE, SIDE], dtype=torch.float32).expand(rows, 6).clone()
    guide = scale = None
    if control:  # the first net's embedded guide, as the step hands it over (engine/conditions/control.py)
        guide = embed_guide(models.controlnets[0], torch.rand(rows, 3, SIDE, SIDE, generator=g))
        scale = torch.full((rows, 1, 1, 1), 0.7)
    return latents, t, embeds, pooled, time_ids, guide, scale



def fp8_reference(models, scales: F.InputScales, module: str = "unet", convs: bool = True) -> torch.nn.Module:
    """The FP8 UNet (or first ControlNet) in eager PyTorch: a copy of the rendering module, fused and rewritten as the
    export's (its feed-forwards one call: engine/kernels/geglu.py; a UNet's inner convolutions FP8: conv8.py), holding
    the FP8 weights and scales the artifact is bound to. `convs=False`: the same with every convolution in the
    module's own precision (the arithmetic before conv8.py, an artifact's wrong twin)."""
    live = models.unet if module == "unet" else models.controlnets[0]
    net = copy.deepcopy(live)
    fuse_projections(net, processor=True)
    F.rewrite(net)
    kept = [] if convs else conv8.convs(live)
    for name in kept:
        conv8.replace(net, [name], lambda _, name=name: copy.deepcopy(live.get_submodule(name)))
    tensors = scales.tensors(models, live)
    with torch.no_grad():
        for name in sorted(set(F.quantised(live)) - set(kept)):  # (the live module's: the copy's are FP8 modules now)
            m = net.get_submodule(name)
            m.weight.copy_(tensors[f"{name}.weight"])
            m.w_scale.copy_(tensors[f"{name}.w_scale"])
            m.x_scale.copy_(tensors[f"{name}.x_scale"])
            if m.bias is not None:
                m.bias.copy_(live.get_submodule(name).bias)
    return net


def assert_computes_fp8(cases, rtol: float) -> list[str]:
    """An FP8 UNet artifact computes the eager FP8 UNet's arithmetic (`fp8_reference`), not its wrong twin's (its
    convolutions left fp16), within FP8's error `rtol` of the float UNet. `cases`: (the artifact's output, the eager
    FP8 UNet's, the wrong twin's, the float UNet's) for several inputs. Over them all the artifact is closer to the right
    twin than to the wrong one; not equal to it: where the compiler's fused producers (GroupNorm, LayerNorm) differ from
    eager's in the last bit, and on a GPU where the FP8 kernels' sums are rounded apart, an element lands on the next FP8
    value, which the random test model amplifies (on the CPU a 1e-6 change of its input moves the eager FP8 UNet 2.3e-2,
    at 5.2e-2 from float, 2026-12-06), so one input alone can sit near the middle. Returns a line per case."""
    from helpers.reference import rel_error

    lines, near, far = [], 0.0, 0.0
    for got, want, wrong, full in cases:
        near, far = near + rel_error(got, want), far + rel_error(got, wrong)
        lines.append(f"artifact vs eager FP8 {rel_error(got, want):.2e}, vs its fp16-convolution twin "
                     f"{rel_error(got, wrong):.2e}, vs float {rel_error(got, full):.2e}; eager FP8 vs float "
                     f"{rel_error(want, full):.2e}")
        assert 1e-3 < rel_error(got, full) < rtol, lines[-1]
    assert near < far, lines
    return lines


def run_calls(calls: StepCalls, latents, t, embeds, pooled, time_ids, guide, scale):
    mid = down = None
    if guide is not None:
        mid, *down = calls.controlnet(latents, t, embeds, pooled, time_ids, guide, scale)
    return calls.unet(latents, t, embeds, pooled, time_ids, mid, down)



def loads_in_a_new_process(root, device: str, dtype: str, controlnet: str | None, side: int = SIDE,
                           model: str = "tiny") -> str:
    """What a second process gets from the cache folder `root`: 'loaded', or the notes."""
    code = ("import sys, torch; from pathlib import Path;"
            "from storyboard_cli.engine.kernels.calls import CompiledKernels;"
            "from storyboard_cli.engine.base import Shape; from storyboard_cli.models.loader import load_sdxl;"
            f"m = load_sdxl({model!r}, {controlnet!r}, {device!r}, torch.{dtype});"
            "k = CompiledKernels(m, None, root=Path(sys.argv[1]));"
            f"k.want(k.targets([Shape(1, {side}, {side}, bool(m.controlnets))]));"
            f"why = k.ready(1, {side}, {side}, bool(m.controlnets));"
            "print('loaded' if why is None else [why, k.notes])")
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]

