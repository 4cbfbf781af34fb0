"""Next-token selection on fp32 logits, with transformers' argument names and order
(temperature, then top-k, then top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validate


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False  # False: greedy argmax, as transformers' default
    temperature: float = 1.0  # divides the logits; < 1 sharpens
    top_k: int = 50  # keep the k most likely tokens; 0 disables (transformers' default is 50)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1.0 disables
    seed: int | None = None  # seed of the sampling RNG; None draws from the OS

    def __post_init__(self) -> None:
        # typed errors (InvalidArgumentError, a SkipDecodeError and a ValueError) from one place
        validate.check_bool("do_sample", self.do_sample)
        validate.check_temperature(self.temperature, self.do_sample)
        validate.check_top_k(self.top_k)
        validate.check_top_p(self.top_p)
        validate.check_seed(self.seed)


def select(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator) -> np.ndarray:
    """logits (B, V) fp32 -> token ids (B,) int64."""
    if not config.do_sample:
        return logits.argmax(axis=-1).astype(np.int64)
    scores = logits.astype(np.float64) / config.temperature  # (B, V)
    if config.top_k and config.top_k < scores.shape[-1]:
        kth = np.partition(scores, -config.top_k, axis=-1)[:, -config.top_k][:, None]  # (B, 1)
        scores = np.where(scores < kth, -np.inf, scores)
    if config.top_p < 1.0:
        order = np.argsort(-scores, axis=-1)  # (B, V) most likely first
        sorted_scores = np.take_along_axis(scores, order, axis=-1)
        probs = _softmax(sorted_scores)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop_sorted = (np.cumsum(probs, axis=-1) - probs) >= config.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        scores = np.where(drop, -np.inf, scores)
    probs = _softmax(scores)
    u = rng.random((probs.shape[0], 1))
    return (probs.cumsum(axis=-1) < u).sum(axis=-1).clip(max=probs.shape[-1] - 1).astype(np.int64)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)
