"""The runner: what the scheduler chose, run on the backend (a prefill chunk, a decode step, a
verify pass), the cache's lengths moved on after it, and its time measured. The only part of the
engine that calls the backend."""

from __future__ import annotations

import time

import numpy as np

from ..backends import Backend
from ..backends.base import DecodeStep, VerifyPass, tokens
from ..kvcache import KVCache
from .scheduler import DecodePlan, VerifyPlan
from .state import Prefill, Sequence, Timings


class Runner:
    def __init__(self, backend: Backend, cache: KVCache, num_layers: int, timings: Timings):
        self.backend, self.cache, self.num_layers, self.timings = backend, cache, num_layers, timings

    def prefill(self, p: Prefill, chunk: int) -> tuple[np.ndarray | None, float]:
        """``chunk`` more tokens of the joining rows' prompt through the policy's prefill layers (all,
        or step 0's active set, which holds every later step's); K/V to the rows' next positions.
        Returns the rows' logits (k, V) once the prompt is done (else None), in the order of
        ``p.seqs``, and the seconds it took."""
        backend, cache = self.backend, self.cache
        seqs = sorted(p.seqs, key=lambda s: s.row)  # departures may have reordered the block
        order = [p.seqs.index(s) for s in seqs]
        start, k = seqs[0].row, len(seqs)
        cols = slice(p.done, p.done + chunk)
        ids, new = p.input_ids[order, cols], p.attention_mask[order, cols]  # (k, T)
        began = time.perf_counter()
        cache.reserve(start, start + k, chunk)  # the width grows with the prompt, a page at a time
        mask = cache.mask(start, start + k, new)  # (k, W + T)
        layers = p.request.policy.prefill_layers()
        hidden = backend.embed(ids, mask)  # (k, T, D)
        hidden = backend.run_layers(cache, start, k, hidden, mask, layers)
        cache.advance(start, start + k, new)
        for s in seqs:
            if s.copy is not None:
                s.copy.filled[list(layers)] = cache.length[s.row]
        p.done += chunk
        logits = None
        if p.done == p.input_ids.shape[1]:
            logits = backend.head(hidden)[np.argsort(order)]  # (k, V), back in the order of p.seqs
        return logits, time.perf_counter() - began

    def decode(self, plan: DecodePlan) -> tuple[np.ndarray, float]:
        """One decode step of every decoding row as planned: embed, the union of the rows' sets,
        head. Returns the logits (R, V), or their argmax (R,) for a plan's ``argmax`` rows, and the
        seconds it took."""
        cache, R = self.cache, len(plan.seqs)
        layers = plan.layers
        ids = np.array([[s.token] for s in plan.seqs], dtype=np.int64)  # (R, 1)
        began, setup = time.perf_counter(), self.backend.setup_seconds()
        for s, active, h in zip(plan.seqs, plan.sets, plan.held):
            if s.copy is not None and s.copy.due and not h:  # a deep step: the K/V it reads first
                self.fill(s, active)
        cache.reserve(0, R, 1)
        new = np.ones((R, 1), dtype=np.int64)
        new[plan.waiting] = 0
        step = DecodeStep(ids, cache.mask(0, R, new), layers, plan.updates, plan.draft_only, plan.argmax)
        logits = self.backend.decode(step, cache)  # (R, V)
        if plan.argmax:
            logits = tokens(logits)  # (R,)
        cache.advance(0, R, new)
        for s, h, length, active in zip(plan.seqs, plan.held, plan.lengths, plan.sets):
            if h:
                cache.rewind(s.row, int(length))
            elif s.copy is not None:
                s.copy.filled[list(active)] = cache.length[s.row]
        seconds = time.perf_counter() - began
        if not any(plan.held):  # a round of some rows alone is not what a round costs
            t = self.timings
            cost = seconds - (self.backend.setup_seconds() - setup)  # what this step costs the next time
            t.step = t.smoothed(t.step, cost)
            if plan.draft_only:  # first: drafts at speedup 1 run every layer, on their quantized copies
                t.draft = t.smoothed(t.draft, cost)
            elif len(layers) == self.num_layers:
                t.full = t.smoothed(t.full, cost)
        return logits, seconds

    def fill(self, s: Sequence, layers) -> None:
        """The K/V a deep step of row ``s`` reads and its positions skipped: at each of ``layers``,
        the positions after the last one that ran it, computed from their hidden state after the
        warm-up layers (what a position that skips a layer carries past it: runtime.decoding.copying).
        Those positions' tokens are the row's generated ones (deep copies need the prompt at full
        depth); the warm-up layers' own K/V there are written again, to the same values. Calls take
        at most the backend's ``max_tokens`` positions (TensorRT's profiles)."""
        cache, row, filled = self.cache, s.row, s.copy.filled
        t = int(cache.length[row])
        warm = range(s.request.policy.warmup_layers)
        gaps = sorted(i for i in layers if filled[i] < t and i not in warm)
        if not gaps:
            return
        first = int(filled[gaps].min())
        tokens = s.request.detok[s.index].tokens  # generated so far; the last is this step's input
        ids = np.array([tokens[len(tokens) - 1 - (t - first): len(tokens) - 1]], dtype=np.int64)  # (1, n)
        hidden = np.concatenate([self._at(row, a, b, warm, ids=ids[:, a - first:b - first])
                                 for a, b in self._spans(first, t)], axis=1)  # (1, n, D)
        for i in gaps:  # each layer from its own first missing position
            for a, b in self._spans(int(filled[i]), t):
                self._at(row, a, b, [i], hidden=hidden[:, a - first:b - first])
            s.request.stats.filled_positions += t - int(filled[i])
        filled[gaps] = t

    def _spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        step = self.backend.max_tokens() or stop - start
        return [(a, min(a + step, stop)) for a in range(start, stop, step)]

    def _at(self, row: int, start: int, stop: int, layers, ids=None, hidden=None):
        """``layers`` over positions [start, stop) of row ``row``, which already holds them (K/V
        written there again), from their ``ids`` or their ``hidden`` (1, T, D); the row's length is
        where it was after."""
        cache, end = self.cache, int(self.cache.length[row])
        cache.rewind(row, start)
        mask = cache.mask(row, row + 1, np.ones((1, stop - start), np.int64))
        if hidden is None:
            hidden = self.backend.embed(ids, mask)
        out = self.backend.run_layers(cache, row, 1, hidden, mask, layers)
        cache.grow(row, end - start)
        return out

    def verify(self, plan: VerifyPlan) -> tuple[np.ndarray, float]:
        """One full-depth pass over the ready rows' first draft input and drafts (T = 1 + most
        drafts; rows with fewer are padded, the other decoding rows ride along unchanged): K/V of
        every layer at those positions and every position's logits (len(ready), T, V) (their argmax
        (len(ready), T) for a plan's ``argmax`` rows), and the seconds it took. The ready rows'
        lengths end past all their drafts (the engine rewinds the rejected ones)."""
        cache, T, R = self.cache, plan.T, len(plan.seqs)
        began, setup = time.perf_counter(), self.backend.setup_seconds()
        for s in plan.ready:
            cache.rewind(s.row, s.draft.base)  # the drafts' positions, written again at every layer
        ids = np.zeros((R, T), dtype=np.int64)
        new = np.zeros((R, T), dtype=np.int64)
        update = np.zeros(R, dtype=bool)
        for s in plan.ready:
            n = len(s.drafts)
            ids[s.row, : n + 1] = [s.draft.first, *(d for d, _ in s.drafts)]
            new[s.row, : n + 1] = 1
            update[s.row] = True
        cache.reserve(0, R, T)
        check = VerifyPass(ids, cache.mask(0, R, new), update, np.array([s.row for s in plan.ready]),
                           self.num_layers, plan.argmax)
        logits = self.backend.verify(check, cache)  # (len(ready), T, V)
        if plan.argmax:
            logits = tokens(logits)  # (len(ready), T)
        for s in plan.ready:
            cache.grow(s.row, len(s.drafts) + 1)
        seconds = time.perf_counter() - began
        t = self.timings
        t.verify = t.smoothed(t.verify, seconds - (self.backend.setup_seconds() - setup))
        return logits, seconds
