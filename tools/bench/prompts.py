"""Prompts of an exact token length, so every row and backend sees the same shapes.

Rows of a batch get different text of the same length: no padding, so batch 8 at prompt 128 is
8 x 128 real tokens for every backend.
"""

from __future__ import annotations

_TEXT = """The restaurant near the city centre serves French food at a moderate price and is family
friendly. Language models predict the next token from the tokens before it. The weather today is
warm and sunny, so we will walk to the market and buy bread, cheese, apples and coffee. Paris is
the capital of France. The quick brown fox jumps over the lazy dog. One two three four five six
seven eight nine ten."""
_WORDS = _TEXT.split()
_FILLERS = [" a", " the", ".", ",", " is", "a", "s"]  # short pieces to land on the exact length


class PromptLengthError(ValueError):
    pass


def make_prompt(tokenizer, n_tokens: int, row: int = 0) -> str:
    """A prompt of exactly ``n_tokens`` tokens (special tokens included, as the models see it)."""
    def length(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    if n_tokens < length(""):
        raise PromptLengthError(f"a prompt cannot be shorter than the tokenizer's {length('')} special tokens")
    text, i = "", 7 * row  # each row starts at another word
    while True:
        candidate = (text + " " + _WORDS[i % len(_WORDS)]).strip()
        if length(candidate) > n_tokens:
            break
        text, i = candidate, i + 1
    while length(text) < n_tokens:
        for piece in _FILLERS:
            if length(text) < length(text + piece) <= n_tokens:
                text += piece
                break
        else:
            raise PromptLengthError(f"could not build a prompt of exactly {n_tokens} tokens")
    return text


def make_prompts(tokenizer, batch: int, n_tokens: int) -> list[str]:
    return [make_prompt(tokenizer, n_tokens, row) for row in range(batch)]
