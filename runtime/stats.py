"""What a generation returns and streams: results, per-step events and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .policy import SkipPolicy


@dataclass
class StepStats:
    step: int  # generation step g (its input is the g-th generated token)
    budget: int  # the policy's layer budget for this step
    layers: tuple[int, ...]  # layers this request's rows ran (their active set), ascending
    seconds: float  # wall time of the engine's step (embed + layers + head, all rows together)
    num_layers: int  # L, for the ratios
    rows: tuple[int, ...] = ()  # the request's rows that ran this step (the unfinished ones)
    engine_layers: tuple[int, ...] = ()  # layers the engine ran for all its rows: the union of
    # the running rows' active sets, a superset of ``layers`` when other requests shared the step

    @property
    def theoretical_ratio(self) -> float:
        """L / budget: the speedup this step would give if time were proportional to layers."""
        return self.num_layers / self.budget

    @property
    def achieved_ratio(self) -> float:
        """L / layers actually run."""
        return self.num_layers / max(len(self.layers), 1)


@dataclass
class GenerationStats:
    num_layers: int
    batch_size: int
    prompt_tokens: int  # padded prompt length
    new_tokens: int  # tokens generated per row (until every row finished)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (runtime.prefix_cache), not run
    decode_tokens: int = 0  # tokens the decode steps and verify passes selected, every row's
    # lossless decoding: drafts made and kept, and the full-depth passes that judged them
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    verified_rows: int = 0  # rows over those passes: a pass verifies each of its rows' drafts
    # deep copies (runtime.decoding.copying): deep steps, and the K/V they wrote first for positions
    # that had skipped their layers (one per layer and position)
    deep_steps: int = 0
    filled_positions: int = 0
    decode_calls: int = 0  # decode steps and verify passes run for this request (rows at different
    # depths in one step make a StepStats each)
    # wall clock from the call (or the server's admission of it) to its first token and to its end,
    # waiting for a row and other requests' work included: what the user waits
    first_token_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts kept / drafts made (None: nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_verify(self) -> float | None:
        """Tokens per verify pass and row: its kept drafts and full depth's own next token."""
        if not self.verified_rows:
            return None
        return (self.accepted_tokens + self.verified_rows) / self.verified_rows

    @property
    def layers_per_step(self) -> list[int]:
        return [len(s.layers) for s in self.steps]

    @property
    def row_steps(self) -> tuple[int, int]:
        """(tokens run by the decode steps, layers they ran), every row's: per token, rows apart."""
        return self._tokens, sum(self._rows(s) * len(s.layers) for s in self.steps)

    @property
    def layer_reduction(self) -> float:
        """L / mean(policy budget) over the tokens the decode steps ran (1.0 when none ran): how many times
        fewer layers the policy gave each token, a count, not a measured speed (the time of a step
        also holds the embedding, the head and the framework's overhead)."""
        if not self.steps:
            return 1.0
        return self.num_layers * self._tokens / sum(s.budget * self._rows(s) for s in self.steps)

    @property
    def theoretical_speedup(self) -> float:
        """The former name of ``layer_reduction`` (the speedup if time were proportional to layers)."""
        return self.layer_reduction

    @property
    def achieved_layer_ratio(self) -> float:
        """L / mean(layers the backend actually ran) over the tokens the decode steps ran."""
        if not self.steps:
            return 1.0
        return self.num_layers * self._tokens / sum(len(s.layers) * self._rows(s) for s in self.steps)

    # each step weighs its rows (one where a step names none): rows of one request at one step may
    # run different sets (deep copies)
    @staticmethod
    def _rows(s: StepStats) -> int:
        return max(len(s.rows), 1)

    @property
    def _tokens(self) -> int:
        return sum(map(self._rows, self.steps))

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decode steps produced (each step's rows) per second of them."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        """Decode time / the tokens after the first (the prompt pass gives that one): the wall time a
        row waits for each of its tokens, as llama.cpp's ``predicted_per_token_ms``."""
        return self.decode_seconds * 1e3 / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "batch_size": self.batch_size,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6), "cached_tokens": self.cached_tokens,
                "decode_seconds": round(self.decode_seconds, 6),
                "decode_ms_per_token": round(self.decode_ms_per_token, 3),
                "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
                "first_token_seconds": round(self.first_token_seconds, 6), "seconds": round(self.seconds, 6),
                "layers_per_step": self.layers_per_step,
                "layer_reduction": round(self.layer_reduction, 4),
                "achieved_layer_ratio": round(self.achieved_layer_ratio, 4), **(self.lossless_dict() or {}),
                **({"deep_steps": self.deep_steps, "filled_positions": self.filled_positions} if self.deep_steps else {})}

    def lossless_dict(self) -> dict | None:
        """Lossless decoding's counts (None: no verify pass ran), as to_dict and the server give them."""
        if not self.verify_passes:
            return None
        return {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_passes": self.verify_passes, "acceptance_rate": round(self.acceptance_rate or 0.0, 4),
                "tokens_per_verify": round(self.tokens_per_verify, 4)}

    def __repr__(self) -> str:
        return f"GenerationStats({self.to_dict()})"


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model: the log-softmax of the logits it was
    selected from (before temperature, top-k/top-p and penalties, as OpenAI and vLLM report them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens (k = the request's logprobs), most likely first


@dataclass
class GenerationResult:
    texts: list[str]  # generated text per prompt (prompt excluded)
    token_ids: list[list[int]]  # generated ids per prompt, up to and including EOS / stop
    stats: GenerationStats
    policy: SkipPolicy
    finish_reasons: list[str] = field(default_factory=list)  # per row: "eos", "stop", "length" or "cancelled"
    logprobs: list[list[TokenLogprob]] | None = None  # per row, per generated token (logprobs=k asked)

    def layers_of_row(self, row: int) -> list[tuple[int, ...]]:
        """The layers row ``row`` ran at each of its decode steps."""
        return [s.layers for s in self.stats.steps if row in s.rows]


@dataclass
class TokenEvent:
    """One generation step, as streamed: the new token of every row still running."""

    step: int
    token_ids: list[int | None]  # None for rows that had already finished
    texts: list[str]  # text each row gained at this step ("" for finished rows)
    finished: list[bool]
    logits: np.ndarray | None  # (B, V) fp32 scores the tokens were chosen from, before sampling (None: a
    # stream asked without them, logits=False)
    finish_reasons: list[str | None] = field(default_factory=list)  # per row: "eos", "stop" or
    # "length" at the step the row ended, else None (a streaming server needs it before the result)
    logprobs: list[TokenLogprob | None] | None = None  # per row, with logprobs=k (None: finished rows)
