"""The torch backend's captured decode steps: buckets, keys, and the static step against the plain one.

The static step (what a CUDA graph captures) runs eagerly on the CPU through EagerCapture, so
everything but the capture itself is checked here; the CUDA tests skip without a GPU.
"""

import numpy as np
import pytest
import torch

import runtime
from runtime.backends.cuda_graphs import (MIN_WIDTH, CudaGraphCapture, EagerCapture, GraphCache, GraphKey,
                                          batch_bucket, default_capture, width_bucket)
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import assert_same_steps

NEW = 12
LONG = 36  # new tokens that take a prompt past the first page of 32
STATIC_ATOL = 1e-5  # fp32, static vs plain step: attention reduces over more (masked) positions
CUDA_ATOL = 1e-4  # fp32, CUDA graph vs eager CUDA (same kernels; cuBLAS may pick others per shape)
NO_CUDA = "no CUDA device visible to PyTorch on this machine; CUDA graphs are captured only on a GPU"


class CountingCapture(EagerCapture):
    def __init__(self):
        self.captured = 0

    def __call__(self, fn):
        self.captured += 1
        return super().__call__(fn)


def load(artifact_dir, capture=None, **options):
    gen = runtime.load(artifact_dir, backend="torch", device="cpu", check_hashes=False, **options)
    if capture is not None:
        gen.backend.use_graphs(capture)
    return gen


@pytest.fixture(scope="module")
def plain(artifact_dir):
    gen = load(artifact_dir, max_batch=4)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def static(artifact_dir):
    gen = load(artifact_dir, CountingCapture(), max_batch=4)
    yield gen
    gen.close()


# -- buckets and keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("past, capacity, want", [(1, 2048, MIN_WIDTH), (32, 2048, 32), (33, 2048, 64),
                                                  (1000, 2048, 1024), (1025, 2048, 2048), (40, 48, 48),
                                                  (5, 8, 8)])
def test_width_bucket(past, capacity, want):
    assert width_bucket(past, capacity) == want


def test_width_bucket_refuses_a_past_beyond_the_capacity():
    with pytest.raises(ValueError, match="a past of 65 positions exceeds the capacity 64"):
        width_bucket(65, 64)


@pytest.mark.parametrize("needed, slots, want", [(1, 8, 1), (2, 8, 2), (3, 8, 4), (5, 8, 8), (5, 6, 6), (1, 1, 1)])
def test_batch_bucket(needed, slots, want):
    assert batch_bucket(needed, slots) == want


@pytest.mark.parametrize("needed", [0, 9])
def test_batch_bucket_refuses_what_the_slots_cannot_hold(needed):
    with pytest.raises(ValueError, match=f"a step needs {needed} rows of the 8 allocated"):
        batch_bucket(needed, 8)


class Built(list):
    """The keys a GraphCache built steps for: ``cache.get(key, built.step)``."""

    class Step:
        def run(self):
            pass

    def step(self, key):
        self.append(key)
        return self.Step()


def test_graph_cache_builds_and_captures_once_per_key():
    capture, built = CountingCapture(), Built()
    cache = GraphCache(capture)
    a, b = GraphKey((0, 1, 5), 1, 32), GraphKey((0, 5), 1, 32)
    first = cache.get(a, built.step)
    assert cache.get(a, built.step) is first and cache.get(b, built.step) is not first
    assert built == [a, b] and capture.captured == 2
    cache.clear()
    cache.get(a, built.step)
    assert capture.captured == 3  # new buffers, new graphs


def test_graph_cache_keeps_the_most_recently_used_steps():
    capture, built = CountingCapture(), Built()
    cache = GraphCache(capture, max_steps=2)
    a, b, c = (GraphKey((0, 5), 1, w) for w in (32, 64, 128))
    cache.get(a, built.step), cache.get(b, built.step)
    cache.get(a, built.step)  # a is now the most recent: b goes when c comes
    cache.get(c, built.step)
    assert list(cache.steps) == [a, c] and capture.captured == 3
    cache.get(b, built.step)  # captured again
    assert list(cache.steps) == [c, b] and built == [a, b, c, b] and cache.captures == 4
    with pytest.raises(ValueError, match="max_steps must be >= 1, got 0"):
        GraphCache(capture, max_steps=0)


def test_default_capture():
    assert default_capture(torch.device("cpu"), None) is None  # off on the CPU unless asked
    assert default_capture(torch.device("cpu"), False) is None
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda', got device='cpu'"):
        default_capture(torch.device("cpu"), True)


def test_cuda_graphs_on_the_cpu_is_refused(artifact_dir):
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        runtime.load(artifact_dir, backend="torch", cuda_graphs=True, check_hashes=False)


# -- the static step against the plain one ----------------------------------------------------------


@pytest.mark.parametrize("options", [{}, dict(speedup=2),
                                     dict(policy=SkipPolicy(6, 5, 2, warmup_layers=1, horizon=NEW - 1))])
def test_static_steps_equal_plain_steps(plain, static, options):
    assert_same_steps(static, plain, NEW, STATIC_ATOL, **options)


def test_one_step_per_layer_set_and_bucket(artifact_dir):
    capture = CountingCapture()
    gen = load(artifact_dir, capture, max_batch=4)
    try:
        cache = gen.engine.cache
        result = gen.generate(PROMPTS[0], LONG, speedup=3, ignore_eos=True)
        keys = set(gen.backend.graphs.steps)
        sets = {s.layers for s in result.stats.steps}
        assert {k.layers for k in keys} == sets and len(sets) > 2  # the budget took several values
        assert {k.batch for k in keys} == {1}  # one request in row 0 of 4: batch 1
        # the width each step binds: whole pages holding the row's past and its new position
        lengths = result.stats.prompt_tokens + np.arange(len(result.stats.steps)) + 1
        widths = {-(-int(n) // cache.page) * cache.page for n in lengths}
        assert len(widths) == 2  # the row crossed a page: two widths, two buckets
        assert {k.width for k in keys} == {width_bucket(w, cache.capacity) for w in widths}
        assert capture.captured == len(keys) < len(result.stats.steps)  # later steps replay
        gen.generate(PROMPTS[0], LONG, speedup=3, ignore_eos=True)
        assert capture.captured == len(keys)  # the same steps again: nothing new captured
    finally:
        gen.close()


def test_per_row_budgets_and_skipped_rows_keep_their_kv(artifact_dir, plain):
    """Two requests with different budgets share steps; the K/V left behind equal the plain path's.

    A stepper drives both generators, so the second request joins at the same step in both and the
    rows that leave are replaced by the same moves."""
    L = plain.num_layers
    policies = [SkipPolicy(L, L, 2, warmup_layers=1, horizon=6), SkipPolicy(L, 4, 3, warmup_layers=2, horizon=5)]
    gens = [load(artifact_dir, max_batch=4), load(artifact_dir, CountingCapture(), max_batch=4)]
    outcomes = []
    try:
        for gen in gens:
            with gen.stepper() as stepper:
                handles = [stepper.add(PROMPTS[1], 10, policy=policies[0], ignore_eos=True)]
                stepper.step()  # the first request prefills and decodes alone
                handles.append(stepper.add(PROMPTS[:2], 7, policy=policies[1], ignore_eos=True))
                while not stepper.done:
                    stepper.step()
            results = [[e.token_ids for e in h.events] for h in handles]
            assert all(h.error is None and h.result is not None for h in handles)
            storage = gen.backend.storage
            outcomes.append((results, [k.clone() for k in storage.keys], [v.clone() for v in storage.values],
                             gen.engine.cache.moves))
        (want, want_k, want_v, want_moves), (got, got_k, got_v, got_moves) = outcomes
        assert got == want and got_moves == want_moves > 0  # rows left from the middle
        for a, b in zip(got_k + got_v, want_k + want_v):
            torch.testing.assert_close(a, b, atol=STATIC_ATOL, rtol=0)
        assert any(k.batch > 1 for k in gens[1].backend.graphs.steps)
    finally:
        for gen in gens:
            gen.close()


# -- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_steps_are_captured_again_after_every_graph_is_gone_cuda():
    """PyTorch frees a graph pool with its last graph: capturing after a clear (new KV buffers) or an
    eviction that left no graph failed an allocator assert on an H200 (python -m tools.bench.gpu's
    second batch size)."""
    x = torch.arange(4.0, device="cuda")
    out = torch.zeros(4, device="cuda")

    class Step:
        def __init__(self, key):
            self.scale = key.width

        def run(self):
            out.copy_(x * self.scale + 1)  # a temporary: the step allocates from the graph's pool

    cache = GraphCache(CudaGraphCapture(torch.device("cuda")), max_steps=1)
    for width in (32, 64, 32):  # each evicts the only graph there was
        cache.get(GraphKey((0,), 1, width), Step)[1]()
        torch.testing.assert_close(out, x * width + 1)
    cache.clear()
    cache.get(GraphKey((0,), 1, 128), Step)[1]()
    torch.testing.assert_close(out, x * 128 + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("options", [{}, dict(speedup=2), dict(speedup=3)])
def test_cuda_graphs_equal_eager_cuda(artifact_dir, options):
    graphs = runtime.load(artifact_dir, backend="torch", device="cuda", check_hashes=False, max_batch=4)
    eager = runtime.load(artifact_dir, backend="torch", device="cuda", cuda_graphs=False,
                         check_hashes=False, max_batch=4)
    try:
        assert graphs.backend.graphs is not None and eager.backend.graphs is None  # on by default on CUDA
        assert_same_steps(graphs, eager, NEW, CUDA_ATOL, **options)
        assert graphs.backend.graphs.steps, "no step was captured"
    finally:
        graphs.close()
        eager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_greedy_ids_picked_on_the_gpu_are_the_tokens_of_the_logits_cuda(artifact_dir):
    """generate without a streamer asks the captured steps and passes for their rows' argmax, taken on
    the GPU (runtime.backends.base DecodeStep.argmax): the tokens of the same call with a streamer,
    whose steps bring the logits back."""
    gen = runtime.load(artifact_dir, backend="torch", device="cuda", check_hashes=False, max_batch=4)
    try:
        for options in (dict(speedup=2), dict(speedup=3, lossless=True)):
            events = []
            want = gen.generate(PROMPTS, NEW, ignore_eos=True, streamer=events.append, **options)
            got = gen.generate(PROMPTS, NEW, ignore_eos=True, **options)
            assert got.token_ids == want.token_ids, options
    finally:
        gen.close()


def _row_logits(events) -> dict[int, list[np.ndarray]]:
    """Each row's logits, token by token (lossless rows emit at steps that follow measured times)."""
    rows: dict[int, list[np.ndarray]] = {}
    for event in events:
        for r, token in enumerate(event.token_ids):
            if token is not None:
                rows.setdefault(r, []).append(event.logits[r])
    return rows


@pytest.mark.parametrize("family", ["qwen3", "opt"])
def test_compiled_steps_equal_the_static_steps_with_one_graph_for_every_layer(tmp_path, family):
    """compile_steps=True: each layer of a static step (and of a lossless verify pass), a step's
    embedding, shared inputs and head, and a pass's head through torch.compile (inductor, here its CPU
    code), the same tokens and logits as the static step; one compiled graph serves every layer and
    layer set (the weights are its inputs, not constants; OPT's fp32 norm weights were once looked up
    by the module's id, a constant that recompiled every layer)."""
    from torch._dynamo.utils import counters

    from export.build import BuildOptions, build
    from tests import conftest, families

    if family == "opt":  # pre-LN, 6 layers
        ckpt = conftest.save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln")
    else:  # RoPE, q/k norms, grouped KV heads
        ckpt = families.save_tiny_checkpoint(tmp_path / "ckpt", family)
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    plain = load(tmp_path / "art", EagerCapture(), max_batch=4)
    compiled = load(tmp_path / "art", EagerCapture(), max_batch=4, compile_steps=True)
    counters.clear()
    try:
        for options in (dict(speedup=2), dict(speedup=2, lossless=True)):
            want, got = [], []
            a = plain.generate(PROMPTS, NEW, ignore_eos=True, streamer=want.append, **options)
            b = compiled.generate(PROMPTS, NEW, ignore_eos=True, streamer=got.append, **options)
            assert a.token_ids == b.token_ids, options
            want_rows, got_rows = _row_logits(want), _row_logits(got)
            for r in want_rows:
                for x, y in zip(want_rows[r], got_rows[r], strict=True):
                    np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
    finally:
        plain.close()
        compiled.close()
    # a decode step's layer, a verify pass's, a step's embedding and shared inputs, a step's head and a
    # pass's: each compiled once or twice (a new shape, then dynamic), not once a layer
    assert 5 <= counters["stats"]["unique_graphs"] <= 10, dict(counters["stats"])
