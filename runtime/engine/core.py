"""The engine: one round at a time, schedule -> run -> update (the package's docstring says how
rows, budgets and chunked prefill work)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from ..backends import Backend
from ..kvcache import KVCache
from ..lossless import next_draft, pays_off
from ..stats import StepStats
from .output import emit_step, result
from .runner import Runner
from .scheduler import AUTO, DecodePlan, Scheduler, VerifyPlan
from .state import DONE, EngineClosedError, QueueFullError, Request, Sequence, Timings


class Engine:
    """Continuous batching over a KV cache: each round schedules (``Scheduler``), runs
    (``Runner``, the only part that calls the backend) and updates the rows with what came back
    (tokens chosen and streamed by runtime.engine.output, drafts judged)."""

    def __init__(self, backend: Backend, num_layers: int, max_batch: int, capacity: int, page: int,
                 max_queue: int | None = None, prefill_chunk: int | str | None = AUTO):
        self.num_layers = num_layers
        self.cache = KVCache(backend.kv_storage(), max_batch, capacity, page)
        self.timings = Timings()
        self.scheduler = Scheduler(self.cache, num_layers, self.timings, max_queue, prefill_chunk)
        self.runner = Runner(backend, self.cache, num_layers, self.timings)
        self.lock = threading.Condition()
        self.closing = self.cancelling = False
        self.thread: threading.Thread | None = None
        self.stepper = None  # the Stepper driving this engine, if an app drives it

    @property
    def backend(self) -> Backend:
        return self.runner.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:  # (tests put a faulty or counting one in its place)
        self.runner.backend = backend

    @property
    def waiting(self) -> deque[Request]:
        """Requests with rows not yet seated, in arrival order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Requests with seated rows."""
        return self.scheduler.running

    @property
    def max_queue(self) -> int | None:
        return self.scheduler.max_queue

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def owner(self) -> list:
        """The request of each KV row (None = free)."""
        return [None if s is None else s.request for s in self.cache.owners]

    # -- the callers' side -------------------------------------------------------------------

    def submit(self, request: Request, thread: bool = True) -> None:
        with self.lock:
            if self.closing:
                raise EngineClosedError("this Generator is closed; load the artifact again")
            if thread and self.stepper is not None:
                raise EngineClosedError(
                    "this Generator is driven by a step loop (Generator.stepper()); add the request "
                    "there, or close the stepper first")
            queued, free = self.scheduler.queued()
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
            self.scheduler.running, self.scheduler.waiting, self.scheduler.prefill = [], deque(), None

    # -- one round: schedule -> run -> update ----------------------------------------------------

    def step(self) -> bool:
        """One round: cancellations, admission, a prefill chunk, a decode round. True while
        requests remain (running or waiting)."""
        with self.lock:
            if self.cancelling:
                for r in [*self.running, *self.waiting]:
                    self._end(r, EngineClosedError("the Generator was closed while this request ran"))
            for r in [r for r in (*self.running, *self.waiting) if r.cancelled]:
                self._end(r, result(r, "cancelled"))  # what it has so far: a stepper's handle keeps it
            if self.scheduler.prefill is None:
                self.scheduler.admit()
        if self.scheduler.prefill is not None:
            self._guard([self.scheduler.prefill.request], self._prefill)
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

    def _end(self, request: Request, outcome) -> None:
        """Free the request's rows and deliver ``outcome`` (a result, an exception, or None)."""
        self.scheduler.remove(request)
        if outcome is not None:
            request.events.put(outcome)
        request.events.put(DONE)

    def _prefill(self) -> None:
        """A chunk of the joining rows' prompt; once it is whole, their first tokens."""
        scheduler = self.scheduler
        p = scheduler.prefill
        r = p.request
        chunk = scheduler.chunk(self.backend.max_tokens())
        logits, seconds = self.runner.prefill(p, chunk)
        r.stats.prefill_seconds += seconds
        if scheduler.auto_chunks:  # whole prompts too: the fit needs their sizes
            scheduler.chunk_costs.add(chunk, seconds)
        if logits is None:
            return
        if scheduler.reuses(r, len(p.seqs)):  # leave its whole pages for the rows that start with them
            cached = scheduler.prefix_cache.wants(p.input_ids[0])
            blob = self.cache.snapshot(p.seqs[0].row, cached) if cached else None
            if blob is not None:
                scheduler.prefix_cache.store(p.input_ids[0, :cached], blob)
        with self.lock:
            scheduler.prefill = None
            self.cache.promote()
        for s, row in zip(p.seqs, logits):
            s.logits = row
        self._emit(p.seqs)

    def _decode(self, held: frozenset = frozenset()) -> None:
        """One token for every decoding row (a lossless row's draft, or a verify pass of the rows'
        drafts). The rows of ``held`` requests sit this round out (``_round``)."""
        plan = self.scheduler.plan(held, self.backend.max_tokens())
        if isinstance(plan, VerifyPlan):
            logits, seconds = self.runner.verify(plan)
            return self._judge(plan, logits, seconds)
        out, seconds = self.runner.decode(plan)  # logits (R, V), or their argmax (R,)
        self._record(plan, seconds)
        emit = []
        for j, s in enumerate(plan.seqs):
            if plan.waiting[j] or s.row < 0:  # (or its request ended at a draft of another of its rows)
                continue
            if plan.drafting[j]:
                self._contained(s.request, self._draft, s, out[j], plan.argmax)
            else:
                self._scored(s, out[j], plan.argmax)
                s.step += 1
                emit.append(s)
        self._emit(emit)

    @staticmethod
    def _scored(s: Sequence, out, argmax: bool) -> None:
        """A row's next token's scores (V,), or the token itself where the call brought back ids."""
        if argmax:
            s.chosen = int(out)
        else:
            s.logits = out

    def _record(self, plan: DecodePlan, seconds: float) -> None:
        """A decode step in its requests' stats: its time, and each (request, step)'s layers."""
        layers = tuple(plan.layers)
        for r in dict.fromkeys(s.request for s, h in zip(plan.seqs, plan.held) if not h):
            r.stats.decode_seconds += seconds
            r.stats.decode_calls += 1
        groups: dict[tuple, list[int]] = {}
        for j, s in enumerate(plan.seqs):
            if not plan.waiting[j]:
                groups.setdefault((s.request, plan.steps[j], plan.sets[j]), []).append(j)
                if s.copy is not None and s.copy.due and not plan.held[j]:
                    s.request.stats.deep_steps += 1
        for (r, g, active), members in groups.items():  # (a draft's or a deep copy's budget: its set's)
            r.stats.steps.append(StepStats(g, len(active), active, seconds, self.num_layers,
                                           tuple(plan.seqs[j].index for j in members), layers))

    def _draft(self, s: Sequence, out, argmax: bool) -> None:
        r = s.request
        s.token = (s.draft.add(int(out)) if argmax else
                   next_draft(s.draft, out, r.sampling, r.detok[s.index].tokens, s.rng))

    def _judge(self, plan: VerifyPlan, logits: np.ndarray, seconds: float) -> None:
        """A verify pass's tokens, position by position: each row's until its first token that
        differs from its draft (that token is full depth's own, and kept); the rejected drafts'
        positions dropped; each row's next k or pause (runtime.lossless). ``logits`` (n, T, V), or
        their argmax (n, T) for the plan's ``argmax`` rows."""
        ready, L = plan.ready, self.num_layers
        for r in dict.fromkeys(s.request for s in ready):
            r.stats.decode_seconds += seconds
            r.stats.decode_calls += 1
            members = [s for s in ready if s.request is r]
            r.stats.verify_passes += 1
            r.stats.verified_rows += len(members)
            r.stats.steps.append(StepStats(members[0].step, L, tuple(range(L)), seconds, L,
                                           tuple(s.index for s in members), tuple(range(L))))
        judged = [s for s in ready if s.draft.plan.drafting(s.step)]  # not a paused row's ride-along draft
        kept = dict.fromkeys(ready, 0)
        active = list(ready)
        for i in range(plan.T):
            for j, s in enumerate(ready):
                if s in active:
                    self._scored(s, logits[j, i], plan.argmax)
                    s.step += 1
                    s.draft.proposal = s.drafts[i] if i < len(s.drafts) else None
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
                self.cache.rewind(s.row, s.draft.base + a + 1)
        # the rows one pass verifies are judged together (the pass costs the same whichever drafted well)
        draft_cost, verify_cost = self._costs(ready[0])
        pays = pays_off([s.draft.plan for s in judged], sum(len(s.drafts) for s in judged),
                        sum(kept[s] for s in judged), draft_cost, verify_cost)
        for s in judged:
            s.draft.plan.verified(len(s.drafts), kept[s], pays, s.step)  # the next k, or a pause
        for s in ready:
            s.draft.clear()

    def _costs(self, s: Sequence) -> tuple[float, float]:
        """What a step of drafts and a verify pass cost in full-depth steps (a step of drafts: its
        layers' share until one is measured). A pass runs every layer over at least a step's tokens:
        a smaller ratio is the clock's noise (a busy machine), which would keep rows drafting that
        never keep a draft."""
        t, L = self.timings, self.num_layers
        draft = (t.draft or t.full * len(self.scheduler.layers(s, 0, True)) / L) / t.full
        return draft, max(t.verify / t.full, 1.0)

    def _emit(self, seqs: list[Sequence]) -> None:
        """Select each row's next token, stream it (one event per request and step), retire
        finished rows, and finished requests."""
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault((s.request, s.step), []).append(s)
        for (r, g), members in sorted(groups.items(), key=lambda item: item[0][1]):
            if r in self.running:  # (not ended by an error at an earlier step of this call)
                self._contained(r, emit_step, r, g, members, self.cache.release)
        for r in dict.fromkeys(s.request for s in seqs):
            if r.done and r in self.running:
                with self.lock:
                    self._end(r, result(r))
