"""Speculative sampling's rule: a sampled row's draft kept or replaced so that its token is
distributed as full depth's."""

from __future__ import annotations

import numpy as np

from ..decoding.sampling import draw


def verify_draft(p: np.ndarray, draft: int, q: np.ndarray, rng: np.random.Generator) -> int:
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023): a ``draft`` token
    drawn from ``q`` (V,) is kept with probability min(1, p[d] / q[d]), else the token is drawn from
    max(p - q, 0), renormalised; either way the token is distributed as ``p`` (V,), the target's."""
    if rng.random() * q[draft] < p[draft]:  # u < p/q without dividing by a q[d] of 0
        return draft
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: nothing to correct
        return int(draw(p[None, :], rng)[0])
    return int(draw(residual[None, :] / total, rng)[0])
