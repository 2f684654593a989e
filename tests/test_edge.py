"""The data and compute edge: guidance without CFG, a control image that breaks after `plan`, bounded
caches, prompts longer than CLIP reads."""

import pytest
import torch

from conftest import write_job
from storyboard_cli.engine.conditioning import BoundedCache, PromptCache, encode_text
from storyboard_cli.engine.eager import EagerEngine
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import make_batches, work_items
from storyboard_cli.job.prompts import long_prompts
from storyboard_cli.run.batch import BatchRunner

RTOL = 1e-4  # as test_parity
W, H, STEPS = 64, 64, 4
PROMPT = "a lighthouse in a storm, ink drawing"


def _job(folder, shots: str, extra: str = ""):
    return load_job(write_job(folder, f"version: 1\nmodel: tiny\n{extra}defaults: {{size: {W}x{H}, steps: {STEPS}, "
                                      f"negative: blurry}}\nshots:\n{shots}"))


def _latents(models, job) -> dict:
    runner = BatchRunner(models, EagerEngine(models))
    return {item.outputs[0]: lat for b in make_batches(work_items(job), job.buckets) for item, lat in runner.run_batch(b)}


@pytest.mark.parametrize("guidance", [0.0, 0.5, 1.0])
def test_guidance_up_to_one_is_the_prompt_alone_as_diffusers(tiny_cpu, tmp_path, guidance):
    import diffusers

    m = tiny_cpu
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=m.vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1], tokenizer=m.tokenizers[0],
        tokenizer_2=m.tokenizers[1], unet=m.unet,
        scheduler=diffusers.EulerDiscreteScheduler.from_config(m.scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=PROMPT, negative_prompt="blurry", height=H, width=W, num_inference_steps=STEPS,
                guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(5), output_type="latent").images[0]
    # in one batch with a guided image: each row decides for itself
    job = _job(tmp_path, f"  - {{id: a, prompt: '{PROMPT}', seed: 5, guidance: {guidance}}}\n"
                         f"  - {{id: b, prompt: '{PROMPT}', seed: 5, guidance: 6}}\n", "buckets: [2]\n")
    got = _latents(m, job)
    err = (torch.linalg.vector_norm(got["a/a_c0_s5.png"] - want) / torch.linalg.vector_norm(want)).item()
    assert err < RTOL, f"guidance {guidance}: relative error {err:.2e}"
    assert not torch.allclose(got["b/b_c0_s5.png"], want)


def test_guidance_up_to_one_ignores_the_negative_prompt(tiny_cpu, tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 5, guidance: 0, negative: blurry}\n"
                         "  - {id: b, prompt: x, seed: 5, guidance: 1, negative: sharp}\n")
    got = _latents(tiny_cpu, job)
    assert torch.equal(got["a/a_c0_s5.png"], got["b/b_c0_s5.png"])


def test_a_control_image_broken_after_plan_fails_only_its_images(tiny_cpu, job_dir):
    import shutil

    shutil.copy(job_dir / "control/hero_pose.png", job_dir / "control/other.png")
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: tiny\nbuckets: [4]\n"
                                      f"defaults: {{size: {W}x{H}, steps: 2}}\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 2, control: {image: control/hero_pose.png}}\n"
                                      "  - {id: b, prompt: y, control: {image: control/other.png}}\n"))
    (job_dir / "control/other.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated by a sync tool")
    (batch,) = make_batches(work_items(job), job.buckets)
    runner = BatchRunner(tiny_cpu, EagerEngine(tiny_cpu))
    done = runner.run_batch(batch)
    assert [item.shot for item, _ in done] == ["a", "a"]
    decoded = runner.decode(done)
    assert [(d.item.shot, d.pixels is None) for d in decoded] == [("a", False), ("a", False), ("b", True)]
    assert decoded[2].failure.startswith("control image control/other.png cannot be read: ")  # as the job names it
    assert "\n" not in decoded[2].failure and str(job_dir) not in decoded[2].failure


def test_a_served_jobs_broken_control_image_is_named_as_the_job_names_it_not_by_its_blob(tiny_cpu, job_dir, tmp_path):
    """A served job reads its files from the blob store (<root>/blobs/<2 hex>/<sha256>): a failure names the file
    as the job wrote it, never the blob's digest or the server's path."""
    from storyboard_cli.job.inputs import Inputs
    from storyboard_cli.serve.blobs import BlobStore

    blobs = BlobStore(tmp_path / "root")
    digest = blobs.put((job_dir / "control/hero_pose.png").read_bytes())
    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\ncontrolnet: tiny\nbuckets: [1]\n"
                                       f"defaults: {{size: {W}x{H}, steps: 2}}\nshots:\n"
                                       "  - {id: b, prompt: y, control: {image: poses/pose.png}}\n"),
                   inputs=Inputs({"poses/pose.png": digest}, blob=blobs.path))
    blob = blobs.path(digest)
    blob.chmod(0o644)
    blob.write_bytes(b"\x89PNG\r\n\x1a\n broken on the server's disk")
    (batch,) = make_batches(work_items(job), job.buckets)
    (failed,) = BatchRunner(tiny_cpu, EagerEngine(tiny_cpu)).readable(batch.items)[1]
    assert failed.failure.startswith("control image poses/pose.png cannot be read: "), failed.failure
    assert digest[:12] not in failed.failure and str(tmp_path) not in failed.failure


def test_the_prompt_cache_stays_within_its_bound_and_stays_right(tiny_cpu):
    one = encode_text(tiny_cpu, ["p0"])
    row_bytes = sum(t[0].numel() * t.element_size() for t in one)
    cache = PromptCache(tiny_cpu, max_bytes=3 * row_bytes)
    prompts = [f"p{i}" for i in range(8)]
    for p in prompts:
        cache.get([p, ""])
    assert len(cache._cache) == 3 and cache._cache.nbytes <= 3 * row_bytes
    embeds, pooled = cache.get(prompts)  # more than it holds, in one call
    want = encode_text(tiny_cpu, prompts)
    torch.testing.assert_close(embeds, want[0])
    torch.testing.assert_close(pooled, want[1])
    assert cache._cache.nbytes <= 3 * row_bytes


def test_each_prompt_is_encoded_on_its_own_whatever_else_is_new(tiny_cpu, monkeypatch):
    """A prompt's embedding must not depend on which other prompts a batch brought in at the same time
    (on a GPU the batch's matrix shapes choose the kernels and their rounding): one encode per prompt,
    so a worker of a multi-GPU render, a resumed run and a one-process render agree."""
    import storyboard_cli.engine.conditioning as cond

    calls = []
    real = cond.encode_text
    monkeypatch.setattr(cond, "encode_text", lambda models, prompts: calls.append(list(prompts)) or real(models, prompts))
    cache = PromptCache(tiny_cpu)
    together, _ = cache.get(["a ship", "a storm", "", "a ship"])
    alone, _ = PromptCache(tiny_cpu).get(["a storm"])
    assert calls == [["a ship"], ["a storm"], ["a storm"]]
    assert torch.equal(together[1], alone[0]) and not together[2].any()


def test_bounded_cache_drops_the_least_recently_used():
    cache = BoundedCache(max_bytes=3 * 4)
    for k in "abc":
        cache.put(k, torch.zeros(1))
    assert cache.lookup("a") is not None  # now the most recent
    cache.put("d", torch.zeros(1))
    assert list(cache) == ["c", "a", "d"] and cache.lookup("b") is None and cache.nbytes == 12


def test_long_prompts_are_reported_with_the_words_dropped(tmp_path):
    words = ", ".join(f"detail{i}" for i in range(40))
    job = load_job(write_job(tmp_path, f"version: 1\nmodel: sdxl-random\nshots:\n"
                                       f"  - {{id: short, prompt: a cat}}\n"
                                       f"  - {{id: long, prompt: '{words}', negative: '{words}'}}\n"))
    found = long_prompts(job)
    assert [(w.shot, w.field) for w in found] == [("long", "prompt"), ("long", "negative")]
    w = found[0]
    assert w.tokens > 77 and w.dropped.endswith("detail39") and "detail0," not in w.dropped
    assert str(w).startswith("shot 'long' (line 5): the prompt is ")
    # the tiny preset's tokenizer is byte-level: a much shorter prompt is already cut
    tiny = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - {id: a, prompt: '"
                                        + "abcd " * 20 + "end'}\n", "tiny.yaml"))
    (cut,) = long_prompts(tiny)
    assert cut.dropped.endswith("end")


def test_a_long_cut_is_warned_by_its_first_words_and_a_count(tmp_path):
    words = " ".join(f"w{i}" for i in range(3000))  # a pasted wall of text: the warning stays one short line
    job = load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - {{id: a, prompt: '{words}'}}\n"))
    (cut,) = long_prompts(job)
    text = str(cut)
    first = cut.dropped.split()[0]
    assert len(text) < 300 and f'dropped: "{first} ' in text and text.endswith(" more words")
    assert f"and {len(cut.dropped.split()) - 12} more words" in text
