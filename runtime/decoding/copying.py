"""Deep copies: a SkipDecode row runs deeper while it copies a rare string of its prompt.

Why: a name the model never saw (a new restaurant, a person) is copied right only by the layers from
about the middle up; at 5x a position keeps the top 4-8 of 30, and the fine-tuned E2E model mangled
or replaced 36% of new names' slots (docs/quality.md, "New venue names"). No position-only budget
gives every name those layers at a 5x average, so the budget also depends on the token: a step whose
input token lies in a rare string of the prompt (inside it, at its end, or just before it: "near"
before "near[Corgladun Stable]") runs ``layers`` (the warm-up layers and the top ones) as well as its
own set. A position that skipped a layer the deep step runs has no K/V there: the runner writes it
first from the position's hidden state after the warm-up layers, which is what such a position
carries to the layers it runs (tools.finetune.skip.skip_forward's dense pass computes every skipped
layer's K/V the same way, so a deep step equals that pass with the deep positions' layers added).

Which strings are rare: the words of the prompt outside ``common`` (a model's task words, which
tools.finetune finds in its training targets, plus English function words), so that "coffee shop"
or "the" copy at the row's own depth.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ArtifactError

WORD = r"[^\s\[\](),=:\"]+"
# what follows a word, up to three words: a value after its key ("near" -> "[The Jade Dovecote")
_BEFORE = re.compile(r"[\s\[\]=:(\"]{1,2}(" + WORD + "(?: " + WORD + "){0,2})")
_TAIL = re.compile(r"(\S+)$")
_PUNCT = ".,;:!?"

# the commonest English function words: never rare, whatever a model's task words are
FUNCTION_WORDS = frozenset("""a about after all also an and any are as at be been but by can could did do
does for from had has have he her his how i if in into is it its it's just me more most my no not of on
one or other our out over she so some such than that the their them then there these they this those to
up us was we were what when where which who will with would you your""".split())


@dataclass(frozen=True)
class DeepCopies:
    """A model's deep-copy setting (the manifest's ``policy.deep_copies``)."""

    layers: int  # a deep step's budget: the warm-up layers and the top layers - warm-up
    common: frozenset[str] = frozenset()  # the task's common words (never rare)

    @classmethod
    def from_manifest(cls, entry, num_layers: int) -> "DeepCopies":
        if not isinstance(entry, dict) or not isinstance(entry.get("layers"), int) or isinstance(entry.get("layers"), bool):
            raise ArtifactError(f"policy.deep_copies must be {{'layers': int, 'common_words': [str, ...]}}, got {entry!r}")
        if not 1 <= entry["layers"] <= num_layers:
            raise ArtifactError(f"policy.deep_copies.layers must lie in [1, {num_layers}] (the model's layers), "
                                f"got {entry['layers']}")
        words = entry.get("common_words", [])
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ArtifactError("policy.deep_copies.common_words must be a list of strings")
        return cls(entry["layers"], frozenset(words))

    @classmethod
    def default(cls, num_layers: int) -> "DeepCopies":
        """For a model whose manifest names none: half the layers and one, no task words."""
        return cls(min(num_layers, num_layers // 2 + 1))

    def deep_set(self, warmup: int, num_layers: int) -> set[int]:
        """The layers a deep step runs besides its own set."""
        return set(range(min(warmup, self.layers))) | set(range(num_layers - (self.layers - warmup), num_layers))

    def rule(self, prompt: str) -> "CopyRule":
        return CopyRule(prompt, self.common)


@dataclass(frozen=True)
class CopyRule:
    """Whether a row's text so far ends in a rare string of its ``prompt``."""

    prompt: str
    common: frozenset[str] = frozenset()

    def rare(self, word: str) -> bool:
        bare = word.rstrip(_PUNCT)
        stem = bare[:-2] if bare.endswith("'s") else bare
        return bool(stem) and not any(w in self.common or w.lower() in FUNCTION_WORDS for w in (bare, stem))

    def due(self, text: str) -> bool:
        """The output's last word lies in a rare word of the prompt (inside it or at its end), or is
        followed there by one: the next token may copy it."""
        if not text or text[-1].isspace():
            return False
        tail = _TAIL.search(text).group(1)
        prompt = self.prompt
        for found in re.finditer(re.escape(tail), prompt):
            i, j = found.start(), found.end()
            if i > 0 and prompt[i - 1].isalnum():  # not at a word's start
                continue
            rest = prompt[j:]
            if rest[:1].isalnum():  # inside a word of the prompt
                if self.rare(tail + re.match(WORD, rest).group(0)):
                    return True
                continue
            after = _BEFORE.match(rest)
            if self.rare(tail) or (after is not None and any(map(self.rare, after.group(1).split()))):
                return True
        return False


__all__ = ["CopyRule", "DeepCopies", "FUNCTION_WORDS"]
