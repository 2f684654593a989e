"""Draft mode's two levers in the engine, on the tiny preset (CPU, fp32): the guidance cut-off against diffusers'
SDXLCFGCutoffCallback, DeepCache against a plain-PyTorch reference of the published algorithm, the conditional
rows alone at guidance <= 1, and the graph runner's step kinds against the eager engine."""

from dataclasses import replace

import pytest
import torch

from storyboard_cli.engine.conditioning import PromptCache, conditioning, guided_rows
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.graph.keys import ShapeKey, Warmed
from storyboard_cli.engine.graph.runner import GraphRunner
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.run.capture import synthetic_inputs
from storyboard_cli.steps import FULL, StepKind, step_plan

from helpers.graphs import cpu_replays
from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE = 64, 48, 10, 6.5  # small: each step is compared whole, at any size
PROMPT, NEGATIVE = "a lighthouse in a storm, ink drawing", "blurry"


def _inputs(models, seeds, guidance, sampler="euler", steps=STEPS):
    sched = schedule(sampler, steps, models.scheduler_config)
    x, noise = draw_noise(seeds, steps, (4, H // 8, W // 8), sched)
    negatives, guidance = guided_rows([PROMPT] * len(seeds), [NEGATIVE] * len(seeds), guidance)
    cond = conditioning(PromptCache(models), [PROMPT] * len(seeds), negatives, W, H)
    return sched, x, noise, cond, torch.tensor(guidance)


def test_step_plan():
    plan = step_plan(7, 4, interval=3, branch=1)
    assert [k.guided for k in plan] == [True] * 4 + [False] * 3
    assert [k.cache for k in plan] == ["write", "read", "read", "write", "read", "read", "write"]
    assert {k.branch for k in plan} == {1}
    assert step_plan(3, 3) == (FULL,) * 3
    assert StepKind(False, "read", 0).label == "cond deepcache shallow b0" and FULL.label == ""


def test_a_plan_of_full_steps_is_todays_loop_bit_for_bit(tiny_cpu):
    sched, x, noise, cond, guidance = _inputs(tiny_cpu, [7], [GUIDANCE])
    today = EagerEngine(tiny_cpu).sample(x, sched, noise, cond, None, guidance)
    assert torch.equal(EagerEngine(tiny_cpu).sample(x, sched, noise, cond, None, guidance, step_plan(STEPS, STEPS)),
                       today)


@pytest.mark.parametrize("cutoff", [0.0, 0.5, 0.7])
@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m"])
def test_cutoff_equals_diffusers_cfg_cutoff_callback(tiny_cpu, cutoff, sampler):
    """diffusers drops the unconditional rows after step int(steps * ratio): so the first int(steps * ratio) + 1
    steps are guided (the callback runs at the end of a step), as job.plan.guided_steps counts."""
    from diffusers.callbacks import SDXLCFGCutoffCallback

    from storyboard_cli.steps import guided_steps

    models, seed = tiny_cpu, 4321
    want = diffusers_pipeline(models, sampler, False)(
        prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
        guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
        callback_on_step_end=SDXLCFGCutoffCallback(cutoff_step_ratio=cutoff)).images
    sched, x, noise, cond, guidance = _inputs(models, [seed], [GUIDANCE], sampler)
    plan = step_plan(STEPS, guided_steps(STEPS, cutoff))
    got = EagerEngine(models).sample(x, sched, noise, cond, None, guidance, plan)
    assert rel_error(got, want) < RTOL
    full = EagerEngine(models).sample(x, sched, noise, cond, None, guidance)
    assert rel_error(full, want) > 10 * RTOL  # the cut-off changed the result: the comparison can tell


def test_guidance_1_on_the_conditional_rows_alone_is_todays_result(tiny_cpu):
    """guidance <= 1 skips the unconditional half: CFG at 1 is the conditional prediction, so the result stays
    today's within fp32 rounding (a batch of B rows instead of 2B)."""
    sched, x, noise, cond, guidance = _inputs(tiny_cpu, [3, 4], [1.0, 0.5], "euler_a")
    today = EagerEngine(tiny_cpu).sample(x, sched, noise, cond, None, guidance)
    got = EagerEngine(tiny_cpu).sample(x, sched, noise, cond, None, guidance, step_plan(STEPS, 0))
    assert rel_error(got, today) < 1e-5
    calls = []
    handle = tiny_cpu.unet.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["encoder_hidden_states"].shape[0]),
                                                     with_kwargs=True)
    try:
        EagerEngine(tiny_cpu).sample(x, schedule("euler", 2, tiny_cpu.scheduler_config), None, cond, None, guidance,
                                     step_plan(2, 0))
    finally:
        handle.remove()
    assert calls == [2, 2]  # two images: two UNet rows per step, no unconditional half


@pytest.mark.parametrize("end", [0.5, 0.8])
def test_control_end_equals_diffusers_control_guidance_end(tiny_cpu, end):
    """diffusers scales the ControlNet's residuals by 0 after its end (it still runs it); bcg skips it: the
    same latents within the parity bound, and different from a ControlNet that runs to the end."""
    from PIL import Image

    from conftest import ROOT
    from storyboard_cli.engine.conditioning import load_control_image
    from storyboard_cli.engine.conditions.control import control as make_control
    from storyboard_cli.engine.conditions.kind import Conditions
    from storyboard_cli.steps import control_steps

    models, seed, path = tiny_cpu, 99, ROOT / "jobs" / "control" / "hero_pose.png"
    want = diffusers_pipeline(models, "euler", True)(
        prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
        guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
        image=Image.open(path).convert("RGB").resize((W, H), Image.LANCZOS), controlnet_conditioning_scale=0.9,
        control_guidance_end=end).images
    sched, x, noise, cond, guidance = _inputs(models, [seed], [GUIDANCE])
    ctl = Conditions.of(make_control(models, [load_control_image(path, W, H)[None]], [[0.9]]))
    plan = step_plan(STEPS, STEPS, control=control_steps(STEPS, end))
    got = EagerEngine(models).sample(x, sched, noise, cond, ctl, guidance, plan)
    assert rel_error(got, want) < RTOL
    to_the_end = EagerEngine(models).sample(x, sched, noise, cond, ctl, guidance)
    assert rel_error(to_the_end, want) > 10 * RTOL


# ---------------------------------------------------------------- DeepCache, the published algorithm


def _reference_unet(unet, latents, t, embeds, added, branch, cached=None):
    """UNet2DConditionModel's forward written out for SDXL, with DeepCache (Ma et al. 2024, Alg. 1): without
    `cached`, the whole network, returning (eps, the hidden state entering up block U = n-1-branch); with it,
    only down blocks 0..branch, then up blocks U.. on the cached feature with the fresh skips."""
    n = len(unet.up_blocks)
    emb = unet.time_embedding(unet.time_proj(t).to(latents.dtype))
    time_embeds = unet.add_time_proj(added["time_ids"].flatten()).reshape(t.shape[0], -1)
    emb = emb + unet.add_embedding(torch.cat([added["text_embeds"], time_embeds], dim=-1).to(emb.dtype))
    h = unet.conv_in(latents)
    skips = [h]
    for i, block in enumerate(unet.down_blocks):
        if cached is not None and i > branch:
            break
        kw = {"encoder_hidden_states": embeds} if getattr(block, "has_cross_attention", False) else {}
        h, res = block(hidden_states=h, temb=emb, **kw)
        skips.extend(res)
    if cached is None:
        h = unet.mid_block(h, emb, encoder_hidden_states=embeds)
    else:
        used = sum(len(b.resnets) for b in unet.up_blocks[n - 1 - branch:])
        skips, h = skips[:used], cached
    feature = None
    for j, block in enumerate(unet.up_blocks):
        if cached is not None and j < n - 1 - branch:
            continue
        if j == n - 1 - branch:
            feature = h
        res = tuple(skips[-len(block.resnets):])
        del skips[-len(block.resnets):]
        kw = {"encoder_hidden_states": embeds} if getattr(block, "has_cross_attention", False) else {}
        h = block(hidden_states=h, temb=emb, res_hidden_states_tuple=res, **kw)
    h = unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))
    return h, feature


@torch.no_grad()
def _reference_deepcache(models, seed, interval, branch, guidance):
    """The sampling loop as diffusers' SDXL pipeline runs it (EulerDiscreteScheduler.step, CFG), DeepCache's
    uniform schedule: every `interval`-th step full (refreshing the cache), the others shallow."""
    import diffusers

    sched = diffusers.EulerDiscreteScheduler.from_config(models.scheduler_config)
    sched.set_timesteps(STEPS)
    latents = torch.randn((1, 4, H // 8, W // 8), generator=torch.Generator("cpu").manual_seed(seed))
    latents = latents * sched.init_noise_sigma
    cond = conditioning(PromptCache(models), [PROMPT], [NEGATIVE], W, H)
    added = {"text_embeds": cond.pooled, "time_ids": cond.time_ids}
    cache = None
    for i, t in enumerate(sched.timesteps):
        model_in = sched.scale_model_input(torch.cat([latents] * 2), t)
        eps, feature = _reference_unet(models.unet, model_in, t.expand(2), cond.embeds, added, branch,
                                       None if i % interval == 0 else cache)
        if i % interval == 0:
            cache = feature
        neg, pos = eps.chunk(2)
        latents = sched.step(neg + guidance * (pos - neg), t, latents).prev_sample
    return latents


@pytest.mark.parametrize("interval,branch", [(3, 0), (2, 1)])
def test_deepcache_equals_the_published_algorithm(tiny_cpu, interval, branch):
    models, seed = tiny_cpu, 99
    want = _reference_deepcache(models, seed, interval, branch, GUIDANCE)
    sched, x, noise, cond, guidance = _inputs(models, [seed], [GUIDANCE])
    mids = []
    handle = models.unet.mid_block.register_forward_hook(lambda *a: mids.append(1))
    try:
        got = EagerEngine(models).sample(x, sched, noise, cond, None, guidance,
                                         step_plan(STEPS, STEPS, interval, branch))
    finally:
        handle.remove()
    assert rel_error(got, want) < RTOL
    assert len(mids) == len(range(0, STEPS, interval))  # the deep path ran on the full steps only
    full = EagerEngine(models).sample(x, sched, noise, cond, None, guidance)
    assert rel_error(full, want) > 100 * RTOL


def test_a_branch_the_unet_lacks_is_refused(tiny_cpu):
    sched, x, noise, cond, guidance = _inputs(tiny_cpu, [1], [GUIDANCE], steps=2)
    with pytest.raises(ValueError, match="branch 2 does not exist"):
        EagerEngine(tiny_cpu).sample(x, sched, noise, cond, None, guidance, step_plan(2, 2, 2, 2))


# ---------------------------------------------------------------- the graph runner's step kinds


LEVERS = {"full": (10, 0, 0), "cutoff": (5, 0, 0), "cond-only": (0, 0, 0), "deepcache": (10, 3, 0),
          "both": (6, 3, 1), "cond-deepcache": (0, 2, 0)}
# ControlNet shots: the cut-off, and DeepCache after the ControlNet's end (control steps: 6; 10 = to the end)
CASES = ([(False, name, None) for name in LEVERS] + [(True, name, 10) for name, (_, i, _) in LEVERS.items() if not i]
         + [(True, name, 6) for name in ("full", "cutoff", "both", "cond-deepcache")])


@pytest.mark.parametrize("control,levers,control_steps", CASES,
                         ids=[f"{'controlnet' if c else 'plain'}-{n}{'' if e in (None, 10) else '-end'}"
                              for c, n, e in CASES])
def test_graph_step_kinds_equal_the_eager_engine(tiny_cpu, control, levers, control_steps):
    guided, interval, branch = LEVERS[levers]
    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 2, H, W, control)
    sched = schedule("dpmpp_2m", STEPS, tiny_cpu.scheduler_config)
    plan = step_plan(STEPS, guided, interval, branch, control_steps)
    runner = GraphRunner(tiny_cpu, max_batch=4, max_hw=(H, W))
    captured = cpu_replays(runner)
    got = runner.sample(x, sched, None, cond, ctl, guidance, plan)
    want = EagerEngine(tiny_cpu).sample(x, sched, None, cond, ctl, guidance, plan)
    assert rel_error(got, want) < 1e-6
    # a step after the ControlNet's end replays the graph of a batch without one
    assert {(k.step, k.control) for k in captured} == {(replace(s, control=True), control and s.control) for s in plan}
    assert all(runner.stats[k].checked for k in captured)
    assert sum(runner.stats[k].replays for k in captured) == STEPS
    # a second batch through the same graphs (the feature buffer holds the last batch's): same again
    x2 = torch.randn_like(x)
    again = runner.sample(x2, sched, None, cond, ctl, guidance, plan)
    assert rel_error(again, EagerEngine(tiny_cpu).sample(x2, sched, None, cond, ctl, guidance, plan)) < 1e-6
    assert len(captured) == len(set(plan))


def test_prepare_captures_each_shapes_step_kinds(tiny_cpu):
    from storyboard_cli.engine import Shape

    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(H, W))
    captured = cpu_replays(runner)
    shape = Shape(2, H, W, False)
    runner.prepare([shape, Shape(1, H, W, False)], {shape: set(step_plan(6, 3, 3, 0))})
    assert sorted(k.label for k in captured) == [
        f"1x{W}x{H} float32", f"2x{W}x{H} float32 cond deepcache full b0", f"2x{W}x{H} float32 cond deepcache shallow b0",
        f"2x{W}x{H} float32 deepcache full b0", f"2x{W}x{H} float32 deepcache shallow b0"]
    one_feature = runner.buf.feature
    runner.prepare([shape], {shape: {StepKind(True, "write", 1)}})
    assert runner.buf.feature is one_feature  # one buffer for every branch: graphs keep its pointer


@pytest.mark.parametrize("broken,corrupt", [(StepKind(False, "read", 0), lambda v: v.x.mul_(2)),
                                            (StepKind(True, "write", 0), lambda v: v.feature.mul_(2))],
                         ids=["shallow-output", "full-feature"])
def test_a_failed_check_of_a_draft_kind_falls_back_to_eager(tiny_cpu, broken, corrupt):
    """A graph whose output, or whose written DeepCache feature, differs from the eager step's is not used."""
    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 1, H, W, False)
    sched = schedule("euler", 4, tiny_cpu.scheduler_config)
    plan = step_plan(4, 2, 2, 0)
    runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(H, W))
    cpu_replays(runner)
    runner.stepper = lambda v: (runner.step(v), corrupt(v) if v.key.step == broken else None)
    got = runner.sample(x, sched, None, cond, ctl, guidance, plan)
    assert torch.equal(got, EagerEngine(tiny_cpu).sample(x, sched, None, cond, ctl, guidance, plan))
    failed = [s for s in runner.stats.values() if s.state == "eager"]
    assert [s.key.step for s in failed] == [broken] and "replay check failed" in failed[0].reason


def test_a_replay_whose_prediction_is_off_fails_its_check_though_its_next_latents_are_close(tiny_cpu):
    """The first-replay check compares the prediction (the denoised latents) too: at the first, noisiest step a wrong
    noise prediction moves the next latents by a fraction of its error, and a broken kernel could pass on them."""
    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 1, H, W, False)
    sched = schedule("euler", 4, tiny_cpu.scheduler_config)
    runner = GraphRunner(tiny_cpu, max_batch=1, max_hw=(H, W))
    cpu_replays(runner)
    runner.stepper = lambda v: (runner.step(v), v.prev.mul_(1.05))  # the prediction 5% off
    got = runner.sample(x, sched, None, cond, ctl, guidance)
    assert torch.equal(got, EagerEngine(tiny_cpu).sample(x, sched, None, cond, ctl, guidance))
    (stats,) = runner.stats.values()
    assert stats.state == "eager" and "replay check failed" in stats.reason


def test_which_step_kinds_run_on_compiled_kernels(tiny_cpu):
    """The conditional-rows step runs the compiled kernels where its B rows fit the artifacts (2 rows at least);
    DeepCache's steps call into the UNet's blocks, so they stay plain in a compiled bucket."""

    class Ready:  # compiled kernels for every shape (engine/kernels/calls.py CompiledKernels' role)
        def reserve(self, max_batch, max_pixels):
            pass

        def variants(self, batch, height, width, control):
            return ["compiled"]

    runner = GraphRunner(tiny_cpu, max_batch=8, max_hw=(H, W), compiled=Ready())
    variant = lambda batch, kind: runner.shape_key(batch, H, W, False, kind).variant  # noqa: E731
    assert variant(1, FULL) == "compiled" and variant(8, FULL) == "compiled"
    cond = StepKind(guided=False)
    assert variant(1, cond) == "plain" and variant(2, cond) == "compiled" and variant(8, cond) == "compiled"
    for kind in (StepKind(True, "write"), StepKind(True, "read"), StepKind(False, "read")):
        assert variant(4, kind) == "plain"


def test_prepare_captures_the_graphs_whose_kernels_cover_others_first(tiny_cpu):
    """Most rows x pixels first; at equal rows and size the guided step of B / 2 images before the conditional step
    of B images, and full steps before shallow ones, so the later ones can skip their warm-up."""
    from storyboard_cli.engine import Shape

    runner = GraphRunner(tiny_cpu, max_batch=4, max_hw=(H, W))
    captured = cpu_replays(runner)
    four, two = Shape(4, H, W, False), Shape(2, H, W, False)
    runner.prepare([four, two], {four: set(step_plan(6, 3, 3, 0)), two: {FULL}})
    order = [(k.batch, k.step.label) for k in captured]
    assert order == [(4, "deepcache full b0"), (4, "deepcache shallow b0"), (2, ""), (4, "cond deepcache full b0"),
                     (4, "cond deepcache shallow b0")]


def test_which_captures_skip_the_warm_up():
    """A capture skips its warm-up step only where a graph captured before ran every kernel it runs: the same
    variant, rows and size; the whole UNet for a step that runs it whole; the ControlNet for a step that runs it."""
    def ran(batch, kind=FULL, control=False, variant="plain", height=H):
        return Warmed.of(ShapeKey(batch, height, W, control, "float32", variant, kind))

    full = ran(4)
    assert full.covers(ran(4, StepKind(True, "write", 0))) and full.covers(ran(4, StepKind(True, "read", 1)))
    assert full.covers(ran(8, StepKind(guided=False)))  # 8 images' conditional rows are 4 images guided
    assert full.covers(ran(8, StepKind(False, "read", 0)))
    assert not full.covers(ran(2)) and not full.covers(ran(4, StepKind(guided=False)))  # other rows
    assert not full.covers(ran(4, height=2 * H)) and not full.covers(ran(4, variant="compiled"))
    assert not full.covers(ran(4, control=True)) and ran(4, control=True).covers(full)
    assert not ran(4, StepKind(True, "read", 0)).covers(full)  # a shallow step ran part of the UNet


def test_a_compiled_warm_up_covers_other_rows_of_its_artifact():
    """A compiled (or FP8) variant's kernels are one artifact for every row count: a capture at new rows skips its
    warm-up after any of the same variant, size and ControlNets; a plain graph's still needs the same rows."""
    def ran(batch, variant, kind=FULL, control=False, height=H):
        return Warmed.of(ShapeKey(batch, height, W, control, "float32", variant, kind))

    for variant in ("compiled", "fp8"):
        eight = ran(8, variant)
        assert eight.covers(ran(1, variant)) and eight.covers(ran(4, variant, StepKind(guided=False)))
        assert ran(1, variant).covers(eight)  # the rows are the artifact's dynamic dimension, either way
        assert not eight.covers(ran(4, variant, control=True)) and ran(2, variant, control=True).covers(eight)
        assert not eight.covers(ran(4, variant, height=2 * H))
    assert not ran(8, "compiled").covers(ran(4, "fp8")) and not ran(8, "fp8").covers(ran(4, "compiled"))
    assert not ran(8, "plain").covers(ran(4, "plain"))


def test_todays_step_shares_deepcache_full_steps_graph(tiny_cpu):
    """Where a shape has DeepCache's full step, today's step of the same rows and ControlNet replays that graph (one
    capture less for a job with both kinds of shot); its result is today's, bit for bit (the feature write is a copy
    on the side), and the caching batch after it still equals the eager engine."""
    from storyboard_cli.engine import Shape

    x, cond, ctl, guidance = synthetic_inputs(tiny_cpu, 2, W, H, False)
    sched = schedule("euler", 6, tiny_cpu.scheduler_config)
    shape = Shape(2, H, W, False)
    plan = step_plan(6, 3, 3, 0)  # guided full / shallow, then conditional full / shallow
    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(H, W))
    captured = cpu_replays(runner)
    runner.prepare([shape], {shape: set(plan) | {FULL, StepKind(guided=False)}})
    labels = sorted(k.step.label for k in captured)
    assert labels == ["cond deepcache full b0", "cond deepcache shallow b0", "deepcache full b0",
                      "deepcache shallow b0"]  # no graph of today's step, none of the conditional rows' plain step
    assert runner.shape_key(2, H, W, False).step == StepKind(True, "write", 0)
    eager = EagerEngine(tiny_cpu)
    today = runner.sample(x, sched, None, cond, ctl, guidance)
    assert torch.equal(today, eager.sample(x, sched, None, cond, ctl, guidance))
    cond_only = (StepKind(guided=False),) * 6
    assert torch.equal(runner.sample(x, sched, None, cond, ctl, guidance, cond_only),
                       eager.sample(x, sched, None, cond, ctl, guidance, cond_only))
    x2 = torch.randn_like(x)
    assert rel_error(runner.sample(x2, sched, None, cond, ctl, guidance, plan),
                eager.sample(x2, sched, None, cond, ctl, guidance, plan)) < 1e-6
    assert len(captured) == 4, [k.label for k in captured]


def test_the_full_steps_of_a_shape_without_deepcache_are_not_shared(tiny_cpu):
    """No DeepCache at a shape (or another shape's only): today's step is its own graph, which writes no feature."""
    from storyboard_cli.engine import Shape

    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(H, W))
    captured = cpu_replays(runner)
    two, one = Shape(2, H, W, False), Shape(1, H, W, False)
    runner.prepare([two, one], {two: set(step_plan(6, 6, 3, 0)) | {FULL}})
    assert runner.shape_key(1, H, W, False).step == FULL
    assert runner.shape_key(2, H, W, True).step == FULL  # the same size with a ControlNet: its own graph
    assert sorted(k.step.label for k in captured if k.batch == 1) == [""]


def test_a_controlnet_shapes_steps_after_its_end_share_the_plain_shapes_full_step(tiny_cpu):
    """A ControlNet shot's DeepCache after its end runs on the graphs of the shape without a ControlNet; today's step
    of that plain shape is then the same graph."""
    from storyboard_cli.engine import Shape

    runner = GraphRunner(tiny_cpu, max_batch=2, max_hw=(H, W))
    cpu_replays(runner)
    cn, plain = Shape(2, H, W, True), Shape(2, H, W, False)
    runner.prepare([cn, plain], {cn: set(step_plan(6, 6, 3, 0, 2))})
    assert runner.shape_key(2, H, W, False).step == StepKind(True, "write", 0)
    assert runner.shape_key(2, H, W, True).step == FULL  # with the ControlNet still running: its own
