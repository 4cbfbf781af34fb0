"""What the engine holds for each request and row, and the costs it has measured."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np

from ..decoding.copying import CopyRule, DeepCopies
from ..decoding.detokenize import IncrementalDetokenizer
from ..decoding.sampling import SamplingConfig
from ..errors import SkipDecodeError
from ..generation_config import GenerationConfig
from ..lossless import DraftPlan, DraftState
from ..policy import SkipPolicy
from ..stats import GenerationStats


class EngineClosedError(SkipDecodeError, RuntimeError):
    """A request submitted to, or still running in, a Generator that was closed."""


class QueueFullError(SkipDecodeError, RuntimeError):
    """More requests waiting than the Generator's ``max_queue``: retry later."""


DONE = object()  # the last item of a request's event queue, after its result or error


@dataclass(eq=False)  # identity: a row is found in the cache by what it is
class Sequence:
    """One row of a request: its KV row while seated, its own step and random stream."""

    request: "Request"
    index: int  # its row in the request (the prompt's position in the call)
    rng: np.random.Generator
    row: int = -1  # its row in the KV cache while seated, else -1
    step: int = 0  # generation step g of the next token it selects
    token: int = 0  # the token it runs at its next decode step
    text: str = ""
    reason: str | None = None  # why it stopped: "eos", "stop" or "length"
    logits: np.ndarray | None = None  # (V,) fp32: the scores of its next token
    chosen: int | None = None  # or its next token itself, picked by the backend (Request.argmax_only)
    matcher: object = None  # runtime.decoding.structured.RowMatcher of a constrained row
    draft: DraftState | None = None  # a lossless row's drafting (runtime.lossless); None: a plain row
    copy: "CopyState | None" = None  # a row under deep copies (runtime.decoding.copying); None: off

    @property
    def drafts(self) -> list:
        """What it drafted since the last verify pass (none for a plain row)."""
        return self.draft.pending if self.draft is not None else []


@dataclass(eq=False)
class CopyState:
    """A deep-copy row's rule, whether its next step runs deep, and how far each layer's K/V is
    written (positions [0, filled[l]) of layer l: a row skips layers, and a deep step needs them)."""

    rule: CopyRule
    filled: np.ndarray  # (L,) int
    due: bool = False


@dataclass(eq=False)
class Request:
    """One generate/stream call: a Sequence per prompt, one event queue for the caller."""

    input_ids: np.ndarray  # (B, T0) int64, left padded
    attention_mask: np.ndarray  # (B, T0) int64
    max_new_tokens: int
    policy: SkipPolicy
    sampling: SamplingConfig
    eos: set[int]
    stops: list[str]
    detok: list[IncrementalDetokenizer]
    logprobs: int | None = None  # record each token's log-probability and its k most likely alternatives
    config: GenerationConfig | None = None  # what it was made from, as the caller gave it
    constraint: object = None  # runtime.decoding.structured.Constraint: every row's output matches its schema
    lossless: bool = False  # its rows draft with the policy's layers and keep only full depth's tokens
    trained: bool = False  # the model was fine-tuned under SkipDecode: lossless rows may draft at their own set
    copies: DeepCopies | None = None  # rows copying a rare string of their prompt run deeper (not lossless)
    prompts: list[str] | None = None  # each row's prompt text, which deep copies match
    events: queue.Queue = field(default_factory=queue.Queue)  # TokenEvent ..., result | error, DONE
    # a TokenEvent per step for the caller; False (generate() with no streamer, the server's whole
    # answers): the result alone, so that callers waiting on their results are not woken at every step
    streams: bool = True
    logits: bool = True  # its events carry the step's logits (False: None, what a server or a printer needs)
    step_times: list[float] = field(default_factory=list)  # perf_counter() at each step's tokens, either way
    cancelled: bool = False  # set by the consumer (stream closed or abandoned)
    admitted: int = 0  # rows [0, admitted) have been seated (and perhaps finished since)
    stats: GenerationStats | None = None
    created: float = field(default_factory=time.perf_counter)  # the stats' wall clock starts here

    def __post_init__(self) -> None:
        B, T0 = self.input_ids.shape
        # A random stream per row: a row samples what it would alone, wherever it is seated.
        seeds = np.random.SeedSequence(self.sampling.seed).spawn(B)
        self.seqs = [Sequence(self, b, np.random.default_rng(seeds[b])) for b in range(B)]
        for s in self.seqs:
            if self.constraint is not None:
                s.matcher = self.constraint.matcher()
            if self.lossless:
                s.draft = DraftState(DraftPlan(tries_own_set=self.trained))
            elif self.copies is not None:
                s.copy = CopyState(self.copies.rule(self.prompts[s.index]), np.zeros(self.policy.num_layers, np.int64))
        self.stats = GenerationStats(0, B, T0, 0)
        self.token_logprobs = None if self.logprobs is None else [[] for _ in range(B)]

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.seqs)

    @property
    def argmax_only(self) -> bool:
        """Each token it takes is its logits' argmax and nothing else reads them (greedy, no
        penalties, schema or logprobs, and no events that carry the logits): a step may bring back
        its rows' token ids instead of their logits (runtime.backends.base)."""
        s = self.sampling
        return not ((self.streams and self.logits) or s.do_sample or s.penalized or self.constraint is not None
                    or self.logprobs is not None)


@dataclass(eq=False)
class Prefill:
    """The joining rows' prompt, run a chunk per round."""

    request: Request
    seqs: list[Sequence]
    input_ids: np.ndarray  # (k, T) the rows' prompts, their common left padding cut
    attention_mask: np.ndarray  # (k, T)
    done: int = 0  # prompt columns already run


@dataclass
class Timings:
    """What the engine's calls cost, smoothed: the scheduler sizes prefill chunks by a decode step's,
    and lossless rows weigh a step of drafts and a verify pass against a full-depth step
    (runtime.lossless)."""

    step: float | None = None  # a decode step
    full: float | None = None  # a full-depth decode step
    draft: float | None = None  # a step of drafts only
    verify: float | None = None  # a verify pass

    @staticmethod
    def smoothed(average: float | None, seconds: float) -> float:
        return seconds if average is None else 0.8 * average + 0.2 * seconds
