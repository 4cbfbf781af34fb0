"""``GenerationConfig``: every argument of one generation, in one place, with one set of defaults.

``Generator.generate`` / ``stream`` / ``request``, ``runtime.generate``, ``Stepper.add``, the
command line (``python -m runtime``) and the server (``CompletionRequest.generation_config``) only
translate their own spelling into it; the Generator checks it against the model once
(``Generator.request``) and the engine's ``Request`` holds it. A new generation argument is a
field here, its use (the engine, the sampler), and the flags that spell it (CLI, server).

The checks that need no model run here (types and ranges, as the sampler's own); those that need
one (a policy against its layer count, EOS ids and logprobs against its vocabulary, the prompt's
length against the context, a JSON schema compiled over its tokenizer) run in ``Generator.request``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from .decoding.sampling import SamplingConfig
from .errors import InvalidArgumentError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32  # tokens to generate per prompt
    # -- the skip policy (runtime.policy): neither speedup nor policy = the artifact's default
    # a horizon speedup target: picks the policy's min/max layers (the model's own where its
    # manifest names one for that target: speedup_policies, runtime.policy)
    speedup: float | None = None
    policy: Any = None  # a SkipPolicy, or a dict of its fields
    decay: str | None = None  # "linear" | "power": the budget curve; None: the artifact's
    exponent: float | None = None  # of the power decay; None: the artifact's, else 2
    prefill: str | None = None  # "full" | "policy": the prompt's layers; None: the artifact's
    # True: the policy's layers only draft; every token is full depth's (self-speculative decoding)
    lossless: bool = False
    # True: a row whose text copies a rare string of its prompt (a name) runs deeper for those tokens
    # (runtime.decoding.copying); None: the artifact's default (on where its manifest names deep_copies)
    deep_copies: bool | None = None
    # -- sampling (runtime.decoding.sampling.SamplingConfig; transformers' names and defaults)
    do_sample: bool = False  # False: greedy
    temperature: float = 1.0  # divides the logits; < 1 sharpens
    top_k: int = 50  # keep the k most likely tokens; 0 disables (transformers' default, 50)
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 disables
    seed: int | None = None  # of the sampling RNG; None draws from the OS
    presence_penalty: float = 0.0  # OpenAI's penalties on the tokens generated so far; 0 = off
    frequency_penalty: float = 0.0
    # -- when a row ends
    eos_token_id: int | Sequence[int] | None = None  # None: every EOS id the model names
    ignore_eos: bool = False  # generate max_new_tokens even past EOS (benchmarks)
    stop_strings: str | Sequence[str] | None = None  # kept in the text, as transformers
    # -- what the output must be
    json_schema: Any = None  # a JSON schema (dict, or its JSON text) the text must match; None: free text
    # -- what a result records
    logprobs: int | None = None  # k: each token's log-probability and its k most likely; None: none

    def __post_init__(self) -> None:
        self.sampling()  # sampling's types and ranges, checked where the config is made
        if not isinstance(self.lossless, bool):
            raise InvalidArgumentError(f"lossless must be True or False, got {self.lossless!r}", param="lossless")
        if self.deep_copies is not None and not isinstance(self.deep_copies, bool):
            raise InvalidArgumentError(f"deep_copies must be True, False or None, got {self.deep_copies!r}",
                                       param="deep_copies")
        if self.lossless and self.prefill == "policy":
            raise InvalidArgumentError(
                "lossless=True verifies every token at full depth, which reads every layer's K/V of the "
                "prompt: prefill='policy' leaves the layers outside step 0's set without it; leave out "
                "prefill (lossless prompts run at full depth)", param="lossless")

    @classmethod
    def build(cls, config: "GenerationConfig | None" = None, **overrides) -> "GenerationConfig":
        """``config`` (default: the defaults) with ``overrides`` applied: the keyword arguments of
        ``generate``. An unknown name is an InvalidArgumentError that lists the known ones."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise InvalidArgumentError(f"config must be a GenerationConfig, got {type(config).__name__}",
                                       param="config")
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise InvalidArgumentError(
                f"unknown generation argument(s) {', '.join(map(repr, unknown))}; the arguments are "
                f"GenerationConfig's fields: {', '.join(FIELDS)}", param=unknown[0])
        if config is not None and not overrides:
            return config
        return dataclasses.replace(config or cls(), **overrides)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.do_sample, self.temperature, self.top_k, self.top_p, self.seed,
                              self.presence_penalty, self.frequency_penalty)


FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig))

__all__ = ["FIELDS", "GenerationConfig"]
