"""Prompt reuse (runtime.prefix_cache): a row whose prompt starts with whole pages another row ran
takes their K/V and runs only the rest, with the tokens it would have had; bounded, least recently
used first; only where every layer ran and one row prefills; counted in the stats, the usage and
/metrics."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime.prefix_cache import PrefixCache

PAGE = 32  # the tiny artifacts' page_size (export's default)
SHARED = list(range(40, 40 + 36))  # a 36-token "system prompt": one whole page and 4 tokens more
NEW = 8


def _prompt(tail: list[int]) -> list[list[int]]:
    return [SHARED + tail]  # token ids, run as given


def _run(gen, tail, **options):
    stream = gen.stream(_prompt(tail), NEW, ignore_eos=True, **options)
    logits = [event.logits for event in stream]
    return stream.result, logits


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("backend, device", [
    ("onnxruntime", None), ("torch", None),
    pytest.param("torch", "cuda", marks=pytest.mark.skipif(not _cuda_visible(), reason="no CUDA device here")),
])
def test_a_reused_prefix_gives_the_tokens_it_would_have(artifact_dir, backend, device):
    # On CUDA the torch backend's K/V rows are device tensors, and decode steps are CUDA graphs
    # bound to them: a loaded prefix must land in the tensors the graphs read.
    on = {} if device is None else {"device": device}
    plain = runtime.load(artifact_dir, backend=backend, check_hashes=False, **on)
    reusing = runtime.load(artifact_dir, backend=backend, check_hashes=False, prefix_cache_mb=1, **on)
    try:
        first, _ = _run(reusing, [7, 8, 9])
        assert first.stats.cached_tokens == 0 and len(reusing.engine.scheduler.prefix_cache) == 1  # it left its page
        for tail in ([7, 8, 9], [11, 12], [13]):
            ours, ours_logits = _run(reusing, tail)
            theirs, their_logits = _run(plain, tail)
            assert ours.stats.cached_tokens == PAGE  # the shared page came from the cache
            assert ours.token_ids == theirs.token_ids
            for a, b in zip(ours_logits, their_logits, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)  # the rest ran as its own chunk
    finally:
        plain.close()
        reusing.close()


def test_nothing_is_reused_where_it_would_not_be_exact_or_simple(artifact_dir):
    gen = runtime.load(artifact_dir, check_hashes=False, prefix_cache_mb=1, max_batch=4)
    try:
        _run(gen, [7, 8, 9])
        policy_prefill = _run(gen, [7], speedup=2, prefill="policy")[0]  # step 0's layers only
        assert policy_prefill.stats.cached_tokens == 0
        two_rows = gen.generate([SHARED + [7], SHARED + [8]], NEW, ignore_eos=True)  # a batch's rows share padding
        assert two_rows.stats.cached_tokens == 0
        short = gen.generate([SHARED[:PAGE]], NEW, ignore_eos=True)  # no token would be left to run
        assert short.stats.cached_tokens == 0
        assert gen.engine.scheduler.prefix_cache.hits == 0
    finally:
        gen.close()


def test_the_cache_keeps_the_most_recent_within_its_bytes():
    blob = lambda n: [(np.zeros((1, 2, 4, n), np.float32), np.zeros((1, 2, n, 4), np.float32))]  # noqa: E731
    size = 2 * 2 * 4 * 4 * 4  # one layer's K and V of 4 positions, float32
    cache = PrefixCache(max_bytes=2 * size, page=4)
    a, b, c = (np.arange(k * 100, k * 100 + 8) for k in (1, 2, 3))
    cache.store(a[:4], blob(4))
    cache.store(b[:4], blob(4))
    assert cache.lookup(np.concatenate([a[:4], [5]]))[1] == 4  # a is now the most recent
    cache.store(c[:4], blob(4))  # b goes
    assert cache.lookup(np.concatenate([b[:4], [5]])) is None and len(cache) == 2 and cache.bytes == 2 * size
    long = PrefixCache(max_bytes=10 * size, page=4)
    long.store(a, blob(8))
    assert long.lookup(a)[1] == 4  # 8 tokens: the last must run, so the first page serves
    assert long.lookup(np.concatenate([a, [1]]))[1] == 8 and long.tokens_saved == 12
    assert long.wants(a) == 0 and long.wants(b[:7]) == 4 and long.wants(b[:3]) == 0


def test_a_storage_that_cannot_copy_rows_says_so(artifact_dir):
    with pytest.warns(UserWarning, match="KV storage cannot copy a row's K/V out, so prompts are not reused on it"):
        gen = runtime.load(artifact_dir, check_hashes=False, device="cpu", prefix_cache_mb=1)  # IOBinding storage
    try:
        assert gen.engine.scheduler.prefix_cache is None
    finally:
        gen.close()


@pytest.mark.parametrize("value", [-1, "big", True])
def test_a_bad_size_is_refused(artifact_dir, value):
    with pytest.raises(ValueError, match=r"prefix_cache_mb must be a number >= 0 \(0: no prompt reuse\)"):
        runtime.load(artifact_dir, check_hashes=False, prefix_cache_mb=value)


def test_the_server_reports_reuse_in_usage_and_metrics(artifact_dir):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from runtime.serve import ServeConfig, create_app
    from tests.runtime.serve_helpers import LiveServer

    gen = runtime.load(artifact_dir, check_hashes=False, prefix_cache_mb=1)
    try:
        with LiveServer(create_app(gen, ServeConfig(close_generator=False))) as live, \
                httpx.Client(base_url=live.url, timeout=60) as client:
            usages = [client.post("/v1/completions", json={"prompt": SHARED + tail, "max_tokens": 4}).json()["usage"]
                      for tail in ([1, 2], [3, 4])]
            metrics = client.get("/metrics").text
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, PAGE]
        assert "skipdecode_prefix_cache_hits_total 1.0" in metrics
        assert f"skipdecode_prefix_cache_tokens_total {float(PAGE)}" in metrics
    finally:
        gen.close()
