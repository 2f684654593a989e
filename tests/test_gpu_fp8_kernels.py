"""The FP8 kernels of ours on a GPU (skipped without CUDA or FP8 tensor cores): the fused feed-forward
(engine/kernels/geglu.py) and the inner convolutions (conv8.py) against the exact arithmetic at SDXL's widths and the
test model's, rows that fill no tile, and the tiny model's FP8 UNet artifact, built here as `bcg capture --fp8` builds
it: its export keeps both kernels as nodes, and the loaded package computes the eager FP8 UNet."""

import pytest
import torch

from storyboard_cli.engine.kernels import conv8, geglu
from storyboard_cli.engine.kernels import fp8 as F

pytestmark = pytest.mark.gpu
SIDE = 128


@pytest.fixture(autouse=True)
def fp8_device():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs a CUDA GPU of compute capability 8.9 or later")


@pytest.mark.parametrize("k,inner,m", [(1280, 5120, 2 * 1024 + 37), (640, 2560, 16 * 4096), (64, 256, 37),
                                       (1280, 5120, 1)])
def test_the_kernel_computes_the_reference(k, inner, m):
    """Against the exact product (float64): the kernel's FP8 tensor-core products accumulate at the Hopper's reduced
    precision (as `torch._scaled_mm` with use_fast_accum), so at SDXL's depths 1.8% to 3.2% of the outputs land one FP8
    step from the exact value (H200, 2026-12-06), at the test model's depth under 1%. A kernel with a wrong scale, bias,
    tile or row mask is off in most of them."""
    g = torch.Generator(device="cuda").manual_seed(k + m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float16)
    w = torch.randn(2 * inner, k, device="cuda", generator=g, dtype=torch.float16) / k**0.5
    b = torch.randn(2 * inner, device="cuda", generator=g, dtype=torch.float16) * 0.1
    xq, xs = F.quantize(x)
    wq, ws = F.quantize(w)
    y = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t() + b.double()  # the exact product
    h, gate = y.chunk(2, dim=-1)
    want = (h * torch.nn.functional.gelu(gate) / 0.004).clamp(-448, 448).float().to(F.FP8).float()
    got = geglu.op()(xq, wq, b, xs, ws, torch.tensor(0.004, device="cuda")).float()
    assert got.shape == (m, inner)
    same = (got == want).float().mean().item()
    err = ((got - want).norm() / want.norm()).item()
    print(f"{k} -> 2 x {inner} at {m} rows: {same:.4f} of the outputs exact, relative error {err:.2e}")
    assert same > 0.95 and err < 4e-2


@pytest.mark.parametrize("c,n,side,rows", [(1280, 1280, 32, 16), (640, 640, 64, 3), (2560, 1280, 32, 4),
                                          (64, 64, 8, 2), (32, 64, 16, 5)])
def test_the_convolution_kernel_computes_the_exact_arithmetic(c, n, side, rows):
    """Against the exact convolution (float64) of the same FP8 values: the padding's zeros, the rows past a tile and
    the channels past N. Its products accumulate at the Hopper's reduced FP8 precision, as the feed-forward's do
    (Triton's default on sm_90 never promotes the sums), over up to 9 x 2560 terms: the outputs stay well inside FP8's
    own rounding (3.7e-2), where a wrong tap, padding or mask is off by a tenth and more."""
    g = torch.Generator(device="cuda").manual_seed(c + side)
    x = torch.randn(rows, c, side, side, device="cuda", generator=g, dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(n, c, 3, 3, device="cuda", generator=g, dtype=torch.float16) / (9 * c) ** 0.5
    bias = torch.randn(n, device="cuda", generator=g, dtype=torch.float16) * 0.1
    xs = (x.abs().amax().float() / 448).reshape(())
    xq = (x / xs).clamp(-448, 448).to(F.FP8)
    wq, ws = conv8.quantize(w)
    got = conv8.op()(xq, wq, ws, xs, bias, 1, 1)
    assert got.shape == (rows, n, side, side) and got.dtype == torch.float16
    assert got.is_contiguous(memory_format=torch.channels_last)
    weight = (wq.double() * ws.double()[:, None, None, None]).permute(0, 3, 1, 2)
    want = torch.nn.functional.conv2d(xq.double() * xs.double(), weight, bias.double(), 1, 1)
    err = ((got.double() - want).norm() / want.norm()).item()
    print(f"{c} -> {n} 3x3 at {side}x{side}, {rows} rows: relative error {err:.2e}")
    assert err < 2e-2


def test_the_fp8_artifact_runs_the_kernels_and_computes_the_eager_fp8_unet(tmp_path):
    import copy

    from storyboard_cli.engine.base import Shape
    from storyboard_cli.engine.eager import StepCalls, unet_call
    from storyboard_cli.engine.kernels.artifacts import Target
    from storyboard_cli.engine.kernels.builds import Builds
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.engine.kernels.export import export
    from storyboard_cli.engine.variants import VARIANTS
    from storyboard_cli.models.loader import load_sdxl

    from helpers.kernels import assert_computes_fp8, fp8_reference, run_calls, step_inputs

    models = load_sdxl("tiny", None, "cuda", torch.float16)
    exported = export(Target("unet", SIDE, SIDE, "fp8"), copy.deepcopy(models.unet))
    nodes = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    feed_forwards = [m for m in models.unet.modules() if type(m).__name__ == "FeedForward"]
    assert feed_forwards and sum("geglu_fp8" in n for n in nodes) == len(feed_forwards)
    assert sum("conv2d_fp8" in n for n in nodes) == len(conv8.convs(models.unet)) > 0

    events, notes = [], []
    builds = Builds(torch.device("cuda"), events.append, notes=notes)
    shape = Shape(4, SIDE, SIDE, False)
    build = CompiledKernels(models, builds, notes, root=tmp_path / "cache", variant="fp8")
    build.want(build.targets([shape]))
    build.start(background=False)
    builds.wait()
    assert [e.module for e in events if e.state == "done"] == ["unet 128x128 fp8"], (events, notes)
    k = CompiledKernels(models, None, notes, root=tmp_path / "cache", variant="fp8")  # a render's load of it
    k.want(k.targets([shape]))
    k.reserve(shape.batch, SIDE * SIDE)
    assert k.ready(*shape) is None, notes
    reference = fp8_reference(models, k.constants["fp8"])
    wrong = fp8_reference(models, k.constants["fp8"], convs=False)
    cases = []
    for rows, seed in ((2, 2), (2, 12), (2, 22), (8, 8), (8, 18), (8, 28)):
        latents, t, embeds, pooled, time_ids, _, _ = step_inputs(models, rows, False, seed=seed)
        half = [x.to("cuda", torch.float16) for x in (latents, embeds, pooled, time_ids)]
        inputs = (half[0], t.cuda(), *half[1:], None, None)  # the timestep float32, as the step passes it
        with torch.no_grad():
            cases.append((run_calls(k, *inputs), unet_call(reference, *inputs[:5], None, None),
                          unet_call(wrong, *inputs[:5], None, None), run_calls(StepCalls.eager(models), *inputs)))
    for line in assert_computes_fp8(cases, VARIANTS["fp8"].check_rtol):
        print(line)
