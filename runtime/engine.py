"""Continuous batching with per-row SkipDecode budgets, one synchronous step at a time.

``Engine.step()`` is one scheduling round: admit waiting rows into free rows of the KV cache, run
one chunk of the joining request's prompt (the prefill: at full depth, or at the first step's
active set when the policy says ``prefill="policy"``), then one decode step of every row that
decodes, one token each. A row leaves when it finishes and its KV row is reused at once. Nothing
in it starts a thread: an embedded app's control loop drives it through ``Stepper``
(runtime/generator.py), and ``Generator.generate``/``stream`` drive it from one worker thread that
calls the same ``step()`` while there is work.

Rows, not requests, are what the cache holds: each prompt of a call is a ``Sequence`` with its own
step g, token and random stream, so a call of more prompts than rows runs its rows as rows free
up, and each row's tokens are those of its prompt run alone. The rows of one call that are
admitted together prefill together.

Per-row budgets (docs/design.md section 1, "Per-row budgets"): each row keeps its own policy
and its own step g, so its active set is ``policy.active_layers(g)``, whatever the other rows do.
The sets are nested (warm-up layers plus a top block), so a step runs the union of the rows' sets,
layer by layer, and each layer updates exactly the rows whose set holds it; the others pass their
hidden state through unchanged. A row never runs a layer it skipped at an earlier step (its budget
only shrinks), so every layer it runs holds its complete past.

Chunked prefill: while other rows decode, a joining prompt runs a chunk of its tokens per round,
so a running row waits at most one chunk between two tokens (as vLLM's chunked prefill,
Sarathi-Serve); with nothing decoding, the prompt runs whole. ``prefill_chunk`` is the chunk in
tokens, or "auto": chunks sized so that one takes about ``AUTO_STALL`` decode steps, from a fit of
the recent chunks' times as a fixed cost (every layer's call and weight read) plus a cost per token
(``ChunkCosts``; the right T differs by orders of magnitude between a 2-core CPU and a GPU), and a
prompt that would take at most ``AUTO_WHOLE`` such budgets runs whole.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .backends import Backend
from .backends.base import DecodeStep, VerifyPass
from .detokenize import IncrementalDetokenizer
from .errors import SkipDecodeError
from .generation_config import GenerationConfig
from .kvcache import KVCache
from .lossless import DRAFT_MAX, DraftPlan, pays_off
from .policy import SkipPolicy
from .prefix_cache import PrefixCache
from .sampling import SamplingConfig, draw, penalize, probabilities, select, token_logprob, verify_draft
from .stats import GenerationResult, GenerationStats, StepStats, TokenEvent


class EngineClosedError(SkipDecodeError, RuntimeError):
    """A request submitted to, or still running in, a Generator that was closed."""


class QueueFullError(SkipDecodeError, RuntimeError):
    """More requests waiting than the Generator's ``max_queue``: retry later."""


DONE = object()  # the last item of a request's event queue, after its result or error
AUTO = "auto"
AUTO_STALL = 1.25  # "auto" chunks take about this many decode steps: a running row waits ~2.25
AUTO_FIRST, AUTO_MIN, AUTO_MAX = 16, 4, 1024  # "auto" chunk sizes, tokens: the first one (no
# timing yet), and the bounds (below 4, per-call overhead is all a chunk costs)
AUTO_WHOLE = 2.0  # a prompt whose rest takes at most this many AUTO_STALL budgets runs whole


class ChunkCosts:
    """A prefill chunk's time as ``fixed + per_token * T``, fitted to the recent chunks, and the chunk
    size that keeps a chunk within a budget.

    Why affine: a chunk pays every layer's call and weight read whatever its length, then each token's
    compute. On a small model the fixed part is most of it (a 4-token chunk of the 2.5M demo model
    took 1.5 ms, a 20-token one 2.5 ms); a size proportional to the last chunk's time, as before,
    shrank to 4 tokens after one short remainder chunk and split every prompt into 4-5 chunks that
    each cost about a whole prompt. Why Theil-Sen (the median of the pairwise slopes): the times are
    milliseconds on a shared machine, where one chunk in several is slowed by another process; a
    least-squares line followed those spikes."""

    KEEP = 24  # chunks remembered: the fit follows a change of batch or machine within a few prompts

    def __init__(self):
        from collections import deque

        self.seen: deque[tuple[int, float]] = deque(maxlen=self.KEEP)  # (tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        self.seen.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until chunks of different sizes were seen."""
        points = list(self.seen)
        slopes = [(s2 - s1) / (t2 - t1) for k, (t1, s1) in enumerate(points) for t2, s2 in points[k + 1:]
                  if t2 != t1]
        if not slopes:
            return None
        per_token = float(np.median(slopes))
        if per_token <= 0:
            return None
        fixed = float(np.median([s - per_token * t for t, s in points]))
        return max(fixed, 0.0), per_token

    def tokens(self, remaining: int, budget: float, first: bool) -> int:
        """The next chunk's tokens, of a prompt with ``remaining`` tokens to run: all of them when
        this is the prompt's ``first`` chunk and they take at most AUTO_WHOLE budgets (splitting
        would spare the running rows a fraction of a step and cost another pass of every layer;
        not decided later in a long prompt, whose later tokens cost more than the fit says, as
        they attend to a longer past); else those whose chunk takes ``budget``, or,
        where the fixed part alone exceeds it, those whose own compute does (the chunk then stalls
        the running rows at most fixed + budget, its fixed cost spread over that many tokens)."""
        fit = self.fit()
        if fit is None:  # chunks of two sizes not seen yet
            return min(remaining, AUTO_FIRST)
        fixed, per_token = fit
        if first and fixed + per_token * remaining <= AUTO_WHOLE * budget:
            return remaining
        target = (budget - fixed if budget > fixed else budget) / per_token
        return min(remaining, int(min(max(target, AUTO_MIN), AUTO_MAX)))


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
    matcher: object = None  # runtime.structured.RowMatcher of a constrained row
    # lossless decoding (self-speculative): the policy's layers draft, a full-depth pass verifies
    plan: DraftPlan | None = None  # a lossless row's k and pauses (runtime.lossless)
    drafts: list = field(default_factory=list)  # (token, q (V,) or None) drafted since the last verify
    first: int = 0  # the token its first draft step ran (the verify pass runs it again)
    base: int = 0  # its KV length before that step: the verify pass writes from there
    proposal: tuple | None = None  # the draft a verify position judges (engine._emit)


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
    constraint: object = None  # runtime.structured.Constraint: every row's output matches its schema
    lossless: bool = False  # its rows draft with the policy's layers and keep only full depth's tokens
    trained: bool = False  # the model was fine-tuned under SkipDecode: lossless rows may draft at their own set
    events: queue.Queue = field(default_factory=queue.Queue)  # TokenEvent ..., result | error, DONE
    cancelled: bool = False  # set by the consumer (stream closed or abandoned)
    admitted: int = 0  # rows [0, admitted) have been seated (and perhaps finished since)
    stats: GenerationStats | None = None
    created: float = field(default_factory=time.perf_counter)  # the stats' wall clock starts here

    def __post_init__(self) -> None:
        B, T0 = self.input_ids.shape
        # A random stream per row: a row samples what it would alone, wherever it is seated.
        seeds = np.random.SeedSequence(self.sampling.seed).spawn(B)
        self.seqs = [Sequence(self, b, np.random.default_rng(seeds[b])) for b in range(B)]
        if self.constraint is not None:
            for s in self.seqs:
                s.matcher = self.constraint.matcher()
        if self.lossless:
            for s in self.seqs:
                s.plan = DraftPlan(tries_own_set=self.trained)
        self.stats = GenerationStats(0, B, T0, 0)
        self.token_logprobs = None if self.logprobs is None else [[] for _ in range(B)]

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.seqs)


@dataclass(eq=False)
class Prefill:
    """The joining rows' prompt, run a chunk per round."""

    request: Request
    seqs: list[Sequence]
    input_ids: np.ndarray  # (k, T) the rows' prompts, their common left padding cut
    attention_mask: np.ndarray  # (k, T)
    done: int = 0  # prompt columns already run


class Engine:
    """The scheduler and decode loop over a KV cache. It talks to the backend only through ``Backend``."""

    def __init__(self, backend: Backend, num_layers: int, max_batch: int, capacity: int, page: int,
                 max_queue: int | None = None, prefill_chunk: int | str | None = AUTO):
        self.backend, self.num_layers = backend, num_layers
        # prompt prefixes' K/V for rows that start with them (the Generator sets it where its
        # storage can copy rows); None: off
        self.prefix_cache: PrefixCache | None = None
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        # each row seated and prefilled alone, in chunks ending at its page ends alone as under load:
        # a row's calls then depend on its prompt alone (the Generator's batch_invariant)
        self.batch_invariant = False
        self.chunk_costs = ChunkCosts()  # what a prefill chunk costs, fixed + per token, as measured
        self.step_seconds: float | None = None  # a decode step's time, smoothed
        # lossless rows' costs, smoothed: a full-depth decode step, a step of drafts only, a verify
        # pass (runtime.lossless weighs them against the rows' acceptance)
        self.full_seconds: float | None = None
        self.draft_seconds: float | None = None
        self.verify_seconds: float | None = None
        self.cache = KVCache(backend.kv_storage(), max_batch, capacity, page)
        self.waiting: deque[Request] = deque()  # requests with rows not yet seated, in arrival order
        self.running: list[Request] = []  # requests with seated rows
        self.prefill: Prefill | None = None
        self.lock = threading.Condition()
        self.closing = self.cancelling = False
        self.thread: threading.Thread | None = None
        self.stepper = None  # the Stepper driving this engine, if an app drives it

    # -- the callers' side -------------------------------------------------------------------

    def submit(self, request: Request, thread: bool = True) -> None:
        with self.lock:
            if self.closing:
                raise EngineClosedError("this Generator is closed; load the artifact again")
            if thread and self.stepper is not None:
                raise EngineClosedError(
                    "this Generator is driven by a step loop (Generator.stepper()); add the request "
                    "there, or close the stepper first")
            queued, free = self._queued()
            if self.max_queue is not None and not free and queued >= self.max_queue:
                raise QueueFullError(
                    f"{queued} requests are already waiting for a row (max_queue {self.max_queue}); "
                    f"retry later or load with a larger max_queue / max_batch")
            request.stats.num_layers = self.num_layers
            self.waiting.append(request)
            if thread and self.thread is None:
                self.thread = threading.Thread(target=self._run, name="skipdecode-engine", daemon=True)
                self.thread.start()
            self.lock.notify()

    def _queued(self) -> tuple[int, int]:
        """(requests that wait for a row, rows free after the rest are seated). Waiting requests are
        seated in arrival order as rows are free, one prefill at a time; one that gets a row at once
        is not queued, though its prefill has not begun (nor are its rows beyond the free ones: they
        join as its first rows end). Called under the lock."""
        free, queued = self.cache.free, 0
        for r in self.waiting:
            if free:
                free -= min(free, r.rows - r.admitted)
            else:
                queued += 1
        return queued, free

    def cancel(self, request: Request) -> None:
        with self.lock:
            request.cancelled = True
            self.lock.notify()

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests; wait for the running and waiting ones to finish, or with
        ``cancel=True`` end them at once (their streams raise EngineClosedError)."""
        with self.lock:
            self.closing = True
            self.cancelling = self.cancelling or cancel
            self.lock.notify()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def owner(self) -> list:
        """The request of each KV row (None = free)."""
        return [None if s is None else s.request for s in self.cache.owners]

    # -- the worker thread: a driver of step() -----------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    while not (self.busy or self.closing):
                        self.lock.wait()
                    if self.closing and not self.busy:
                        return
                self.step()
        except BaseException as exc:  # a bug in the engine itself: fail every caller, never hang them
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        with self.lock:
            self.closing = True
            for r in [*self.running, *self.waiting]:
                r.events.put(exc)
                r.events.put(DONE)
            self.running, self.waiting, self.prefill = [], deque(), None

    # -- one round -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One round: cancellations, admission, a prefill chunk, a decode step. True while
        requests remain (running or waiting)."""
        with self.lock:
            if self.cancelling:
                for r in [*self.running, *self.waiting]:
                    self._end(r, EngineClosedError("the Generator was closed while this request ran"))
            for r in [r for r in (*self.running, *self.waiting) if r.cancelled]:
                self._end(r, _result(r, "cancelled"))  # what it has so far: a stepper's handle keeps it
            if self.prefill is None:
                self._admit()
        if self.prefill is not None:
            self._guard([self.prefill.request], self._prefill_chunk)
        if self.cache.decoding:
            self._round()
        with self.lock:
            return self.busy

    def _guard(self, requests, fn, *args) -> None:
        """Run fn; an exception fails the requests it concerns, never the engine or the others."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller, who re-raises it
            with self.lock:
                for r in requests:
                    self._end(r, exc)

    def _round(self) -> None:
        """A decode round. One that raises over the rows of several requests runs again for each
        of them alone (the others held: they run nothing and keep their positions), and only the
        requests whose own round raises too end, with their error: a failure of one row never
        fails the rows beside it. Nothing a round did before its backend call needs undoing (the
        lengths move on after it), and what follows it fails per request (``_contained``)."""
        requests = list(dict.fromkeys(s.request for s in self.cache.owners[: self.cache.decoding]))
        try:
            return self._decode()
        except BaseException as exc:  # noqa: BLE001 - delivered to the callers, who re-raise it
            if len(requests) == 1:
                with self.lock:
                    return self._end(requests[0], exc)
        for r in requests:
            if any(0 <= s.row < self.cache.decoding for s in r.seqs):  # not ended by another's round
                self._guard([r], self._decode, frozenset(requests) - {r})

    def _contained(self, request: Request, fn, *args) -> None:
        """fn(*args), the part of a round that concerns ``request`` alone: an exception ends that
        request with it, and the round goes on with the others."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller, who re-raises it
            with self.lock:
                self._end(request, exc)

    def _admit(self) -> None:
        """Seat the next waiting rows (of the first waiting request) in the free KV rows."""
        if not self.waiting or not self.cache.free:
            return
        r = self.waiting[0]
        k = 1 if self.batch_invariant else min(r.rows - r.admitted, self.cache.free)
        seqs = r.seqs[r.admitted: r.admitted + k]
        r.admitted += k
        if r.admitted == r.rows:
            self.waiting.popleft()
        if r not in self.running:
            self.running.append(r)
        picked = slice(seqs[0].index, seqs[-1].index + 1)
        mask = r.attention_mask[picked]
        first = int(np.argmax(mask.any(axis=0)))  # the columns every seated row pads are cut
        self.prefill = Prefill(r, seqs, r.input_ids[picked, first:], mask[:, first:])
        self.cache.seat(seqs)
        if self._reuses(r, k):
            found = self.prefix_cache.lookup(self.prefill.input_ids[0])
            if found is not None:  # the prompt's first pages ran before: their K/V, and the rest runs
                blob, cached = found
                self.cache.restore(seqs[0].row, blob, cached)
                self.prefill.done = cached
                r.stats.cached_tokens += cached

    def _reuses(self, r: Request, rows: int) -> bool:
        """Whether a prefill of ``rows`` rows of ``r`` takes and leaves prefixes (runtime.prefix_cache:
        one row, every layer run)."""
        return (self.prefix_cache is not None and rows == 1
                and len(r.policy.prefill_layers()) == self.num_layers)

    def _end(self, request: Request, outcome) -> None:
        """Free the request's rows and deliver ``outcome`` (a result, an exception, or None)."""
        if self.prefill is not None and self.prefill.request is request:
            self.prefill = None
            self.cache.promote()  # nothing joins any more: what is left of the group decodes
        for s in request.seqs:
            if s.row >= 0:
                self.cache.release(s.row)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if outcome is not None:
            request.events.put(outcome)
        request.events.put(DONE)

    def _prefill_chunk(self) -> None:
        """One chunk of the joining rows' prompt through the policy's prefill layers (all, or step
        0's active set, which holds every later step's); K/V to the rows' next positions."""
        p, backend, cache = self.prefill, self.backend, self.cache
        r = p.request
        seqs = sorted(p.seqs, key=lambda s: s.row)  # departures may have reordered the block
        order = [p.seqs.index(s) for s in seqs]
        start, k = seqs[0].row, len(seqs)
        total = p.input_ids.shape[1]
        chunk = total - p.done
        auto = self.prefill_chunk == AUTO and not self.batch_invariant
        if self.batch_invariant:  # to the page's end: where a reused prefix's pages end too
            chunk = min(chunk, cache.page - p.done % cache.page)
        elif cache.decoding and self.prefill_chunk:  # rows are waiting for their next token
            if not auto:
                chunk = min(chunk, self.prefill_chunk)
            elif self.step_seconds:  # about AUTO_STALL decode steps' time
                chunk = self.chunk_costs.tokens(chunk, AUTO_STALL * self.step_seconds, first=p.done == 0)
            else:
                chunk = min(chunk, AUTO_FIRST)
        chunk = min(chunk, self.backend.max_tokens() or chunk)  # e.g. TensorRT engines' max_prompt
        cols = slice(p.done, p.done + chunk)
        ids, new = p.input_ids[order, cols], p.attention_mask[order, cols]  # (k, T)
        began = time.perf_counter()
        cache.reserve(start, start + k, chunk)  # the width grows with the prompt, a page at a time
        mask = cache.mask(start, start + k, new)  # (k, W + T)
        hidden = backend.embed(ids, mask)  # (k, T, D)
        hidden = backend.run_layers(cache, start, k, hidden, mask, r.policy.prefill_layers())
        cache.advance(start, start + k, new)
        p.done += chunk
        logits = backend.head(hidden) if p.done == total else None  # (k, V)
        seconds = time.perf_counter() - began
        r.stats.prefill_seconds += seconds
        if auto:  # whole prompts too: the fit needs their sizes
            self.chunk_costs.add(chunk, seconds)
        if logits is not None:
            if self._reuses(r, k):  # leave its whole pages for the rows that start with them
                cached = self.prefix_cache.wants(p.input_ids[0])
                blob = cache.snapshot(start, cached) if cached else None
                if blob is not None:
                    self.prefix_cache.store(p.input_ids[0, :cached], blob)
            with self.lock:
                self.prefill = None
                cache.promote()
            for j, s in enumerate(seqs):
                s.logits = logits[j]
            self._emit(seqs)

    def _decode(self, held: frozenset = frozenset()) -> None:
        """One token for every decoding row: embed, the union of the rows' active sets, head. A
        lossless row drafts its token instead; once a row's drafts are complete the round is their
        verify pass (``_verify``). The rows of ``held`` requests sit this round out (``_round``)."""
        cache = self.cache
        R = cache.decoding
        seqs = cache.owners[:R]
        out = [s.request in held for s in seqs]
        # Lossless rows draft until each has its k drafts (or no room for more), then one pass verifies
        # them all: a pass is a full-depth call over every decoding row, whichever it verifies, while
        # a draft step costs a row that rides along only its compute. So rows with their k drafts,
        # and paused rows, draft on while others still do; nobody skips layers for another's sake.
        rooms = [0 if o else self._draft_room(s) for s, o in zip(seqs, out)]
        short = any(len(s.drafts) < min(s.plan.k, room) for s, room, o in zip(seqs, rooms, out)
                    if not o and s.plan is not None and s.plan.drafting(s.step))
        ready = [s for s, o in zip(seqs, out) if s.drafts and not o]
        if not short and ready:
            return self._verify(seqs, ready)
        drafting = [short and len(s.drafts) < room for s, room in zip(seqs, rooms)]
        # a row whose drafts fill its room waits for the pass: it runs no layer, and the position
        # this step gives it is dropped by the pass (which rewinds it to where its drafts began);
        # a held row runs none either, and its position is dropped after the step
        waiting = [(bool(s.drafts) and not d) or o for s, d, o in zip(seqs, drafting, out)]
        before = cache.length[:R].copy()
        steps = [s.step + len(s.drafts) for s in seqs]  # the generation step of each row's input
        sets = [() if w else self._layers(s, g, d) for s, g, d, w in zip(seqs, steps, drafting, waiting)]
        layers = sorted(set().union(*sets))
        updates = np.array([[i in active for active in sets] for i in layers], dtype=bool).reshape(len(layers), R)
        ids = np.array([[s.token] for s in seqs], dtype=np.int64)  # (R, 1)
        for s, d in zip(seqs, drafting):
            if d and not s.drafts:  # its first draft: the verify pass runs this token again from here
                s.first, s.base = s.token, int(cache.length[s.row])
        began, setup = time.perf_counter(), self.backend.setup_seconds()
        cache.reserve(0, R, 1)
        new = np.ones((R, 1), dtype=np.int64)
        new[waiting] = 0
        # a step whose every used row drafts may read the backend's draft head: the pass decides
        draft = any(drafting) and all(d or w for d, w in zip(drafting, waiting))
        step = DecodeStep(ids, cache.mask(0, R, new), layers, updates, draft)
        logits = self.backend.decode(step, cache)  # (R, V)
        cache.advance(0, R, new)
        for s, o, length in zip(seqs, out, before):
            if o:
                cache.rewind(s.row, int(length))
        seconds = time.perf_counter() - began
        cost = seconds - (self.backend.setup_seconds() - setup)  # what this step costs the next time
        if not held:  # a round of some rows alone is not what a round costs
            self.step_seconds = _smoothed(self.step_seconds, cost)
            if len(layers) == self.num_layers:
                self.full_seconds = _smoothed(self.full_seconds, cost)
            elif all(drafting):
                self.draft_seconds = _smoothed(self.draft_seconds, cost)
        groups: dict[tuple, list[int]] = {}
        for j, s in enumerate(seqs):
            if not waiting[j]:
                groups.setdefault((s.request, steps[j]), []).append(j)
        for r in dict.fromkeys(s.request for s, o in zip(seqs, out) if not o):
            r.stats.decode_seconds += seconds
        for (r, g), members in groups.items():
            budget = len(sets[members[0]]) if r.lossless else r.policy.budget(g)  # a draft's: its set's
            r.stats.steps.append(StepStats(g, budget, sets[members[0]], seconds,
                                           self.num_layers, tuple(seqs[j].index for j in members),
                                           tuple(layers)))
        emit = []
        for j, s in enumerate(seqs):
            if waiting[j] or s.row < 0:  # (or its request ended at a draft of another of its rows)
                continue
            if drafting[j]:
                self._contained(s.request, self._draft, s, logits[j])
            else:
                s.logits = logits[j]
                s.step += 1
                emit.append(s)
        self._emit(emit)

    def _draft_room(self, s: Sequence) -> int:
        """The most drafts a row may hold before its verify pass: none for a plain row (or before
        a full-depth step was timed: what drafts must beat), no more after a drafted EOS, and at
        most DRAFT_MAX and one less than the tokens left (a pass gives up to drafts + 1)."""
        if s.plan is None or self.full_seconds is None:
            return 0
        if s.drafts and s.drafts[-1][0] in s.request.eos:  # nothing follows an EOS
            return len(s.drafts)
        most = self.backend.max_tokens()  # a verify pass is one call of drafts + 1 tokens (TensorRT: max_prompt)
        room = min(DRAFT_MAX, s.request.max_new_tokens - 2 - s.step, (most or DRAFT_MAX + 1) - 1)
        return max(room, 0)

    def _layers(self, s: Sequence, g: int, drafting: bool) -> tuple[int, ...]:
        """A row's layers for a step whose input is its g-th token: the policy's active set; for a
        lossless row's draft the policy's smallest (its budget past the horizon), since each verify
        pass leaves every layer's K/V complete, the drafts need not decay (on the demo model this
        drafts 1.1x-1.4x faster than the decaying set for the same acceptance: docs/benchmarks.md),
        or its own set at g once the smallest did not pay (``DraftPlan.own_set``); every layer for a
        lossless row's token that no pass verifies."""
        policy = s.request.policy
        if s.request.lossless:
            if not drafting:
                return tuple(range(self.num_layers))
            return policy.active_layers(g if s.plan.own_set else policy.horizon)
        return policy.active_layers(g)

    def _draft(self, s: Sequence, logits: np.ndarray) -> None:
        """A lossless row's next draft from its draft step's logits (V,): greedy, or drawn from
        the processed distribution q, kept for the verify pass's rule."""
        r = s.request
        scores = logits
        if r.sampling.penalized:  # over the tokens so far and the drafts before this one
            scores = penalize(scores, r.detok[s.index].tokens + [d for d, _ in s.drafts], r.sampling)
        if r.sampling.do_sample:
            q = probabilities(scores[None, :], r.sampling)[0]  # (V,)
            token = int(draw(q[None, :], s.rng)[0])
        else:
            q, token = None, int(scores.argmax())
        s.drafts.append((token, q))
        s.token = token

    def _verify(self, seqs: list[Sequence], ready: list[Sequence]) -> None:
        """One full-depth pass over the ready rows' first draft input and drafts (T = 1 + most
        drafts; rows with fewer are padded, the other decoding rows ride along unchanged): K/V of
        every layer at those positions, every position's logits, then the tokens position by
        position, each row until its first token that differs from its draft (that token is full
        depth's own, and kept); the rejected drafts' positions are dropped."""
        cache, L = self.cache, self.num_layers
        began, setup = time.perf_counter(), self.backend.setup_seconds()
        for s in ready:
            cache.rewind(s.row, s.base)  # the drafts' positions, written again at every layer
        # A pass places T positions for every row it carries, riding rows too (the fused graphs'
        # attention does, and fails past the buffer), so T stops where the longest riding row meets
        # the capacity: the drafts past that are dropped unjudged (rare: a row's last few tokens).
        riding = max((int(cache.length[s.row]) for s in seqs if s not in ready), default=0)
        T = min(1 + max(len(s.drafts) for s in ready), cache.capacity - riding)
        R = len(seqs)
        ids = np.zeros((R, T), dtype=np.int64)
        new = np.zeros((R, T), dtype=np.int64)
        update = np.zeros(R, dtype=bool)
        for s in ready:
            del s.drafts[T - 1:]
            n = len(s.drafts)
            ids[s.row, : n + 1] = [s.first, *(d for d, _ in s.drafts)]
            new[s.row, : n + 1] = 1
            update[s.row] = True
        cache.reserve(0, R, T)
        check = VerifyPass(ids, cache.mask(0, R, new), update, np.array([s.row for s in ready]), L)
        logits = self.backend.verify(check, cache)  # (len(ready), T, V)
        for s in ready:
            cache.grow(s.row, len(s.drafts) + 1)
        seconds = time.perf_counter() - began
        self.verify_seconds = _smoothed(self.verify_seconds, seconds - (self.backend.setup_seconds() - setup))
        for r in dict.fromkeys(s.request for s in ready):
            r.stats.decode_seconds += seconds
            members = [s for s in ready if s.request is r]
            r.stats.verify_passes += 1
            r.stats.verified_rows += len(members)
            r.stats.steps.append(StepStats(members[0].step, L, tuple(range(L)), seconds, L,
                                           tuple(s.index for s in members), tuple(range(L))))
        # what a draft step and this pass cost in full-depth steps (a step of drafts: its layers' share
        # until one is measured)
        full = self.full_seconds
        draft_cost = (self.draft_seconds or full * len(self._layers(ready[0], 0, True)) / L) / full
        # a pass runs every layer over at least a step's tokens: a smaller ratio is the clock's noise
        # (a busy machine), which would keep rows drafting that never keep a draft
        verify_cost = max(self.verify_seconds / full, 1.0)
        judged = [s for s in ready if s.plan.drafting(s.step)]  # not a paused row's ride-along draft
        kept = dict.fromkeys(ready, 0)
        active = list(ready)
        for i in range(T):
            for j, s in enumerate(ready):
                if s in active:
                    s.logits, s.step = logits[j, i], s.step + 1
                    s.proposal = s.drafts[i] if i < len(s.drafts) else None
            self._emit(active)
            active = [s for s in active
                      if i < len(s.drafts) and s.reason is None and s.row >= 0 and s.token == s.drafts[i][0]]
            for s in active:
                kept[s] += 1
        for s in ready:
            n, a = len(s.drafts), kept[s]
            s.request.stats.drafted_tokens += n
            s.request.stats.accepted_tokens += a
            if s.row >= 0:  # still running: its rejected drafts' positions go
                cache.rewind(s.row, s.base + a + 1)
        # the rows one pass verifies are judged together (the pass costs the same whichever drafted well)
        pays = pays_off([s.plan for s in judged], sum(len(s.drafts) for s in judged),
                        sum(kept[s] for s in judged), draft_cost, verify_cost)
        for s in judged:
            s.plan.verified(len(s.drafts), kept[s], pays, s.step)  # the next k, or a pause
        for s in ready:
            s.drafts, s.proposal = [], None

    def _emit(self, seqs: list[Sequence]) -> None:
        """Select each row's next token, stream it (one event per request and step), retire
        finished rows, and finished requests."""
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault((s.request, s.step), []).append(s)
        for (r, g), members in sorted(groups.items(), key=lambda item: item[0][1]):
            if r in self.running:  # (not ended by an error at an earlier step of this call)
                self._contained(r, self._emit_step, r, g, members)
        for r in dict.fromkeys(s.request for s in seqs):
            if r.done and r in self.running:
                with self.lock:
                    self._end(r, _result(r))

    def _emit_step(self, r: Request, g: int, members: list[Sequence]) -> None:
        """Step ``g``'s tokens of ``members``, rows of ``r``: selected, detokenized, streamed."""
        last = g == r.max_new_tokens - 1
        B = r.rows
        if len(members) == 1 == B:  # a request of one row: its row of the step's logits, no copy
            logits = members[0].logits[None, :]  # (1, V): every backend's logits are fresh arrays
        else:  # rows that have finished stream zeros
            logits = np.zeros((B, members[0].logits.shape[0]), np.float32)
            for s in members:
                logits[s.index] = s.logits
        event = TokenEvent(g, [None] * B, [""] * B, [False] * B, logits, [None] * B,
                           None if r.logprobs is None else [None] * B)
        for s in members:
            b = s.index
            detok, before = r.detok[b], s.text
            scores = penalize(s.logits, detok.tokens, r.sampling) if r.sampling.penalized else s.logits
            if s.matcher is not None and (r.sampling.do_sample or not s.matcher.allows(int(scores.argmax()))):
                scores = s.matcher.mask(scores)  # only what keeps the text on its schema
            if s.proposal is not None and r.sampling.do_sample:  # a draft judged (lossless)
                draft, q = s.proposal
                token = verify_draft(probabilities(scores[None, :], r.sampling)[0], draft, q, s.rng)
            else:  # greedy: full depth's argmax, which the verify pass compares with the draft
                token = int(select(scores[None, :], r.sampling, s.rng)[0])
            complete = s.matcher is not None and token not in r.eos and s.matcher.consume(token)
            if r.logprobs is not None:
                event.logprobs[b] = token_logprob(s.logits, token, r.logprobs)
                r.token_logprobs[b].append(event.logprobs[b])
            delta = detok.add(token)
            if token in r.eos or last or complete:
                delta += detok.flush()
            text = before + delta
            hit = _first_stop(text, r.stops, len(before))
            if hit is not None:  # the whole last token stays, so that text == decode(token_ids)
                text += detok.flush()
            event.token_ids[b], event.texts[b] = token, text[len(before):]
            s.text, s.token, s.logits = text, token, None
            reason = ("eos" if token in r.eos else "stop" if hit is not None or complete
                      else "length" if last else None)
            if reason is not None:
                s.reason = event.finish_reasons[b] = reason
                if s.row >= 0:
                    self.cache.release(s.row)
        event.finished = [s.reason is not None for s in r.seqs]
        r.stats.new_tokens = max(r.stats.new_tokens, g + 1)
        if g == 0 and not r.stats.first_token_seconds:
            r.stats.first_token_seconds = time.perf_counter() - r.created
        if g > 0:  # a decode step's (or verify pass's) tokens, not the prompt's
            r.stats.decode_tokens += len(members)
        r.events.put(event)


def _smoothed(average: float | None, seconds: float) -> float:
    return seconds if average is None else 0.8 * average + 0.2 * seconds


def _result(r: Request, unfinished: str | None = None) -> GenerationResult:
    """The request's result: each row's text and tokens so far, and why it ended (``unfinished``
    for a row still running: "cancelled")."""
    r.stats.seconds = time.perf_counter() - r.created
    return GenerationResult([s.text for s in r.seqs], [d.tokens for d in r.detok], r.stats, r.policy,
                            [s.reason or unfinished for s in r.seqs], r.token_logprobs)


def _first_stop(text: str, stops: list[str], new_from: int = 0) -> int | None:
    """End index of the earliest stop string in ``text`` (the row ends at the token that completes it).

    Only matches that end after ``new_from`` (the text before it was searched at earlier steps)
    are looked for, so a step searches a bounded tail, not the whole text.
    """
    ends = []
    for s in stops:
        if s:
            found = text.find(s, max(new_from - len(s) + 1, 0))
            if found >= 0:
                ends.append(found + len(s))
    return min(ends) if ends else None
