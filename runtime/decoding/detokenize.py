"""Incremental detokenization: the text a row gains per step, in O(1) tokens of work per step.

Decoding the whole row every step costs O(n) per step, O(n^2) per generation, and it ran inside the
timed decode loop. As Hugging Face's TextStreamer and vLLM do, only a short window of tokens is
decoded: the text of ``tokens[prefix:]`` minus that of ``tokens[prefix:read]``. Byte-level BPE can
split one character across tokens; while the window's text ends in U+FFFD (an incomplete UTF-8
sequence) nothing is emitted, and ``flush`` emits whatever is left when the row ends, so the
concatenated deltas equal ``tokenizer.decode(all tokens)``.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens before this index have been emitted as text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append ``token``; return the text it completes ("" while a character is unfinished)."""
        self.tokens.append(token)
        prefix_text = self._decode(self.prefix, self.read)
        text = self._decode(self.prefix)
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.tokens)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text of tokens not yet emitted (an unfinished character decodes as U+FFFD)."""
        text = self._decode(self.prefix)[len(self._decode(self.prefix, self.read)):]
        self.prefix = self.read = len(self.tokens)
        return text
