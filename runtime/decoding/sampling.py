"""Next-token selection on fp32 logits, with transformers' argument names and order
(temperature, then top-k, then top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import validate
from ..errors import InvalidArgumentError
from ..stats import TokenLogprob

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of presence_penalty and frequency_penalty


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False  # False: greedy argmax, as transformers' default
    temperature: float = 1.0  # divides the logits; < 1 sharpens
    top_k: int = 50  # keep the k most likely tokens; 0 disables (transformers' default is 50)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1.0 disables
    seed: int | None = None  # seed of the sampling RNG; None draws from the OS
    # OpenAI's penalties on the tokens a row generated so far (0 = off): logits -= presence * (count > 0)
    # + frequency * count, before temperature; greedy decoding applies them too
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        # typed errors (InvalidArgumentError, a SkipDecodeError and a ValueError) from one place
        validate.check_bool("do_sample", self.do_sample)
        validate.check_temperature(self.temperature, self.do_sample)
        validate.check_top_k(self.top_k)
        validate.check_top_p(self.top_p)
        validate.check_seed(self.seed)
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise InvalidArgumentError(f"{name} must be a number in [{low:g}, {high:g}] (0 disables it), "
                                           f"got {value!r}", param=name)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def penalize(logits: np.ndarray, generated: list[int], config: SamplingConfig) -> np.ndarray:
    """logits (V,) -> (V,) with OpenAI's presence and frequency penalties for the ``generated`` ids."""
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=logits.shape[-1])[: logits.shape[-1]]
    return logits - (config.presence_penalty * (counts > 0) + config.frequency_penalty * counts).astype(np.float32)


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The log-softmax of ``logits`` (V,) at ``token``, and its ``k`` most likely tokens."""
    x = logits.astype(np.float64)
    m = x.max()
    logp = x - (m + np.log(np.exp(x - m).sum()))  # (V,)
    top = np.argpartition(-logp, k - 1)[:k] if 0 < k < logp.shape[0] else np.arange(logp.shape[0] if k else 0)
    top = top[np.argsort(-logp[top], kind="stable")]
    return TokenLogprob(int(token), float(logp[token]), [(int(i), float(logp[i])) for i in top])


def select(logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator) -> np.ndarray:
    """logits (B, V) fp32 -> token ids (B,) int64."""
    if not config.do_sample:
        return logits.argmax(axis=-1).astype(np.int64)
    return draw(probabilities(logits, config), rng)


def probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """logits (B, V) fp32 -> (B, V) fp64: the distribution ``select`` samples from (temperature,
    then top-k, then top-p)."""
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
    return _softmax(scores)


def draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """probs (B, V) -> one token id per row (B,) int64, by inverting the cumulative distribution."""
    u = rng.random((probs.shape[0], 1))
    return (probs.cumsum(axis=-1) < u).sum(axis=-1).clip(max=probs.shape[-1] - 1).astype(np.int64)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)
