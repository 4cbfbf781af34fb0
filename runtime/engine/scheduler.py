"""The scheduler: which rows are seated, how much of a joining prompt runs this round, and what each
decoding row runs at the next step (its layers, a draft, or a verify pass of its drafts). It
decides; it calls no backend and touches no tensor but the cache's bookkeeping (runtime.engine.runner
runs what it decides)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..kvcache import KVCache
from ..lossless import DRAFT_MAX
from ..prefix_cache import PrefixCache
from .state import Prefill, Request, Sequence, Timings

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


@dataclass
class DecodePlan:
    """A decode step as the scheduler chose it, per decoding row j (its KV row): whether it drafts,
    waits (runs no layer: its drafts fill their room, or its request is held), and its layers."""

    seqs: list[Sequence]  # the decoding rows, by KV row
    held: list[bool]  # rows of requests that sit this round out (their positions are dropped after it)
    drafting: list[bool]
    waiting: list[bool]  # rows that run no layer
    steps: list[int]  # the generation step of each row's input token
    sets: list[tuple[int, ...]]  # each row's layers (() while waiting)
    lengths: np.ndarray  # (R,) the rows' KV lengths before the step

    @cached_property  # (read by the runner twice and by the step's stats)
    def layers(self) -> list[int]:
        """The union of the rows' sets, in order: what the step runs."""
        return sorted(set().union(*self.sets))

    @property
    def updates(self) -> np.ndarray:
        """(len(layers), R) bool: whether each layer updates each row."""
        return np.array([[i in active for active in self.sets] for i in self.layers],
                        dtype=bool).reshape(len(self.layers), len(self.seqs))

    @property
    def argmax(self) -> bool:
        """Every row that runs needs only its logits' argmax (Request.argmax_only)."""
        return all(s.request.argmax_only for s, w in zip(self.seqs, self.waiting) if not w)

    @property
    def draft_only(self) -> bool:
        """Every row that runs drafts: the step may read the backend's draft head."""
        return any(self.drafting) and all(d or w for d, w in zip(self.drafting, self.waiting))


@dataclass
class VerifyPlan:
    """A verify pass: T positions of every decoding row, the ``ready`` rows' drafts judged."""

    seqs: list[Sequence]
    ready: list[Sequence]
    T: int

    @property
    def argmax(self) -> bool:
        """Every row it verifies needs only its logits' argmax (Request.argmax_only)."""
        return all(s.request.argmax_only for s in self.ready)


class Scheduler:
    """Admission (waiting requests to free rows, one prefill at a time, in arrival order), prefill
    chunks, and each decode round's plan. The engine holds its lock around admission."""

    def __init__(self, cache: KVCache, num_layers: int, timings: Timings, max_queue: int | None = None,
                 prefill_chunk: int | str | None = AUTO):
        self.cache, self.num_layers, self.timings = cache, num_layers, timings
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        # prompt prefixes' K/V for rows that start with them (the Generator sets it where its
        # storage can copy rows); None: off
        self.prefix_cache: PrefixCache | None = None
        # each row seated and prefilled alone, in chunks ending at its page ends alone as under load:
        # a row's calls then depend on its prompt alone (the Generator's batch_invariant)
        self.batch_invariant = False
        self.chunk_costs = ChunkCosts()  # what a prefill chunk costs, fixed + per token, as measured
        self.waiting: deque[Request] = deque()  # requests with rows not yet seated, in arrival order
        self.running: list[Request] = []  # requests with seated rows
        self.prefill: Prefill | None = None

    # -- admission -----------------------------------------------------------------------------

    def queued(self) -> tuple[int, int]:
        """(requests that wait for a row, rows free after the rest are seated). Waiting requests are
        seated in arrival order as rows are free, one prefill at a time; one that gets a row at once
        is not queued, though its prefill has not begun (nor are its rows beyond the free ones: they
        join as its first rows end)."""
        free, queued = self.cache.free, 0
        for r in self.waiting:
            if free:
                free -= min(free, r.rows - r.admitted)
            else:
                queued += 1
        return queued, free

    def admit(self) -> None:
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
        if self.reuses(r, k):
            found = self.prefix_cache.lookup(self.prefill.input_ids[0])
            if found is not None:  # the prompt's first pages ran before: their K/V, and the rest runs
                blob, cached = found
                self.cache.restore(seqs[0].row, blob, cached)
                self.prefill.done = cached
                r.stats.cached_tokens += cached

    def reuses(self, r: Request, rows: int) -> bool:
        """Whether a prefill of ``rows`` rows of ``r`` takes and leaves prefixes (runtime.prefix_cache:
        one row, every layer run)."""
        return (self.prefix_cache is not None and rows == 1
                and len(r.policy.prefill_layers()) == self.num_layers)

    def remove(self, request: Request) -> None:
        """Forget ``request``: its prefill, its rows, its place in the queues."""
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

    # -- prefill -------------------------------------------------------------------------------

    @property
    def auto_chunks(self) -> bool:
        """Whether chunks are sized from measured costs (and every chunk's cost is recorded)."""
        return self.prefill_chunk == AUTO and not self.batch_invariant

    def chunk(self, max_tokens: int | None) -> int:
        """The prompt tokens the joining rows run this round: the rest of the prompt, or a chunk of
        it while rows decode (``prefill_chunk``: tokens, or "auto": about AUTO_STALL decode steps'
        time), or to the page's end (``batch_invariant``), at most ``max_tokens`` (the backend's)."""
        p, cache = self.prefill, self.cache
        chunk = p.input_ids.shape[1] - p.done
        if self.batch_invariant:  # to the page's end: where a reused prefix's pages end too
            chunk = min(chunk, cache.page - p.done % cache.page)
        elif cache.decoding and self.prefill_chunk:  # rows are waiting for their next token
            if not self.auto_chunks:
                chunk = min(chunk, self.prefill_chunk)
            elif self.timings.step:  # about AUTO_STALL decode steps' time
                chunk = self.chunk_costs.tokens(chunk, AUTO_STALL * self.timings.step, first=p.done == 0)
            else:
                chunk = min(chunk, AUTO_FIRST)
        return min(chunk, max_tokens or chunk)  # e.g. TensorRT engines' max_prompt

    # -- decoding ------------------------------------------------------------------------------

    def plan(self, held: frozenset, max_tokens: int | None) -> DecodePlan | VerifyPlan:
        """The next decode round of every decoding row: a verify pass once every lossless row that
        drafts has its drafts (or no room for more), else a step. The rows of ``held`` requests sit
        it out. ``max_tokens``: the most tokens a backend call takes (None: no limit).

        Lossless rows draft until each has its k drafts, then one pass verifies them all: a pass is
        a full-depth call over every decoding row, whichever it verifies, while a draft step costs a
        row that rides along only its compute. So rows with their k drafts, and paused rows, draft on
        while others still do; nobody skips layers for another's sake."""
        cache = self.cache
        R = cache.decoding
        seqs = cache.owners[:R]
        held_rows = [s.request in held for s in seqs]
        rooms = [0 if h else self.draft_room(s, max_tokens) for s, h in zip(seqs, held_rows)]
        short = any(len(s.drafts) < min(s.draft.plan.k, room) for s, room, h in zip(seqs, rooms, held_rows)
                    if not h and s.draft is not None and s.draft.plan.drafting(s.step))
        ready = [s for s, h in zip(seqs, held_rows) if s.drafts and not h]
        if not short and ready:
            return self._verify_plan(seqs, ready)
        drafting = [short and len(s.drafts) < room for s, room in zip(seqs, rooms)]
        # a row whose drafts fill its room waits for the pass: it runs no layer, and the position
        # this step gives it is dropped by the pass (which rewinds it to where its drafts began); a
        # held row runs none either, and its position is dropped after the step
        waiting = [(bool(s.drafts) and not d) or h for s, d, h in zip(seqs, drafting, held_rows)]
        steps = [s.step + len(s.drafts) for s in seqs]  # the generation step of each row's input
        sets = [() if w else self.layers(s, g, d) for s, g, d, w in zip(seqs, steps, drafting, waiting)]
        for s, d in zip(seqs, drafting):
            if d and not s.drafts:  # its first draft: the verify pass runs this token again from here
                s.draft.first, s.draft.base = s.token, int(cache.length[s.row])
        return DecodePlan(seqs, held_rows, drafting, waiting, steps, sets, cache.length[:R].copy())

    def _verify_plan(self, seqs: list[Sequence], ready: list[Sequence]) -> VerifyPlan:
        """A pass places T positions for every row it carries, riding rows too (the fused graphs'
        attention does, and fails past the buffer), so T stops where the longest riding row meets
        the capacity: the drafts past that are dropped unjudged (rare: a row's last few tokens)."""
        riding = max((int(self.cache.length[s.row]) for s in seqs if s not in ready), default=0)
        T = min(1 + max(len(s.drafts) for s in ready), self.cache.capacity - riding)
        for s in ready:
            del s.drafts[T - 1:]
        return VerifyPlan(seqs, ready, T)

    def draft_room(self, s: Sequence, max_tokens: int | None) -> int:
        """The most drafts a row may hold before its verify pass: none for a plain row (or before
        a full-depth step was timed: what drafts must beat), no more after a drafted EOS, and at
        most DRAFT_MAX and one less than the tokens left (a pass gives up to drafts + 1) or than a
        backend call takes (a verify pass is one call of drafts + 1 tokens; TensorRT: max_prompt)."""
        if s.draft is None or self.timings.full is None:
            return 0
        if s.drafts and s.drafts[-1][0] in s.request.eos:  # nothing follows an EOS
            return len(s.drafts)
        room = min(DRAFT_MAX, s.request.max_new_tokens - 2 - s.step, (max_tokens or DRAFT_MAX + 1) - 1)
        return max(room, 0)

    def layers(self, s: Sequence, g: int, drafting: bool) -> tuple[int, ...]:
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
            return policy.active_layers(g if s.draft.plan.own_set else policy.horizon)
        if s.copy is not None and s.copy.due:  # its input lies in a rare string of its prompt
            deep = s.request.copies.deep_set(policy.warmup_layers, self.num_layers)
            return tuple(sorted(deep.union(policy.active_layers(g))))
        return policy.active_layers(g)
