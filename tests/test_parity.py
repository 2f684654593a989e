"""Our eager loop against diffusers' SDXL pipelines on the tiny preset: same latents, same inputs."""

import pytest
import torch
from PIL import Image

from conftest import ROOT
from storyboard_cli.engine.conditioning import PromptCache, conditioning, load_control_image
from storyboard_cli.engine.conditions.control import control as make_control
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.sampling import draw_noise, schedule

from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE = 64, 48, 4, 6.5  # small and short: each step is compared whole, at any size
PROMPT, NEGATIVE = "a lighthouse in a storm, ink drawing", "blurry"


@pytest.mark.parametrize("control", [False, True], ids=["plain", "controlnet"])
@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m"])
@pytest.mark.parametrize("negative", ["", NEGATIVE], ids=["zero-negative", "negative"])
def test_same_latents_as_diffusers(tiny_cpu, sampler, control, negative):
    models, seed = tiny_cpu, 1234
    control_path = ROOT / "jobs" / "control" / "hero_pose.png"
    kwargs = {}
    if control:
        kwargs = dict(image=Image.open(control_path).convert("RGB").resize((W, H), Image.LANCZOS),
                      controlnet_conditioning_scale=0.7)
    want = diffusers_pipeline(models, sampler, control)(
        prompt=PROMPT, negative_prompt=negative or None, height=H, width=W, num_inference_steps=STEPS,
        guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
        **kwargs).images

    sched = schedule(sampler, STEPS, models.scheduler_config)
    x, noise = draw_noise([seed], STEPS, (4, H // 8, W // 8), sched)
    cond = conditioning(PromptCache(models), [PROMPT], [negative], W, H)
    ctl = None
    if control:
        ctl = make_control(models, [load_control_image(control_path, W, H)[None]], [[0.7]])
    got = EagerEngine(models).sample(x, sched, noise, cond, Conditions.of(ctl), torch.tensor([GUIDANCE]))

    err = rel_error(got, want)
    assert err < RTOL, f"{sampler}: relative error {err:.2e}"
