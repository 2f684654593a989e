"""Offline CLIP tokenizers: byte-level BPE vocabularies built without a hub."""

from __future__ import annotations

import gzip
from pathlib import Path

CLIP_BPE = Path(__file__).parent / "configs" / "clip_bpe_simple_vocab_16e6.txt.gz"
CLIP_TOKENS = 77  # what CLIP's position embeddings hold: start + 75 + end (the text embeddings' rows)


def bytes_to_unicode() -> list[str]:
    """The printable stand-in for each byte, as in CLIP's and GPT-2's byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def clip_vocab(merges: list[str]) -> dict[str, int]:
    """Vocabulary in CLIP's order: bytes, bytes + '</w>', one token per merge, then the two specials."""
    units = bytes_to_unicode()
    tokens = units + [u + "</w>" for u in units] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}


def real_clip_merges() -> list[str]:
    """The 48,894 merges of OpenAI CLIP's tokenizer (MIT licence), shipped gzipped in the package."""
    lines = gzip.open(CLIP_BPE).read().decode("utf-8").split("\n")
    return lines[1 : 49152 - 256 - 2 + 1]  # as CLIP's SimpleTokenizer


def make_tokenizer(merges: list[str], pad_token: str = "<|endoftext|>"):
    from transformers import CLIPTokenizer

    pairs = [tuple(m.split()) for m in merges]
    return CLIPTokenizer(vocab=clip_vocab(merges), merges=pairs, pad_token=pad_token, model_max_length=CLIP_TOKENS)
