"""LoRAs through bcg's own path (job -> plan -> BatchRunner -> eager engine) on the tiny preset, against
diffusers' StableDiffusionXLPipeline + load_lora_weights + set_adapters on the same latents."""

import copy
import dataclasses

import torch

from conftest import ROOT, write_job
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.folder.report import lora_section
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import lora_swaps, make_batches, work_items
from storyboard_cli.run.batch import BatchRunner

from helpers.reference import RTOL, diffusers_pipeline, rel_error

MEI = ROOT / "jobs" / "loras" / "mei.safetensors"
W, H, STEPS, GUIDANCE, SEED = 64, 64, 4, 6.5, 7
PROMPT, NEGATIVE = "a lighthouse in a storm, ink drawing", "blurry"


def _job(tmp_path, shots: str, name: str = "job.yaml"):
    return load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\nbuckets: [1, 2]\nloras:\n  mei: {MEI}\n"
                                        f"defaults: {{size: {W}x{H}, steps: {STEPS}, guidance: {GUIDANCE}, "
                                        f"negative: {NEGATIVE}}}\nshots:\n{shots}", name))


def _render(lora_models, job, ahead: bool = False):
    """Every batch of the job through one BatchRunner, in plan order -> ({output: latents}, {output: pixels},
    runner); the runner is closed (weights restored) before it returns. `ahead`: each batch's prompts encoded beside
    the batch before, as on a GPU."""
    runner = BatchRunner(lora_models, EagerEngine(lora_models), loras=job.loras.values(), ahead=ahead)
    latents, pixels = {}, {}
    batches = make_batches(work_items(job), job.buckets)
    try:
        for i, batch in enumerate(batches):
            done = runner.run_batch(batch, upcoming=batches[i + 1:])
            for item, lat in done:
                latents[item.outputs[0]] = lat
            for d in runner.decode(done):
                pixels[d.item.outputs[0]] = d.pixels
    finally:
        runner.close()
    return latents, pixels, runner


def _diffusers(lora_models, loras: dict[str, float]):
    pipe = diffusers_pipeline(copy.deepcopy(lora_models))
    for name in loras:
        pipe.load_lora_weights(str(MEI), adapter_name=name)
    if loras:
        pipe.set_adapters(list(loras), list(loras.values()))
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_inference_steps=STEPS,
                guidance_scale=GUIDANCE, generator=torch.Generator("cpu").manual_seed(SEED),
                output_type="latent").images[0]


def test_a_shot_with_a_lora_equals_diffusers_load_lora_weights(lora_models, tmp_path):
    job = _job(tmp_path, f"  - {{id: plain, prompt: '{PROMPT}', seed: {SEED}}}\n"
                         f"  - {{id: mei, prompt: '{PROMPT} <lora:mei:0.8>', seed: {SEED}}}\n")
    latents, _, runner = _render(lora_models, job)
    plain, mei = latents["plain/plain_c0_s7.png"], latents["mei/mei_c0_s7.png"]
    want_plain, want_mei = _diffusers(lora_models, {}), _diffusers(lora_models, {"mei": 0.8})
    assert rel_error(want_mei, want_plain) > 50 * RTOL, "the LoRA must change the picture for this test to mean anything"
    assert rel_error(plain, want_plain) < RTOL
    assert rel_error(mei, want_mei) < RTOL, f"relative error {rel_error(mei, want_mei):.2e}"
    assert [s.after for s in runner.lora_swaps()] == [(("mei", job.loras["mei"].sha256, 0.8),), ()]


def test_the_prompt_tag_and_the_lora_field_give_the_same_pixels(lora_models, tmp_path):
    tag = _job(tmp_path, f"  - {{id: a, prompt: '{PROMPT} <lora:mei:0.8>', seed: 3}}\n", "tag.yaml")
    field = _job(tmp_path, f"  - {{id: a, prompt: '{PROMPT}', lora: {{mei: 0.8}}, seed: 3}}\n", "field.yaml")
    (a,), (b,) = work_items(tag), work_items(field)
    assert a.fingerprint("tiny") == b.fingerprint("tiny")
    _, one, _ = _render(lora_models, tag)
    _, two, _ = _render(lora_models, field)
    assert torch.equal(one["a/a_c0_s3.png"], two["a/a_c0_s3.png"])


def test_swaps_follow_the_plan_and_the_weights_come_back_bit_for_bit(lora_models, tmp_path):
    params = [p for root in (lora_models.unet, *lora_models.text_encoders) for p in root.parameters()]
    before = [p.detach().clone() for p in params]
    pointers = [p.data_ptr() for p in params]
    job = _job(tmp_path, "  - {id: a, prompt: x, lora: {mei: 1}}\n  - {id: b, prompt: y}\n"
                         "  - {id: c, prompt: z, lora: {mei: 0.5}}\n  - {id: d, prompt: w, lora: {mei: 1}}\n")
    batches = make_batches(work_items(job), job.buckets)
    latents, pixels, runner = _render(lora_models, job)
    assert len(pixels) == 4 and all(p is not None for p in pixels.values())
    swaps = runner.lora_swaps()
    assert len(swaps) == lora_swaps(batches) + 1 == 3  # mei 1, mei 0.5, then back to the model's own
    summary = lora_section(swaps)  # as the report gets them
    assert summary["sets"] == [["none", "mei 1"], ["mei 1", "mei 0.5"], ["mei 0.5", "none"]]
    assert summary["swaps"] == 3 and min(summary["layers"]) > 0 and runner.lora.resident_bytes()["device"] > 0
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [p.data_ptr() for p in params] == pointers


def test_a_text_encoder_lora_is_part_of_the_prompt_cache_key(lora_models, tmp_path):
    """The same prompt under mei and without: two encodings, not one reused."""
    job = _job(tmp_path, "  - {id: a, prompt: same, lora: {mei: 1}}\n  - {id: b, prompt: same}\n")
    runner = BatchRunner(lora_models, EagerEngine(lora_models), loras=job.loras.values())
    try:
        embeds = {}
        for batch in make_batches(work_items(job), job.buckets):
            key = runner.apply_loras(batch.items[0])
            embeds[batch.items[0].shot] = runner.prompts.get(["same"], key)[0]
    finally:
        runner.close()
    assert not torch.allclose(embeds["a"], embeds["b"])


def test_prompts_are_encoded_ahead_only_under_the_text_loras_their_batch_uses(lora_models, tmp_path, monkeypatch):
    """A batch whose text-encoder LoRAs differ from the batch before's is encoded after its own swap, in its own
    run_batch; one under the same set is encoded while the batch before denoises. The latents are those of batches
    that each encode their own prompts."""
    import storyboard_cli.engine.conditioning as conditioning

    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 1}\n  - {id: b, prompt: y, seed: 2}\n"
                         "  - {id: c, prompt: z, lora: {mei: 1}, seed: 3}\n  - {id: d, prompt: w, lora: {mei: 1}, seed: 4}\n")
    job = dataclasses.replace(job, buckets=(1,))  # a batch per shot
    encode, run_batch, events = conditioning.encode_text, BatchRunner.run_batch, []

    def recorded(models, prompts):
        events.append(("encode", prompts[0]))
        return encode(models, prompts)

    def running(self, batch, fallback=False, upcoming=None):
        events.append(("batch", batch.items[0].shot))
        return run_batch(self, batch, fallback, upcoming)

    monkeypatch.setattr(conditioning, "encode_text", recorded)
    monkeypatch.setattr(BatchRunner, "run_batch", running)
    latents, _, _ = _render(lora_models, job, ahead=True)
    monkeypatch.undo()
    want, _, _ = _render(lora_models, job)
    assert latents.keys() == want.keys() and all(torch.equal(latents[k], want[k]) for k in want)
    during, shot = {}, None
    for kind, what in events:
        if kind == "batch":
            shot = what
        elif what in set("xyzw"):
            assert what not in during, f"{what} encoded twice"
            during[what] = shot
    order = [what for kind, what in events if kind == "batch"]
    prompt = {"a": "x", "b": "y", "c": "z", "d": "w"}
    # each LoRA set's first batch encodes its own prompt after its swap; the set's second batch, during the first
    for first, second in (("a", "b"), ("c", "d")):
        first, second = sorted((first, second), key=order.index)
        assert (during[prompt[first]], during[prompt[second]]) == (first, first), (order, during)
