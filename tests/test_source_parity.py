"""The source kind (img2img, inpainting) against diffusers on the tiny preset: StableDiffusionXLImg2ImgPipeline,
StableDiffusionXLInpaintPipeline (4-channel UNet) and StableDiffusionXLControlNetInpaintPipeline, latents passed as the
image, output_type="latent"; the crop region and the paste as diffusers' VaeImageProcessor computes them."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT
from storyboard_cli.engine.conditioning import PromptCache, conditioning, load_control_image
from storyboard_cli.engine.conditions.control import control as make_control
from storyboard_cli.engine.conditions.kind import Conditions
from storyboard_cli.engine.conditions.source import Reader
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.engine.sampling import draw_noise, schedule
from storyboard_cli.job.conditions.source import SourceInit, SourceMask, crop_region, overlay, skipped
from storyboard_cli.job.items import BucketKey
from storyboard_cli.samplers import SAMPLERS

from helpers.reference import RTOL, diffusers_pipeline, rel_error

W, H, STEPS, GUIDANCE = 64, 48, 6, 6.5
PROMPT, NEGATIVE = "a lighthouse in a storm, ink drawing", "blurry"
BOX = (16, 8, 24, 24)  # the repainted area, in pixels of the W x H source


def source_latents(seed: int = 7) -> torch.Tensor:
    return torch.randn(1, 4, H // 8, W // 8, generator=torch.Generator("cpu").manual_seed(seed))


class LatentsReader(Reader):
    """The kind's reader with the source's latents given (as diffusers is given them) instead of encoded."""

    def __init__(self, models, latents):
        super().__init__(models)
        self.given = latents

    def latents(self, item):
        return self.given


def item(seed: int, strength: float | None, box: tuple | None = None, padding: int | None = None):
    init = None if strength is None else SourceInit(Path("source.png"), "source.png", "0" * 64, strength, W, H)
    mask = None if box is None else SourceMask(None, "", "", box, 0, padding)
    return SimpleNamespace(init=init, mask=mask, seed=seed, width=W, height=H)


def ours(models, sampler, rows, latents, control=None, end=1.0):
    """bcg's eager loop over the rows' batch (their bucket key, their Blend, the schedule's tail)."""
    strength = next((r.init.strength for r in rows if r.init is not None), 1.0)
    key = BucketKey(W, H, STEPS, sampler, init_skip=skipped(STEPS, strength), nets=(0,) if control else (),
                    control_end=end)
    sched = schedule(sampler, STEPS, models.scheduler_config, key.first)
    x, noise = draw_noise([r.seed for r in rows], sched.steps, (4, H // 8, W // 8), sched)
    blend = LatentsReader(models, latents).batch(rows, key)
    conds = Conditions.of(control, blend)
    n = len(rows)
    cond = conditioning(PromptCache(models), [PROMPT] * n, [NEGATIVE] * n, W, H)
    return EagerEngine(models).sample(conds.begin(x), sched, noise, cond, conds, torch.tensor([GUIDANCE] * n),
                                      key.plan)


def theirs(pipe, seed, **kwargs):
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
                **kwargs).images


def pipeline(models, sampler, cls):
    import diffusers

    base = diffusers_pipeline(models, sampler)
    parts = {k: v for k, v in base.components.items() if k in ("vae", "text_encoder", "text_encoder_2", "tokenizer",
                                                                "tokenizer_2", "unet", "scheduler")}
    if "ControlNet" in cls:
        parts["controlnet"] = models.controlnets[0]
    pipe = getattr(diffusers, cls)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("strength", [0.3, 0.5, 0.75, 1.0])
def test_img2img_equals_diffusers(tiny_cpu, sampler, strength):
    models, seed, x0 = tiny_cpu, 1234, source_latents()
    want = theirs(pipeline(models, sampler, "StableDiffusionXLImg2ImgPipeline"), seed, image=x0, strength=strength)
    got = ours(models, sampler, [item(seed, strength)], x0)
    assert rel_error(got, want) < RTOL, f"{sampler} at {strength}"


@pytest.mark.parametrize("strength", [0.6, 0.9999, 1.0])
def test_inpainting_equals_diffusers(tiny_cpu, strength):
    models, seed, x0 = tiny_cpu, 4321, source_latents()
    row = item(seed, strength, BOX)
    mask = row.mask.pil((W, H))
    want = theirs(pipeline(models, "euler", "StableDiffusionXLInpaintPipeline"), seed, image=x0, mask_image=mask,
                  strength=strength)
    got = ours(models, "euler", [row], x0)
    assert rel_error(got, want) < RTOL, strength
    if strength == 0.9999:  # S - 1 steps: the tail from step 1
        assert skipped(STEPS, strength) == 1
    # outside the mask (in latents: a whole 8-pixel cell away from the box) the latents are the source's
    x, y, w, h = (v // 8 for v in BOX)
    outside = torch.ones(H // 8, W // 8, dtype=torch.bool)
    outside[y:y + h, x:x + w] = False
    torch.testing.assert_close(got[0][:, outside], x0[0][:, outside])


@pytest.mark.parametrize("end", [0.5, 1.0])
def test_controlnet_inpainting_equals_diffusers_with_control_guidance_end(tiny_cpu, end):
    models, seed, x0, strength = tiny_cpu, 99, source_latents(), 0.75
    path = ROOT / "jobs" / "control" / "hero_pose.png"
    row = item(seed, strength, BOX)
    pipe = pipeline(models, "euler", "StableDiffusionXLControlNetInpaintPipeline")
    # this pipeline takes no latents as its image: its VAE encode gives them (drawing nothing from the generator)
    pipe._encode_vae_image = lambda image, generator: x0
    want = theirs(pipe, seed, image=Image.new("RGB", (W, H)),
                  mask_image=row.mask.pil((W, H)), strength=strength,
                  control_image=Image.open(path).convert("RGB").resize((W, H), Image.LANCZOS),
                  controlnet_conditioning_scale=0.9, control_guidance_end=end)
    control = make_control(models, [load_control_image(path, W, H)[None]], [[0.9]])
    got = ours(models, "euler", [row], x0, control, end)
    assert rel_error(got, want) < RTOL, end


def test_rows_with_and_without_masks_and_sources_share_a_batch(tiny_cpu):
    """A batch of an inpainting, an img2img and a plain row (strength 1: one schedule) equals each row alone; and one
    of an inpainting and an img2img at the same strength."""
    models, x0 = tiny_cpu, source_latents()
    for rows in ([item(11, 1.0, BOX), item(12, 1.0), item(13, None)], [item(21, 0.5, BOX), item(22, 0.5)]):
        together = ours(models, "euler_a", rows, x0)
        for i, row in enumerate(rows):
            alone = ours(models, "euler_a", [row], x0)
            assert rel_error(together[i:i + 1], alone) < 1e-5


# ---------------------------------------------------------------- the crop and the paste, as diffusers'


def random_mask(rng, w, h) -> Image.Image:
    a = np.zeros((h, w), np.uint8)
    for _ in range(rng.integers(1, 3)):
        x, y = rng.integers(0, w - 1), rng.integers(0, h - 1)
        a[y:y + rng.integers(1, h // 2), x:x + rng.integers(1, w // 2)] = rng.choice([40, 255])
    return Image.fromarray(a, "L")


def test_crop_regions_equal_diffusers_get_crop_region():
    from diffusers.image_processor import VaeImageProcessor

    rng = np.random.default_rng(0)
    for _ in range(300):
        w, h = int(rng.integers(16, 300)), int(rng.integers(16, 300))
        mask = random_mask(rng, w, h)
        size = tuple(int(v) for v in rng.choice([64, 128, 512, 1024, 1216, 832], 2))
        pad = int(rng.choice([0, 4, 32, 100]))
        assert crop_region(mask, *size, pad) == VaeImageProcessor.get_crop_region(mask, *size, pad=pad), (w, h, size, pad)


@pytest.mark.parametrize("blur", [0, 3])
def test_the_paste_equals_diffusers_apply_overlay(blur):
    from diffusers.image_processor import VaeImageProcessor

    rng = np.random.default_rng(blur)
    source = Image.fromarray(rng.integers(0, 255, (150, 200, 3), dtype=np.uint8))
    mask = SourceMask(None, "", "", (60, 40, 50, 30), blur, 16)
    pil = mask.pil(source.size)
    crop = crop_region(pil, 96, 64, 16)
    rendered = Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
    want = VaeImageProcessor().apply_overlay(pil, source, rendered, crop)
    got = overlay(pil, source, rendered, crop)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    outside = np.asarray(pil) == 0
    assert np.array_equal(np.asarray(got)[outside], np.asarray(source)[outside])
