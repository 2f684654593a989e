"""Prompts longer than CLIP reads: the words the text encoders will never see, found before any model
loads, so `bcg plan` and the report can say so per shot (two shots that differ only past the limit
give the same image).

The tokenizer is the model's own where the job names a folder with one, the tiny preset's byte-level
one for `tiny`, else CLIP's (both SDXL encoders use CLIP's vocabulary). transformers, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from storyboard_cli.job.file import Job
from storyboard_cli.job.preflight import job_spec
from storyboard_cli.job.tokens import token_count as _count
from storyboard_cli.job.tokens import tokenizer_for
from storyboard_cli.models.tokenizers import CLIP_TOKENS

SHOWN_WORDS = 12  # of the dropped text, in a warning: a pasted wall of text is cut to its first words


@dataclass(frozen=True)
class LongPrompt:
    shot: str
    field: str  # "prompt" | "negative"
    line: int  # the shot's line in the job file
    tokens: int  # with the start and end tokens, as the encoders count
    dropped: str  # the text cut off, as the tokenizer decodes it

    def __str__(self) -> str:
        shown = _shown(self.dropped)
        return (f"shot '{self.shot}' (line {self.line}): the {self.field} is {self.tokens} tokens, CLIP reads "
                f"{CLIP_TOKENS}; dropped: \"{shown}")


@lru_cache(maxsize=16)  # by value: the shots that share a long prompt share its text
def _shown(dropped: str) -> str:
    """The dropped text as a warning quotes it: its first SHOWN_WORDS words, and how many more."""
    words = dropped.split()
    more = len(words) - SHOWN_WORDS
    return " ".join(words[:SHOWN_WORDS]) + (f" ...\" and {more} more word{'s' * (more != 1)}" if more > 0 else '"')


def dropped_text(prompt: str, tokenizer) -> tuple[int, str]:
    """(tokens, the words past the limit, from the first one cut even in part) for one prompt; "" when it
    fits. Words as the artist wrote them: CLIP's decode would print `detail 3 9` for `detail39`."""
    limit = tokenizer.model_max_length
    tokens = _count(tokenizer, prompt)
    if tokens <= limit:
        return tokens, ""
    # CLIP splits words at whitespace first, so the tokens of the first k words are a prefix of the
    # prompt's: the longest prefix that fits, by bisection. A word is at least one token, so `limit` words
    # (with the start and end tokens) never fit: the search never tokenizes more of a long prompt than that
    words = prompt.split()
    lo, hi = 0, min(len(words), limit)  # words[:lo] fits, words[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _count(tokenizer, " ".join(words[:mid])) <= limit else (lo, mid)
    return tokens, " ".join(words[lo:])


def long_prompts(job: Job) -> list[LongPrompt]:
    """Every shot's prompt or negative prompt that the text encoders will cut, with the words they drop."""
    found = []
    tokenizer = None
    cut: dict[str, tuple[int, str]] = {}  # by text: a prompt many shots share (a YAML alias) is tokenized once
    for shot in job.shots:
        for field, text in (("prompt", shot.prompt), ("negative", shot.negative)):
            if len(text) <= CLIP_TOKENS - 2:
                continue  # a token is at least one character: this fits without asking the tokenizer
            if text not in cut:
                if len("".join(text.split()).encode()) <= CLIP_TOKENS - 2:
                    cut[text] = (0, "")  # nor does this: a token is at least one byte of a word
                else:
                    tokenizer = tokenizer or tokenizer_for(job_spec(job.model, job.folder))
                    cut[text] = dropped_text(text, tokenizer)
            tokens, dropped = cut[text]
            if dropped:
                found.append(LongPrompt(shot.id, field, shot.line, tokens, dropped))
    return found
