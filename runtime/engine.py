"""Continuous batching with per-row SkipDecode budgets.

One worker thread owns the backend. Callers submit requests (one per ``generate``/``stream`` call,
one row per prompt) from any thread; a FIFO queue admits a request when enough of the ``max_batch``
KV slots are free, runs its prompt (the prefill: at full depth, or at the first step's active set
when the policy says ``prefill="policy"``), and from then on the request's rows
decode together with every other running row, one token per step. A row leaves when it finishes
and its slot is reused at once.

Per-row budgets (DESIGN.md section 1, "continuous/dynamic batching"): each row keeps its own policy
and its own step g, so its active set is ``policy.active_layers(g)``, whatever the other rows do.
The sets are nested (warm-up layers plus a top block), so a step runs the union of the rows' sets,
layer by layer, and each layer updates exactly the rows whose set holds it; the others pass their
hidden state through unchanged. A row never runs a layer it skipped at an earlier step (its budget
only shrinks), so every layer it runs holds its complete past, and its tokens are those it would
produce alone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .backends import Backend
from .detokenize import IncrementalDetokenizer
from .errors import SkipDecodeError
from .policy import SkipPolicy
from .sampling import SamplingConfig, select
from .stats import GenerationResult, GenerationStats, StepStats, TokenEvent


class EngineClosedError(SkipDecodeError, RuntimeError):
    """A request submitted to, or still running in, a Generator that was closed."""


class QueueFullError(SkipDecodeError, RuntimeError):
    """More requests waiting than the Generator's ``max_queue``: retry later."""


_DONE = object()  # the last item of a request's event queue, after its result or error


@dataclass(eq=False)  # identity: a request is found in the engine's lists by what it is
class Request:
    """One generate/stream call: its rows are admitted together and step in lockstep."""

    input_ids: np.ndarray  # (B, T0) int64, left padded
    attention_mask: np.ndarray  # (B, T0) int64
    max_new_tokens: int
    policy: SkipPolicy
    sampling: SamplingConfig
    eos: set[int]
    stops: list[str]
    detok: list[IncrementalDetokenizer]
    events: queue.Queue = field(default_factory=queue.Queue)  # TokenEvent ..., result | error, _DONE
    cancelled: bool = False  # set by the consumer (stream closed or abandoned)
    slots: list[int] = field(default_factory=list)  # slot of each row while it runs
    step: int = 0  # generation step g of the next token this request selects
    texts: list[str] = field(default_factory=list)
    finished: np.ndarray | None = None  # (B,) bool
    reasons: list[str | None] = field(default_factory=list)  # why each row stopped
    logits: np.ndarray | None = None  # (B, V) fp32: the scores of the next token of every row
    tokens: np.ndarray | None = None  # (B,) the tokens the rows run at the next decode step
    stats: GenerationStats | None = None

    def __post_init__(self) -> None:
        B = self.input_ids.shape[0]
        self.rng = np.random.default_rng(self.sampling.seed)
        self.texts = [""] * B
        self.finished = np.zeros(B, dtype=bool)
        self.reasons = [None] * B
        self.slots = [-1] * B

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


class Engine:
    """The scheduler and decode loop. It talks to the backend only through ``Backend``."""

    def __init__(self, backend: Backend, num_layers: int, pad_token_id: int, max_batch: int,
                 capacity: int, max_queue: int | None = None):
        self.backend, self.num_layers, self.pad = backend, num_layers, pad_token_id
        self.max_batch, self.max_queue = max_batch, max_queue
        backend.allocate(max_batch, capacity)
        width = backend.past_width(capacity)  # a paged backend rounds up to whole pages
        self.owner: list[Request | None] = [None] * max_batch  # slot -> request
        self.row_of = np.zeros(max_batch, dtype=np.int64)  # slot -> row index in its request
        self.length = np.zeros(max_batch, dtype=np.int64)  # positions each slot's row holds
        self.valid = np.zeros((max_batch, width), dtype=np.int64)  # the rows' attention masks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.closing = self.cancelling = False
        self.thread: threading.Thread | None = None

    # -- the callers' side -------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.closing:
                raise EngineClosedError("this Generator is closed; load the artifact again")
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self.waiting)} requests are already waiting (max_queue {self.max_queue}); "
                    f"retry later or load with a larger max_queue / max_batch")
            self.waiting.append(request)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="skipdecode-engine", daemon=True)
                self.thread.start()
            self.lock.notify()

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

    # -- the worker --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in the engine itself: fail every caller, never hang them
            with self.lock:
                self.closing = True
                for r in [*self.running, *self.waiting]:
                    r.events.put(exc)
                    r.events.put(_DONE)
                self.running, self.waiting = [], deque()
            raise

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not (self.waiting or self.running or self.closing):
                    self.lock.wait()
                if self.cancelling:
                    for r in [*self.running, *self.waiting]:
                        self._end(r, EngineClosedError("the Generator was closed while this request ran"))
                    self.waiting.clear()
                if self.closing and not (self.waiting or self.running):
                    return
                for r in [r for r in self.running if r.cancelled]:
                    self._end(r, None)
                for r in [r for r in self.waiting if r.cancelled]:
                    self.waiting.remove(r)
                    r.events.put(_DONE)
                admitted = []
                while self.waiting and self.waiting[0].rows <= self.owner.count(None):
                    admitted.append(self._seat(self.waiting.popleft()))
            for r in admitted:
                self._guard([r], self._prefill, r)
            for r in list(self.running):
                if r.logits is not None:
                    self._guard([r], self._emit, r)
            if any(self.owner):
                self._guard(list(self.running), self._decode_step)

    def _guard(self, requests, fn, *args) -> None:
        """Run fn; an exception fails the requests it concerns, never the engine or the others."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller, who re-raises it
            for r in requests:
                self._end(r, exc)

    def _seat(self, request: Request) -> Request:
        free = [s for s, owner in enumerate(self.owner) if owner is None]
        request.slots = free[: request.rows]
        for b, s in enumerate(request.slots):
            self.owner[s], self.row_of[s] = request, b
        self.running.append(request)
        return request

    def _free(self, request: Request, row: int) -> None:
        s = request.slots[row]
        if s >= 0 and self.owner[s] is request:
            self.owner[s] = None
            self.valid[s, : self.length[s]] = 0
            self.length[s] = 0
        request.slots[row] = -1

    def _end(self, request: Request, outcome) -> None:
        """Free the request's slots and deliver ``outcome`` (a result, an exception, or None)."""
        for b in range(request.rows):
            self._free(request, b)
        if request in self.running:
            self.running.remove(request)
        if outcome is not None:
            request.events.put(outcome)
        request.events.put(_DONE)

    def _prefill(self, r: Request) -> None:
        """The prompt through the policy's prefill layers (all, or step 0's active set, which holds
        every later step's), on the request's rows alone; K/V to positions [0, T0)."""
        backend, L = self.backend, self.num_layers
        B, T0 = r.input_ids.shape
        slots = np.array(r.slots)
        start = time.perf_counter()
        hidden = backend.embed(r.input_ids, r.attention_mask)
        for i in r.policy.prefill_layers():
            hidden = backend.layer(i, hidden, r.attention_mask, slots, np.zeros(B, np.int64))
        r.logits = backend.head(hidden)  # (B, V)
        self.valid[slots, :T0] = r.attention_mask
        self.length[slots] = T0
        r.stats = GenerationStats(L, B, T0, 0, prefill_seconds=time.perf_counter() - start)

    def _emit(self, r: Request) -> None:
        """Select every row's next token, stream it, retire finished rows (and the request)."""
        g, last = r.step, r.step == r.max_new_tokens - 1
        tokens = select(r.logits, r.sampling, r.rng)  # (B,)
        tokens[r.finished] = self.pad
        event = TokenEvent(g, [None] * r.rows, [""] * r.rows, [False] * r.rows, r.logits, [None] * r.rows)
        for b in np.flatnonzero(~r.finished):
            token = int(tokens[b])
            detok, before = r.detok[b], r.texts[b]
            delta = detok.add(token)
            if token in r.eos or last:
                delta += detok.flush()
            text = before + delta
            hit = _first_stop(text, r.stops, len(before))
            if hit is not None:
                text = text[:hit]
            event.token_ids[b], event.texts[b] = token, text[len(before):]
            r.texts[b] = text
            reason = "eos" if token in r.eos else "stop" if hit is not None else "length" if last else None
            if reason is not None:
                r.finished[b], r.reasons[b] = True, reason
                event.finish_reasons[b] = reason
                self._free(r, b)
        event.finished = r.finished.tolist()
        r.stats.new_tokens = g + 1
        r.logits = None
        r.events.put(event)
        if r.finished.all():
            result = GenerationResult(r.texts, [d.tokens for d in r.detok], r.stats, r.policy,
                                      list(r.reasons))
            self._end(r, result)
        else:
            r.tokens = tokens

    def _decode_step(self) -> None:
        """One token for every running row: embed, the union of the rows' active sets, head."""
        backend, S = self.backend, self.max_batch
        live = [s for s in range(S) if self.owner[s] is not None]
        start = time.perf_counter()
        sets = {s: self.owner[s].policy.active_layers(self.owner[s].step) for s in live}
        ids = np.full((S, 1), self.pad, dtype=np.int64)
        for s in live:
            ids[s, 0] = self.owner[s].tokens[self.row_of[s]]
        past = backend.past_width(int(self.length.max()))
        mask = np.zeros((S, past + 1), dtype=np.int64)  # (S, P + 1)
        mask[:, :past] = self.valid[:, :past]
        mask[live, past] = 1
        positions = self.length.copy()
        layers = sorted(set().union(*sets.values()))
        updates = []
        for i in layers:
            update = np.zeros(S, dtype=bool)
            update[[s for s in live if i in sets[s]]] = True
            updates.append(update)
        logits = backend.decode(ids, mask, positions, layers, updates, np.array(live))  # (len(live), V)
        seconds = time.perf_counter() - start
        self.valid[live, self.length[live]] = 1
        self.length[live] += 1
        requests = dict.fromkeys(self.owner[s] for s in live)  # each once, in slot order
        for r in requests:
            r.logits = np.zeros((r.rows, logits.shape[1]), np.float32)  # finished rows stay 0
        for k, s in enumerate(live):
            self.owner[s].logits[self.row_of[s]] = logits[k]
        for r in requests:
            rows = tuple(int(self.row_of[s]) for s in live if self.owner[s] is r)
            r.stats.decode_seconds += seconds
            r.stats.steps.append(StepStats(r.step, r.policy.budget(r.step), sets[r.slots[rows[0]]],
                                           seconds, self.num_layers, rows, tuple(layers)))
            r.step += 1


def _first_stop(text: str, stops: list[str], new_from: int = 0) -> int | None:
    """End index of the earliest stop string in ``text`` (kept in the output, as transformers).

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
