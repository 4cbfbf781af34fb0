"""A lossless row's drafts between two verify passes, and how each draft token is chosen."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..decoding.sampling import SamplingConfig, draw, penalize, probabilities
from .plan import DraftPlan


@dataclass(eq=False)
class DraftState:
    """What a lossless row carries beside a plain row's state: its plan (k, pauses) across passes,
    and what it drafted since the last verify pass."""

    plan: DraftPlan
    pending: list = field(default_factory=list)  # (token, q (V,) or None) drafted since the last pass
    first: int = 0  # the token its first draft step ran (the verify pass runs it again)
    base: int = 0  # its KV length before that step: the verify pass writes from there
    proposal: tuple | None = None  # the draft a verify position judges (the engine's token choice)

    def add(self, token: int, q: np.ndarray | None = None) -> int:
        """A draft ``token`` (drawn from ``q`` (V,), kept for the verify pass's rule; None: greedy)."""
        self.pending.append((token, q))
        return token

    def clear(self) -> None:
        """After a verify pass: nothing pending."""
        self.pending, self.proposal = [], None


def next_draft(state: DraftState, logits: np.ndarray, sampling: SamplingConfig, history: list[int],
               rng: np.random.Generator) -> int:
    """A lossless row's next draft from its draft step's logits (V,), after the tokens ``history``:
    greedy, or drawn from the processed distribution q, which is kept for the verify pass's rule."""
    scores = logits
    if sampling.penalized:  # over the tokens so far and the drafts before this one
        scores = penalize(scores, history + [d for d, _ in state.pending], sampling)
    if sampling.do_sample:
        q = probabilities(scores[None, :], sampling)[0]  # (V,)
        token = int(draw(q[None, :], rng)[0])
    else:
        q, token = None, int(scores.argmax())
    return state.add(token, q)
