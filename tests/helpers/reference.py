"""diffusers' SDXL pipelines on our own models: the reference that the CPU parity tests (tests/test_parity.py,
test_lora.py, test_lora_render.py, test_draft_engine.py) hold bcg's latents to."""

import torch

from storyboard_cli.samplers import SAMPLERS

RTOL = 1e-4  # relative L2 error of the final latents, fp32 on the CPU


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative L2 error of `got` against `want`."""
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


def diffusers_pipeline(models, sampler: str = "euler", control: bool = False):
    """StableDiffusionXL(ControlNet)Pipeline over `models`' own modules (no copy: weights written to them show),
    with `sampler`'s diffusers scheduler."""
    import diffusers

    parts = dict(vae=models.vae, text_encoder=models.text_encoders[0], text_encoder_2=models.text_encoders[1],
                 tokenizer=models.tokenizers[0], tokenizer_2=models.tokenizers[1], unet=models.unet,
                 scheduler=getattr(diffusers, SAMPLERS[sampler].scheduler).from_config(models.scheduler_config))
    if control:
        pipe = diffusers.StableDiffusionXLControlNetPipeline(**parts, controlnet=models.controlnets[0])
    else:
        pipe = diffusers.StableDiffusionXLPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe
