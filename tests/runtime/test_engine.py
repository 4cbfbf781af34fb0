"""The continuous-batching engine: concurrent calls, per-row budgets, cancellation, faults, no KV copies."""

import threading
import time

import numpy as np
import pytest

import runtime
from runtime.backends.cuda_graphs import EagerCapture
from runtime.engine import AUTO_MIN, EngineClosedError, QueueFullError
from runtime.errors import PolicyError
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import SpyBackend, spying

# torch-static: the torch backend's captured-step path (CUDA graphs), run eagerly on the CPU;
# onnxruntime-iobinding: the IOBinding backend's device path, on the CPU provider
BACKENDS = {"onnxruntime": ("onnxruntime", {}), "torch": ("torch", {}), "torch-static": ("torch", {}),
            "onnxruntime-iobinding": ("onnxruntime", dict(device="cpu"))}
# (prompts, max_new_tokens, options): different prompts, lengths, budgets and finishing times
REQUESTS = [
    (PROMPTS[0], 12, dict(speedup=2)),
    ([PROMPTS[1], PROMPTS[2]], 9, dict(speedup=3)),
    (PROMPTS[2], 14, {}),
    ("A short one", 5, dict(policy={"max_layers": 5, "min_layers": 2, "warmup_layers": 1, "horizon": 4})),
    ("The quick brown fox", 11, dict(speedup=1.5, stop_strings=["zz"])),
    (PROMPTS[1], 7, dict(do_sample=True, seed=3, top_k=20)),
]


@pytest.fixture(scope="module", params=list(BACKENDS))
def engine_gen(request, artifact_dir):
    backend, options = BACKENDS[request.param]
    gen = runtime.load(artifact_dir, backend=backend, max_batch=4, threads=1, **options)
    if request.param == "torch-static":
        gen.backend.use_graphs(EagerCapture())
    yield gen
    gen.close()


def wait_for(condition, seconds=10.0):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.005)


def alone(gen, prompts, new, options):
    return gen.generate(prompts, new, ignore_eos=True, **options)


def check_layers(result):
    """Every row ran exactly its own policy's active set at each of its own steps."""
    for b in range(len(result.token_ids)):
        layers = result.layers_of_row(b)
        assert layers == [result.policy.active_layers(g) for g in range(len(layers))]
        assert len(layers) == len(result.token_ids[b]) - 1  # one decode step per token after the first


def test_concurrent_requests_from_threads_equal_each_alone(engine_gen):
    expected = [alone(engine_gen, *r).token_ids for r in REQUESTS]
    results = [None] * len(REQUESTS)

    def worker(k):
        time.sleep(0.003 * k)  # staggered starts, in a known order
        results[k] = alone(engine_gen, *REQUESTS[k])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(REQUESTS))]
    # the engine is held in the first request's prefill until every request has arrived: on a
    # loaded machine a request could otherwise end before the next one starts (and nothing batch)
    real = engine_gen.engine.backend
    engine_gen.engine.backend = gate = Gate(real)
    try:
        for t in threads:
            t.start()
        scheduler = engine_gen.engine.scheduler
        arrived = lambda: len({id(r) for r in [*scheduler.waiting, *scheduler.running]})  # noqa: E731
        wait_for(lambda: arrived() == len(REQUESTS))
        assert arrived() == len(REQUESTS)
        gate.step(10_000)
        for t in threads:
            t.join(60)
    finally:
        gate.step(10_000)  # never leave a thread held
        engine_gen.engine.backend = real
    assert [r.token_ids for r in results] == expected
    for r in results:
        check_layers(r)
    shared = [s for r in results for s in r.stats.steps if s.engine_layers != s.layers]
    assert shared, "no step ran another request's layers beside this one's: nothing was batched"
    assert engine_gen.engine.owner == [None] * engine_gen.max_batch  # every slot is free again


class Gate(SpyBackend):
    """Holds the engine in ``head`` until the test lets a step through."""

    def __init__(self, inner):
        super().__init__(inner)
        self.permits = threading.Semaphore(0)

    def head(self, hidden, rows=None):
        self.permits.acquire()
        return super().head(hidden, rows)

    def step(self, n=1):
        for _ in range(n):
            self.permits.release()


@pytest.mark.parametrize("join_at", [0, 3, 9])  # at step 0, mid-decay, past the horizon (4)
def test_a_request_joins_a_decayed_batch(engine_gen, join_at):
    L = engine_gen.num_layers
    early = SkipPolicy(L, L, 2, warmup_layers=1, horizon=5)
    late = SkipPolicy(L, L - 1, 3, warmup_layers=1, horizon=6)
    want_a = alone(engine_gen, PROMPTS[1], 14, dict(policy=early)).token_ids
    want_b = alone(engine_gen, PROMPTS[0], 8, dict(policy=late)).token_ids
    real = engine_gen.engine.backend
    gate = Gate(real)
    engine_gen.engine.backend = gate
    try:
        a = engine_gen.stream(PROMPTS[1], 14, policy=early, ignore_eos=True)
        gate.step(1 + join_at)  # a's prefill, then join_at decode steps
        events = [next(a) for _ in range(1 + join_at)]
        b = engine_gen.stream(PROMPTS[0], 8, policy=late, ignore_eos=True)
        gate.step(100)
        rest_a, rest_b = list(a), list(b)
    finally:
        engine_gen.engine.backend = real
    assert [e.token_ids[0] for e in events + rest_a] == want_a[0]
    assert [e.token_ids[0] for e in rest_b] == want_b[0]
    check_layers(a.result)
    check_layers(b.result)
    # b's first decode step ran its full budget beside a's decayed one, on the same engine step
    first = b.result.stats.steps[0]
    assert set(first.engine_layers) >= set(first.layers) | set(early.active_layers(join_at + 1))


def test_two_streams_consumed_in_turn_give_the_right_tokens(engine_gen):
    """The bug report: two streams read alternately used to overwrite each other's KV cache."""
    want = [alone(engine_gen, p, 10, {}).token_ids[0] for p in PROMPTS[:2]]
    s1, s2 = (engine_gen.stream(p, 10, ignore_eos=True) for p in PROMPTS[:2])
    got = [[], []]
    for _ in range(10):
        got[0].append(next(s1).token_ids[0])
        got[1].append(next(s2).token_ids[0])
    assert got == want


def test_cancelling_a_stream_frees_its_slot_and_spares_the_others(engine_gen):
    want = alone(engine_gen, PROMPTS[2], 12, {}).token_ids
    keep = engine_gen.stream(PROMPTS[2], 12, ignore_eos=True)
    drop = engine_gen.stream(PROMPTS[0], 40, ignore_eos=True)
    next(drop)
    next(drop)
    drop.close()
    with pytest.raises(StopIteration):
        next(drop)
    assert [e.token_ids[0] for e in keep] == want[0]
    wait_for(lambda: not any(engine_gen.engine.owner))
    assert engine_gen.engine.owner == [None] * engine_gen.max_batch


def test_abandoned_stream_is_cancelled(engine_gen):
    stream = engine_gen.stream(PROMPTS[0], 50, ignore_eos=True)
    request = stream._request
    del stream  # never read: the request must not hold its slot until it runs out
    assert request.cancelled


def test_invalid_request_fails_alone_before_joining(engine_gen):
    good = engine_gen.stream(PROMPTS[0], 6, ignore_eos=True)
    with pytest.raises(PolicyError, match="min_layers \\(3\\) must be <= max_layers \\(2\\)"):
        engine_gen.stream(PROMPTS[1], 6, policy={"max_layers": 2, "min_layers": 3})
    assert len(list(good)) == 6


def test_a_failing_request_does_not_disturb_the_others(engine_gen):
    """A backend error in one request's prefill reaches that caller only."""
    want = alone(engine_gen, PROMPTS[0], 8, {}).token_ids

    class Faulty(SpyBackend):
        def embed(self, ids, mask):
            if ids.shape[1] > 1 and (ids == 0).any():  # the poisoned request's prompt
                raise RuntimeError("simulated device fault")
            return super().embed(ids, mask)

    with spying(engine_gen) as spy:
        engine_gen.engine.backend = Faulty(spy.inner)
        good = engine_gen.stream(PROMPTS[0], 8, ignore_eos=True)
        poisoned = engine_gen.tokenizer.decode([0, 5, 6])
        with pytest.raises(RuntimeError, match="simulated device fault"):
            engine_gen.generate(poisoned, 4)
        assert [e.token_ids[0] for e in good] == want[0]


@pytest.mark.parametrize("victim", [{}, dict(speedup=2, lossless=True)], ids=["plain", "lossless"])
def test_a_fault_in_one_rows_decode_fails_that_request_alone(engine_gen, monkeypatch, victim):
    """A backend error in a decode step or verify pass that one request's rows run (here: from its
    third token on) ends that request with the error; the plain and lossless requests it was
    batched with give what they give alone (a failure used to fail every request of the batch)."""
    goods = [(PROMPTS[0], 12, dict(speedup=2)), (PROMPTS[1], 12, dict(speedup=2, lossless=True))]
    wants = [alone(engine_gen, p, n, o).token_ids for p, n, o in goods]
    backend = engine_gen.engine.backend
    decode, verify = backend.decode, backend.verify
    faults = []

    def poisoned(cache, rows):  # whether a row of ``rows`` that runs belongs to the poisoned request
        hit = any(0 in cache.owners[j].request.input_ids and cache.owners[j].step >= 3 for j in rows)
        faults.extend([hit] if hit else [])
        return hit

    def faulty_decode(step, cache):
        if poisoned(cache, np.flatnonzero(step.updates.any(axis=0))):
            raise RuntimeError("simulated device fault")
        return decode(step, cache)

    def faulty_verify(check, cache):
        if poisoned(cache, np.flatnonzero(check.updates)):
            raise RuntimeError("simulated device fault")
        return verify(check, cache)

    monkeypatch.setattr(backend, "decode", faulty_decode)
    monkeypatch.setattr(backend, "verify", faulty_verify)
    streams = [engine_gen.stream(p, n, ignore_eos=True, **o) for p, n, o in goods]
    bad = engine_gen.stream(engine_gen.tokenizer.decode([0, 5, 6]), 12, ignore_eos=True, **victim)
    got = []
    with pytest.raises(RuntimeError, match="simulated device fault"):
        got.extend(e.token_ids[0] for e in bad)
    assert 3 <= len(got) < 12 and faults  # it ran until the fault
    for stream, want in zip(streams, wants):
        assert [e.token_ids[0] for e in stream] == want[0]


def test_more_prompts_than_rows_run_as_rows_free_up(engine_gen):
    """One call of 10 prompts on 4 KV rows: every row equals its prompt alone, in prompt order."""
    prompts = [f"{PROMPTS[k % 3]} {k}" for k in range(10)]
    want = [alone(engine_gen, p, 5, dict(speedup=2)).token_ids[0] for p in prompts]
    result = engine_gen.generate(prompts, 5, speedup=2, ignore_eos=True)
    assert result.token_ids == want
    assert result.finish_reasons == ["length"] * 10
    check_layers(result)


def test_requests_beyond_the_slots_wait_their_turn(engine_gen):
    """Eight one-row requests on four slots: all complete, each equal to its solo run."""
    prompts = [f"{PROMPTS[k % 3]} {k}" for k in range(8)]
    want = [alone(engine_gen, p, 6, {}).token_ids for p in prompts]
    streams = [engine_gen.stream(p, 6, ignore_eos=True) for p in prompts]
    for s in streams:
        list(s)
    assert [s.result.token_ids for s in streams] == want


def test_queue_limit_and_close(artifact_dir):
    gen = runtime.load(artifact_dir, max_batch=1, max_queue=1, threads=1)
    with spying(gen) as spy:
        gate = Gate(spy.inner)
        gen.engine.backend = gate
        running = gen.stream(PROMPTS[0], 20, ignore_eos=True)
        wait_for(lambda: gen.engine.running)  # seated: the worker now blocks in its prefill's head
        waiting = gen.stream(PROMPTS[1], 20, ignore_eos=True)
        with pytest.raises(QueueFullError, match="1 requests are already waiting for a row \\(max_queue 1\\)"):
            gen.stream(PROMPTS[2], 4)
        gen.engine.close(cancel=True, timeout=0)
        gate.step(100)
        gen.engine.thread.join(10)
    for stream in (running, waiting):
        with pytest.raises(EngineClosedError, match="the Generator was closed while this request ran"):
            list(stream)
    with pytest.raises(EngineClosedError, match="this Generator is closed"):
        gen.stream(PROMPTS[0], 2)
    gen.close()


@pytest.mark.parametrize("max_queue", [0, 2])
def test_the_queue_counts_only_requests_without_a_row(artifact_dir, max_queue):
    """An idle Generator with 4 rows takes 4 requests at once whatever max_queue is (they wait for
    their prefill, not for a row), then max_queue more, then refuses; every accepted one finishes."""
    gen = runtime.load(artifact_dir, max_batch=4, max_queue=max_queue, threads=1)
    gate = Gate(gen.engine.backend)
    gen.engine.backend = gate
    try:
        streams = [gen.stream(f"{PROMPTS[k % 3]} {k}", 3, ignore_eos=True) for k in range(4 + max_queue)]
        with pytest.raises(QueueFullError, match=f"^{max_queue} requests are already waiting for a row "
                                                 f"\\(max_queue {max_queue}\\)"):
            gen.stream(PROMPTS[0], 3)
        gate.step(1000)
        assert [len(list(s)) for s in streams] == [3] * len(streams)
    finally:
        gate.step(1000)
        gen.close()


def test_a_request_larger_than_the_free_rows_starts_with_max_queue_0(artifact_dir):
    """Rows beyond the free ones join as the first end: the request is running, not queued."""
    with runtime.load(artifact_dir, max_batch=2, max_queue=0, threads=1) as gen:
        result = gen.generate([f"{PROMPTS[k % 3]} {k}" for k in range(5)], 3, ignore_eos=True)
        assert [len(ids) for ids in result.token_ids] == [3] * 5


def test_context_manager_waits_for_running_requests(artifact_dir):
    with runtime.load(artifact_dir, max_batch=2, threads=1) as gen:
        stream = gen.stream(PROMPTS[0], 6, ignore_eos=True)
    assert len(list(stream)) == 6 and stream.result.finish_reasons == ["length"]


def test_onnxruntime_binds_the_kv_buffer_in_place(artifact_dir):
    """The past given to every decode graph is a view of the layer's K/V buffer (the block of rows
    that run, at the cache's width), allocated once; the graphs return only the new position's K/V:
    nothing copies or concatenates the past. A prompt's first chunk binds one page of zeros."""
    gen = runtime.load(artifact_dir, max_batch=4, threads=1)
    backend, storage = gen.engine.backend, gen.engine.cache.storage
    seen = []
    for index, name in enumerate(backend._layer_names):
        session = backend._sessions[name]

        class Spy:
            def __init__(self, inner, index):
                self.inner, self.index = inner, index

            def run(self, outputs, feeds):
                result = self.inner.run(outputs, feeds)
                k, v = storage.flat[self.index]  # the layer's buffers, whatever the width
                seen.append((feeds["past_key"].base is k, feeds["past_value"].base is v,
                             feeds["past_key"].shape, result[1].shape))
                return result

        backend._sessions[name] = Spy(session, index)
    result = gen.generate(PROMPTS[:2], 40, speedup=2, ignore_eos=True)
    decode = [s for s in seen if s[3][2] == 1]
    assert len(decode) == sum(len(s.layers) for s in result.stats.steps)
    assert all(in_k and in_v for in_k, in_v, _, _ in decode)
    prefill = [s for s in seen if s[3][2] > 1]  # the prompt: its rows hold nothing yet, so they
    assert {shape for _, _, shape, _ in prefill} == {(2, gen.manifest.model.num_heads,  # bind one page
                                                     gen.manifest.model.head_dim, 32)}  # of zeros
    m = gen.manifest.model
    assert {shape[:3] for _, _, shape, _ in decode} == {(2, m.num_heads, m.head_dim)}  # 2 rows of 4
    assert {shape[3] for _, _, shape, _ in decode} == {32, 64}  # the width follows the rows, in pages
    assert {new for _, _, _, new in decode} == {(2, m.num_heads, 1, m.head_dim)}
    gen.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "onnxruntime-iobinding"])
def test_a_step_computes_the_rows_that_run_not_the_rows_it_could_hold(artifact_dir, backend):
    """On 8 KV rows, a lone request's every layer runs 1 row; two requests run 2; and a row that
    finishes first leaves a step of 1 again."""
    name, options = BACKENDS[backend]
    gen = runtime.load(artifact_dir, backend=name, max_batch=8, threads=1, **options)
    with spying(gen) as spy:
        gen.generate(PROMPTS[0], 6, ignore_eos=True)
        assert {rows for _, rows, _ in spy.bound} == {1}
        assert {len(u) for _, u in spy.updates} == {1}
        spy.bound.clear()
    gen.close()
    # both requests queued before the first step (a stepper: no worker thread to race them)
    gen = runtime.load(artifact_dir, backend=name, max_batch=8, threads=1, **options)
    with spying(gen) as spy, gen.stepper() as stepper:
        stepper.add(PROMPTS[1], 3, ignore_eos=True)
        stepper.add(PROMPTS[2], 12, ignore_eos=True)
        while not stepper.done:
            stepper.step()
    decode_rows = [rows for _, rows, width in spy.bound if width % 32 == 1]  # decode: W + 1 columns
    assert max(decode_rows) == 2 and decode_rows[-1] == 1
    gen.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torch-static"])
def test_rows_leaving_from_the_middle_keep_the_others_exact(artifact_dir, backend):
    """Rows finish in an order that empties the middle of the pack: the last rows move into the
    gaps, and every row's tokens (and each step's logits) equal its run alone."""
    name, options = BACKENDS[backend]
    gen = runtime.load(artifact_dir, backend=name, max_batch=4, threads=1, **options)
    if backend == "torch-static":
        gen.backend.use_graphs(EagerCapture())
    lengths = [20, 4, 9, 16]  # row 1 leaves first, then row 2: the middle of the pack
    prompts = [f"{PROMPTS[k % 3]} {k}" for k in range(4)]
    want = [gen.generate(p, n, ignore_eos=True, speedup=2) for p, n in zip(prompts, lengths)]
    streams = [gen.stream(p, n, ignore_eos=True, speedup=2) for p, n in zip(prompts, lengths)]
    events = [list(s) for s in streams]
    for s, w, ev in zip(streams, want, events):
        assert s.result.token_ids == w.token_ids
        assert len(ev) == len(w.token_ids[0])
    assert gen.engine.cache.moves > 0, "no row moved: the test does not exercise departures"
    assert gen.engine.owner == [None] * 4
    gen.close()


def test_stepper_gives_the_tokens_of_generate(artifact_dir):
    """An app's own loop: add requests, step, read events; no thread is started."""
    gen = runtime.load(artifact_dir, max_batch=2, threads=1)
    calls = [(PROMPTS[0], 8, dict(speedup=2)), ([PROMPTS[1], PROMPTS[2]], 6, {}), ("Hello", 5, {})]
    with runtime.load(artifact_dir, max_batch=2, threads=1) as ref:
        want = [ref.generate(p, n, ignore_eos=True, **o) for p, n, o in calls]
    with gen.stepper() as stepper:
        handles = [stepper.add(p, n, ignore_eos=True, **o) for p, n, o in calls]
        steps, seen = 0, []
        while not stepper.done:
            seen += stepper.step()
            steps += 1
        assert gen.engine.thread is None
    for h, w in zip(handles, want):
        assert h.done and h.error is None
        assert h.result.token_ids == w.token_ids and h.result.texts == w.texts
        assert [e for r, e in seen if r is h] == h.events
    assert steps < sum(n for _, n, _ in calls)  # requests shared steps
    gen.close()


def test_stepper_and_worker_thread_do_not_mix(artifact_dir):
    gen = runtime.load(artifact_dir, max_batch=2, threads=1)
    stepper = gen.stepper()
    with pytest.raises(EngineClosedError, match="driven by a step loop"):
        gen.generate(PROMPTS[0], 2)
    with pytest.raises(ValueError, match="already driven by another stepper"):
        gen.stepper()
    handle = stepper.add(PROMPTS[0], 30, ignore_eos=True)
    stepper.step()
    stepper.step()
    stepper.close()  # cancels what runs, and gives the Generator back
    # the cancelled request keeps the tokens it had, those its events gave
    assert handle.done and handle.result.finish_reasons == ["cancelled"]
    assert handle.result.token_ids[0] == [e.token_ids[0] for e in handle.events] and len(handle.events) >= 2
    assert len(gen.generate(PROMPTS[0], 3, ignore_eos=True).token_ids[0]) == 3
    with pytest.raises(ValueError, match="already driven by its worker thread"):
        gen.stepper()
    gen.close()
    with pytest.raises(EngineClosedError, match="this Generator is closed; load the artifact again"):
        gen.stepper()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(artifact_dir, backend):
    """A long prompt joins a decoding row in chunks (4 tokens, or "auto": about a decode step's
    time each): both rows' tokens equal those with the prompt run whole, and the running row got
    tokens between the chunks."""
    long_prompt = " ".join(f"item {k} of the list," for k in range(5))  # ~55 tokens
    results = {}
    for chunk in (None, 4, "auto"):
        gen = runtime.load(artifact_dir, backend=backend, max_batch=2, threads=1, prefill_chunk=chunk)
        with gen.stepper() as stepper:
            first = stepper.add(PROMPTS[0], 30, ignore_eos=True, speedup=2)
            stepper.step()
            joining = stepper.add(long_prompt, 8, ignore_eos=True, speedup=2)
            steps_until_joined = 0
            while not joining.events:
                stepper.step()
                steps_until_joined += 1
            while not stepper.done:
                stepper.step()
        results[chunk] = (first.result.token_ids, joining.result.token_ids, steps_until_joined)
        gen.close()
    prompt_tokens = joining.result.stats.prompt_tokens
    assert results[4][:2] == results[None][:2] == results["auto"][:2]
    assert results[None][2] == 1 and results[4][2] == -(-prompt_tokens // 4)
    assert 1 < results["auto"][2] <= -(-prompt_tokens // AUTO_MIN)


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "fast"])
def test_prefill_chunk_is_checked(artifact_dir, value):
    with pytest.raises(ValueError, match=f"prefill_chunk must be 'auto', None or an int >= 1, got {value!r}"):
        runtime.load(artifact_dir, max_batch=1, threads=1, prefill_chunk=value)


def test_64_prompts_on_8_rows_equal_each_alone(artifact_dir):
    """One call of 64 prompts on a Generator of 8 rows: every row equals its prompt run alone."""
    prompts = [f"{PROMPTS[k % 3]} {k}" for k in range(64)]
    with runtime.load(artifact_dir, max_batch=1, threads=1) as one:
        want = [one.generate(p, 4, ignore_eos=True, speedup=2).token_ids[0] for p in prompts]
    with runtime.load(artifact_dir, max_batch=8, threads=1) as gen:
        result = gen.generate(prompts, 4, ignore_eos=True, speedup=2)
        assert gen.engine.owner == [None] * 8
    assert result.token_ids == want


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_random_schedule_keeps_every_row_exact(artifact_dir, seed, backend):
    """Requests of 1-3 prompts with random lengths, budgets and arrival steps on 4 rows, chunked
    prefill of 3 tokens, some cancelled on the way: every request that finishes equals its run
    alone (on ONNX Runtime, whatever this backend), and the cache ends empty."""
    rng = np.random.default_rng(seed)
    words = ["item", "list", "the", "of", "a", "coffee", "shop", "river", "French", "food"]
    calls = []
    for k in range(10):
        prompts = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(rng.integers(1, 4))]
        options = dict(speedup=float(rng.choice([1, 2, 3])), ignore_eos=True)
        calls.append((prompts, int(rng.integers(2, 14)), options, int(rng.integers(0, 12)),
                      bool(rng.random() < 0.2)))  # (prompts, new tokens, options, arrival step, cancel)
    with runtime.load(artifact_dir, max_batch=4, threads=1) as ref:
        want = [ref.generate(p, n, **o).token_ids for p, n, o, _, _ in calls]
    name, load_options = BACKENDS[backend]
    gen = runtime.load(artifact_dir, backend=name, max_batch=4, threads=1, prefill_chunk=3, **load_options)
    if backend == "torch-static":
        gen.backend.use_graphs(EagerCapture())
    with gen.stepper() as stepper:
        handles, step = {}, 0
        while len(handles) < len(calls) or not stepper.done:
            for k, (p, n, o, at, _) in enumerate(calls):
                if at == step and k not in handles:
                    handles[k] = stepper.add(p, n, **o)
            for k, (_, _, _, at, cancel) in enumerate(calls):
                if cancel and step == at + 2 and k in handles:
                    stepper.cancel(handles[k])
            stepper.step()
            step += 1
        assert gen.engine.owner == [None] * 4 and gen.engine.cache.used == 0
    for k, (_, _, _, _, cancel) in enumerate(calls):
        h = handles[k]
        assert h.done and h.error is None
        if cancel and "cancelled" in h.result.finish_reasons:  # what it had: a prefix of its tokens alone
            assert all(got == full[:len(got)] for got, full in zip(h.result.token_ids, want[k])), f"call {k}"
            continue
        assert h.result.token_ids == want[k], f"call {k}"
    assert gen.engine.cache.moves > 0
    gen.close()


def test_auto_chunks_come_from_a_fixed_plus_per_token_fit_robust_to_a_slow_chunk():
    """The demo model's case: a chunk costs mostly its layers' fixed cost, so a short prompt runs
    whole (splitting it cost a pass of every layer per chunk, and concurrency on small models with
    it), and a long one is cut to the chunk that fits the budget; one chunk slowed by another
    process does not move the fit."""
    from runtime.engine import AUTO_WHOLE, ChunkCosts

    costs = ChunkCosts()
    assert costs.tokens(40, 2.0, first=True) == 16  # nothing measured yet: AUTO_FIRST
    for tokens in (4, 8, 12, 16, 20, 24):
        costs.add(tokens, 1.0 + 0.05 * tokens)  # ms: 1 fixed + 0.05 a token
    costs.add(10, 9.0)  # a chunk another process slowed
    fixed, per_token = costs.fit()
    assert fixed == pytest.approx(1.0, abs=0.02) and per_token == pytest.approx(0.05, rel=0.02)
    budget = 2.0
    assert costs.tokens(20, budget, first=True) == 20  # 2 ms whole <= AUTO_WHOLE budgets: not split
    assert 1.0 + 0.05 * 20 <= AUTO_WHOLE * budget
    # a long prompt, or the rest of one: chunks that take the budget, (budget - fixed) / per_token
    assert costs.tokens(500, budget, first=True) in (19, 20) and costs.tokens(30, budget, first=False) in (19, 20)
    assert costs.tokens(500, 0.5, first=True) in (9, 10)  # fixed alone over the budget: budget / per_token


def stepped(gen, prompts, max_new_tokens, **kwargs) -> list[list[int]]:
    """A request's tokens with nothing else in the batch, through a stepper (``gen`` may be one's)."""
    with gen.stepper() as stepper:
        handle = stepper.add(prompts, max_new_tokens, **kwargs)
        while not stepper.done:
            stepper.step()
    assert handle.error is None, handle.error
    return handle.result.token_ids


def test_batch_invariant_prefills_each_prompt_alone_in_its_own_pages(artifact_dir, monkeypatch):
    """batch_invariant=True: no prefill call carries two rows (no prompt is padded beside another),
    and a prompt runs in the same chunks, ending at its page ends, alone and joining running rows
    (a chunk sized by the load moved int4 roundings: 1 of 6 short prompts changed on the real model);
    the tokens are each prompt's alone."""
    gen = runtime.load(artifact_dir, max_batch=4, batch_invariant=True, check_hashes=False)
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)  # 37 tokens: two pages
    try:
        embed, calls = gen.backend.embed, []

        def recording(ids, mask):
            if ids.shape[1] > 1:  # a prefill chunk: (rows, tokens)
                calls.append(ids.shape)
            return embed(ids, mask)

        monkeypatch.setattr(gen.backend, "embed", recording)
        alone = {p: stepped(gen, p, 6, ignore_eos=True)[0] for p in [*PROMPTS, long]}  # (a stepper: below)
        assert calls[-2:] == [(1, 32), (1, 5)]  # the long prompt, alone: its pages
        calls.clear()
        assert stepped(gen, PROMPTS, 6, ignore_eos=True) == [alone[p] for p in PROMPTS]
        assert calls and {rows for rows, _ in calls} == {1}
        calls.clear()
        with gen.stepper() as stepper:  # joining a running row: the same chunks
            running = stepper.add(PROMPTS[0], 12, ignore_eos=True)
            stepper.step()
            joining = stepper.add(long, 6, ignore_eos=True)
            while not stepper.done:
                stepper.step()
        assert calls[1:] == [(1, 32), (1, 5)]
        assert running.result.token_ids[0][:6] == alone[PROMPTS[0]] and joining.result.token_ids[0] == alone[long]
    finally:
        gen.close()
    with pytest.raises(runtime.errors.InvalidArgumentError, match="batch_invariant must be"):
        runtime.load(artifact_dir, batch_invariant="yes", check_hashes=False)


def test_a_layer_only_deep_rows_run_binds_only_their_span(artifact_dir):
    """Rows at different depths in one step: a layer that only the full-depth rows run is called on
    the span of those rows, not the whole batch (the shallow rows skip it at no cost), and every
    request still gets its tokens alone."""
    asks = [(PROMPTS[0], 8, dict(speedup=3)), (PROMPTS[1], 8, {}), (PROMPTS[2], 8, dict(speedup=3))]
    with runtime.load(artifact_dir, threads=1, fused=False) as one:
        expected = [alone(one, *a).token_ids for a in asks]
    gen = runtime.load(artifact_dir, max_batch=4, threads=1, fused=False)  # the host path of plain graphs
    try:
        with spying(gen) as spy:
            stepper = gen.stepper()
            handles = [stepper.add(p, n, ignore_eos=True, **o) for p, n, o in asks]
            while not stepper.done:
                stepper.step()
            stepper.close()
        assert [h.result.token_ids for h in handles] == expected
        shallow = set(handles[0].result.policy.active_layers(0))  # the 3x rows' largest set
        assert len(shallow) < gen.num_layers
        deep_only = [rows for index, rows, _ in spy.bound if rows < 3 and index not in shallow]
        assert deep_only and set(deep_only) == {1}  # the full-depth row alone (the middle of three)
    finally:
        gen.close()


class Picks:
    """Records, for each decode step and verify pass, whether the engine asked for the rows' argmax
    and what came back (token ids, or logits)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []  # ("decode" | "verify", argmax asked, dtype kind, shape)
        for name in ("decode", "verify"):
            setattr(backend, name, self._recording(name, getattr(backend, name)))

    def stop(self) -> None:
        """The backend's own methods again (a backend other tests share)."""
        del self.backend.decode, self.backend.verify

    def _recording(self, name, call):
        def run(job, cache):
            out = call(job, cache)
            self.calls.append((name, job.argmax, out.dtype.kind, out.shape))
            return out
        return run


@pytest.mark.parametrize("backend", ["torch-static", "onnxruntime", "onnxruntime-iobinding"])
def test_greedy_rows_without_events_take_their_argmax_from_the_backend(artifact_dir, backend):
    """``generate`` without a streamer, greedy: each step and verify pass asks the backend for its
    rows' token ids only (a GPU's logits need not come back to the host); the torch backend's
    static steps and the IOBinding backend (an ArgMax helper graph) pick them on the device, plain
    ONNX Runtime's logits are reduced on the host. The tokens are those of the same call with a
    streamer, whose events carry the logits (none asked)."""
    name, options = BACKENDS[backend]
    gen = runtime.load(artifact_dir, backend=name, max_batch=4, threads=1, **options)
    if backend == "torch-static":
        gen.backend.use_graphs(EagerCapture())
    try:
        picks = Picks(gen.backend)
        for kwargs in (dict(speedup=2), dict(speedup=3, lossless=True)):
            picks.calls.clear()
            events = []
            want = gen.generate(PROMPTS, 12, ignore_eos=True, streamer=events.append, **kwargs)
            assert events and all(e.logits is not None for e in events)
            assert picks.calls and not any(asked for _, asked, _, _ in picks.calls)
            picks.calls.clear()
            got = gen.generate(PROMPTS, 12, ignore_eos=True, **kwargs)
            assert got.token_ids == want.token_ids
            assert picks.calls and all(asked for _, asked, _, _ in picks.calls), picks.calls
            kinds = {(call, kind, len(shape)) for call, _, kind, shape in picks.calls}
            if backend != "onnxruntime":  # (R,) ids from a step, (n, T) from a pass
                assert kinds == ({("decode", "i", 1), ("verify", "i", 2)} if kwargs.get("lossless")
                                 else {("decode", "i", 1)}), kinds
            else:
                assert {kind for _, kind, _ in kinds} == {"f"}
            if kwargs.get("lossless"):
                assert got.stats.verify_passes > 0
    finally:
        gen.close()


def test_a_stream_without_logits_takes_the_argmax_too(artifact_dir):
    """``logits=False`` (the server's streams, the command line's --stream): events whose logits are
    None, the same tokens and texts, and the steps ask for the rows' argmax."""
    gen = runtime.load(artifact_dir, backend="torch", max_batch=4, threads=1)
    gen.backend.use_graphs(EagerCapture())
    try:
        picks = Picks(gen.backend)
        with_logits, without = [], []
        want = gen.generate(PROMPTS, 8, ignore_eos=True, streamer=with_logits.append, speedup=2)
        got = gen.generate(PROMPTS, 8, ignore_eos=True, streamer=without.append, speedup=2, logits=False)
        assert got.token_ids == want.token_ids and got.texts == want.texts
        assert [(e.token_ids, e.texts) for e in without] == [(e.token_ids, e.texts) for e in with_logits]
        assert all(e.logits is None for e in without) and all(e.logits is not None for e in with_logits)
        asked = [a for _, a, _, _ in picks.calls]
        assert asked[: len(asked) // 2] == [False] * (len(asked) // 2) and all(asked[len(asked) // 2:])
    finally:
        gen.close()
    looped = runtime.load(artifact_dir, backend="torch", max_batch=4, threads=1)  # an app's own loop, the same way
    looped.backend.use_graphs(EagerCapture())
    picks = Picks(looped.backend)
    try:
        with looped.stepper() as stepper:
            handle = stepper.add(PROMPTS, 8, ignore_eos=True, speedup=2, logits=False)
            while not stepper.done:
                stepper.step()
        assert handle.result.token_ids == want.token_ids and all(e.logits is None for e in handle.events)
        assert picks.calls and all(a for _, a, _, _ in picks.calls)
    finally:
        looped.close()


@pytest.mark.parametrize("kwargs", [dict(do_sample=True, seed=1), dict(presence_penalty=0.5), dict(logprobs=2),
                                    dict(json_schema={"type": "object"})])
def test_rows_whose_logits_are_read_get_their_logits(artifact_dir, kwargs):
    """Sampling, penalties, logprobs and a schema read the logits: their steps ask for no argmax."""
    gen = runtime.load(artifact_dir, backend="torch", max_batch=4, threads=1)
    gen.backend.use_graphs(EagerCapture())
    try:
        picks = Picks(gen.backend)
        gen.generate(PROMPTS[:2], 6, **kwargs)
        assert picks.calls and not any(asked for _, asked, _, _ in picks.calls)
        assert all(kind == "f" for _, _, kind, _ in picks.calls)
    finally:
        gen.close()


def test_a_step_asks_for_the_argmax_only_when_every_row_it_runs_wants_only_that():
    """A row that streams beside greedy ones makes the step bring back logits; a waiting row (it
    runs no layer, and its logits are dropped) does not."""
    from types import SimpleNamespace

    from runtime.engine.scheduler import DecodePlan, VerifyPlan

    def row(only):
        return SimpleNamespace(request=SimpleNamespace(argmax_only=only))

    greedy, streams = row(True), row(False)

    def plan(seqs, waiting):
        n = len(seqs)
        return DecodePlan(seqs, [False] * n, [False] * n, waiting, [0] * n, [(0,)] * n, np.zeros(n))

    assert plan([greedy, greedy], [False, False]).argmax
    assert not plan([greedy, streams], [False, False]).argmax
    assert plan([greedy, streams], [False, True]).argmax
    assert VerifyPlan([greedy, streams], [greedy], 3).argmax
    assert not VerifyPlan([greedy, streams], [greedy, streams], 3).argmax
