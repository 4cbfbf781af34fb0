"""Structured output: rows whose tokens must spell JSON matching a schema (llguidance).

A constrained row's logits are masked before sampling to the tokens that keep its text a valid
prefix of some document of the schema, and each token it selects advances its matcher; once the
document is complete the row ends ("stop"). The mask is a bitmask over the vocabulary computed by
llguidance's Earley parser in Rust (``llguidance.numpy``: no torch, so the ONNX Runtime runtime
stays free of it), per row, so constrained and free rows share a batch and any skip policy.

llguidance is optional (``pip install 'skipdecode-edge[json]'``): imported when the first schema
is compiled, and a missing install is one line that names the extra. Its tokenizer is built once
per Generator from the artifact's tokenizer.json (~0.35 s for SmolLM2's 49k vocabulary).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError

JSON_OBJECT = {"type": "object"}  # OpenAI's response_format {"type": "json_object"}: any JSON object
# The layout of the text (a schema's own "x-guidance" wins): separators as Python's json.dumps and
# no free whitespace, so a model gone astray (under an aggressive skip policy, say) cannot spend its
# tokens on the whitespace JSON would allow between any two tokens of the document.
LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise InvalidArgumentError(
            "json_schema needs llguidance, the constrained-decoding library: pip install "
            "'skipdecode-edge[json]' (or pip install llguidance)", param="json_schema") from None
    return llguidance


def _one_line(error) -> str:
    """llguidance's message on one line: a regex error spans several (the pattern, a caret under the
    fault, the reason), and a CLI error or an HTTP error's message is one line."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


class Structured:
    """One Generator's compiler of schemas into grammars, over its tokenizer (built on first use)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: list[int]):
        self.tokenizer_json, self.vocab_size, self.eos_ids = Path(tokenizer_json), vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # requests are made on the callers' threads

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                if not self.tokenizer_json.is_file():
                    raise InvalidArgumentError(f"json_schema needs the artifact's {self.tokenizer_json.name}, "
                                               f"not found at {self.tokenizer_json}; re-export the artifact",
                                               param="json_schema")
                eos = self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids
                self._tokenizer = llg.LLTokenizer(self.tokenizer_json.read_text(encoding="utf-8"),
                                                  n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def compile(self, schema) -> "Constraint":
        """``schema``: a JSON schema as a dict or its JSON text. Refused with what is wrong."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidArgumentError(f"json_schema is not valid JSON: {exc}", param="json_schema") from None
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"json_schema must be a JSON schema (an object), got {type(schema).__name__}",
                                       param="json_schema")
        llg = _llguidance()
        tokenizer = self._llg_tokenizer()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=LAYOUT)
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"json_schema cannot be compiled: {_one_line(exc)}", param="json_schema") from None
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidArgumentError(f"json_schema cannot be compiled: {_one_line(error)}", param="json_schema")
        return Constraint(llg, tokenizer, grammar, self.vocab_size)


class Constraint:
    """A compiled schema; ``matcher()`` gives each row its own state."""

    def __init__(self, llg, tokenizer, grammar: str, vocab_size: int):
        self._llg, self._tokenizer, self.grammar, self.vocab_size = llg, tokenizer, grammar, vocab_size

    def matcher(self) -> "RowMatcher":
        return RowMatcher(self._llg, self._llg.LLMatcher(self._tokenizer, self.grammar, log_level=1),
                          self.vocab_size)


class RowMatcher:
    """One row's place in its grammar: masks its logits, follows its tokens."""

    def __init__(self, llg, matcher, vocab_size: int):
        self._numpy, self._matcher = llg.numpy, matcher
        self._bitmask = llg.numpy.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits (V,) fp32 -> a copy with the tokens the grammar forbids at -inf."""
        self._numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        masked = logits[None, :].astype(np.float32, copy=True)  # (1, V)
        self._numpy.apply_token_bitmask_inplace(masked, self._bitmask)
        return masked[0]

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (~0.5 us: no mask is computed). Greedy decoding asks this
        of its argmax first: when the grammar allows it, it is also the masked logits' argmax."""
        return self._matcher.validate_tokens([token]) == 1

    def consume(self, token: int) -> bool:
        """Advance by ``token``; True once the document is complete (nothing but EOS may follow)."""
        if not self._matcher.consume_token(token):  # only a token the mask allowed gets here
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        return self._matcher.is_stopped()


__all__ = ["Constraint", "JSON_OBJECT", "RowMatcher", "Structured"]
