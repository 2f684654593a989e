"""The tokenizer a job's prompts are counted with, before any model loads: the model's own where the job names a
folder with one, the tiny preset's byte-level one for `tiny`, else CLIP's (both SDXL encoders use CLIP's vocabulary).
Read by the long-prompt warnings (job/prompts.py) and the regions' 77-token check (job/conditions/region.py).
transformers, no torch."""

from __future__ import annotations

from functools import lru_cache

from storyboard_cli.job.digests import weights_path


@lru_cache(maxsize=4)
def tokenizer_for(model: str):
    from storyboard_cli.models.tokenizers import make_tokenizer, real_clip_merges

    if model == "tiny":
        from storyboard_cli.models.tiny import TOKENIZER_MERGES

        return make_tokenizer(TOKENIZER_MERGES)
    folder = weights_path(model)
    if folder is not None and (folder / "tokenizer" / "vocab.json").is_file():
        from transformers import CLIPTokenizer

        return CLIPTokenizer.from_pretrained(str(folder), subfolder="tokenizer")
    return make_tokenizer(real_clip_merges())


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, truncation=False, verbose=False).input_ids)  # with the start and end tokens
