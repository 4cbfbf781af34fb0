"""Lossless SkipDecode (self-speculative decoding): the policy's layers draft, a full-depth pass
verifies, and the tokens are full depth's: greedy token for token (alone, batched, beside plain
rows, with EOS, stop strings and max_new_tokens inside a draft, on every backend), sampled by
full depth's distribution (speculative sampling's rule), and observable in the stats."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

import runtime
from export.build import BuildOptions, build
from runtime.backends.base import run_verify
from runtime.backends.cuda_graphs import EagerCapture, tokens_bucket
from runtime.errors import InvalidArgumentError
from runtime.lossless import verify_draft
from tests.conftest import PROMPTS
from tests.families import save_tiny_checkpoint
from tests.runtime.test_engine import stepped
from tests.runtime.test_tensorrt_backend import fake_gpu  # noqa: F401  (a fixture)

NEW = 24


@pytest.fixture(scope="module")
def gen(artifact_dir):
    g = runtime.load(artifact_dir, max_batch=4, check_hashes=False)
    yield g
    g.close()


@pytest.fixture(scope="module")
def full(gen):
    return gen.generate(PROMPTS, NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def llama_artifact(request, tmp_path_factory):
    """A Llama-family artifact (fused GroupQueryAttention layers on ONNX Runtime's CPU)."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp(f"{request.param}-ckpt"), request.param)
    out = tmp_path_factory.mktemp(f"{request.param}-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False), log=lambda *_: None)
    return out


@pytest.mark.parametrize("speedup", [2, 3, 5])
def test_greedy_lossless_is_full_depth(gen, full, speedup):
    result = gen.generate(PROMPTS, NEW, speedup=speedup, lossless=True, ignore_eos=True)
    assert result.token_ids == full.token_ids
    assert result.texts == full.texts
    s = result.stats
    assert s.verify_passes > 0 and s.drafted_tokens > 0 and 0 <= s.accepted_tokens <= s.drafted_tokens
    assert s.decode_tokens == len(PROMPTS) * (NEW - 1)  # every token after the prompt's first
    assert all(step.budget == len(step.layers) for step in s.steps)  # drafts, passes: the layers they ran
    assert s.to_dict()["acceptance_rate"] == round(s.accepted_tokens / s.drafted_tokens, 4)


def test_the_skipping_policy_alone_differs(gen, full):
    """The drafts are not full depth's on this random model: the test above verifies something."""
    plain = gen.generate(PROMPTS, NEW, speedup=3, ignore_eos=True)
    assert plain.token_ids != full.token_ids
    lossless = gen.generate(PROMPTS, NEW, speedup=3, lossless=True, ignore_eos=True)
    assert lossless.stats.accepted_tokens < lossless.stats.drafted_tokens  # some drafts were rejected


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9])
def test_max_new_tokens_inside_a_draft(gen, max_new_tokens):
    want = gen.generate(PROMPTS, max_new_tokens, ignore_eos=True)
    got = gen.generate(PROMPTS, max_new_tokens, speedup=2, lossless=True, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert got.finish_reasons == want.finish_reasons == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("at", [1, 4, 7])
def test_eos_and_stop_strings_inside_a_draft(gen, full, at):
    """A row ends at full depth's EOS (or stop string) even when a kept draft or the verify pass's
    own token carries it mid-pass; the tokens after it are never emitted."""
    eos = full.token_ids[0][at]
    want = gen.generate(PROMPTS[0], NEW, eos_token_id=eos)
    got = gen.generate(PROMPTS[0], NEW, eos_token_id=eos, speedup=2, lossless=True)
    assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons == ["eos"]
    stop = full.texts[0][len(gen.tokenizer.decode(full.token_ids[0][:at])):][:3]
    if stop.strip():
        want = gen.generate(PROMPTS[0], NEW, stop_strings=[stop], ignore_eos=True)
        got = gen.generate(PROMPTS[0], NEW, stop_strings=[stop], speedup=2, lossless=True, ignore_eos=True)
        assert (got.token_ids, got.texts, got.finish_reasons) == (want.token_ids, want.texts, want.finish_reasons)


@pytest.mark.parametrize("row, at", [(0, 2), (1, 3), (2, 5)])
def test_a_batch_whose_rows_end_apart(gen, full, row, at):
    """One row drafts an EOS (no room for more drafts) while the others draft on: it waits for the
    pass without running a token of its own, and every row gives full depth's tokens."""
    eos = full.token_ids[row][at]
    want = gen.generate(PROMPTS, NEW, eos_token_id=eos)
    for speedup in (2, 5):
        got = gen.generate(PROMPTS, NEW, eos_token_id=eos, speedup=speedup, lossless=True)
        assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons


def test_lossless_rows_beside_plain_rows(artifact_dir, gen, full):
    """One engine, one lossless request and one plain SkipDecode request sharing its steps: each
    gives what it gives alone (the plain rows ride along the verify passes unchanged)."""
    plain_alone = gen.generate(PROMPTS[1:], NEW, speedup=2, ignore_eos=True)
    mixed = runtime.load(artifact_dir, max_batch=4, check_hashes=False)
    try:
        with mixed.stepper() as stepper:
            a = stepper.add(PROMPTS[:1], NEW, speedup=3, lossless=True, ignore_eos=True)
            b = stepper.add(PROMPTS[1:], NEW, speedup=2, ignore_eos=True)
            while not stepper.done:
                stepper.step()
        assert a.error is None and b.error is None
        assert a.result.token_ids == full.token_ids[:1]
        assert b.result.token_ids == plain_alone.token_ids
        assert a.result.stats.verify_passes > 0
    finally:
        mixed.close()


class LayerClock:
    """The engine's clock, advanced by the layers each decode step or verify pass of ``backend`` runs:
    what drafting is weighed with becomes layer counts (a draft step of n layers costs n / L full
    steps, a pass one), the same on every machine and under any load. ``draft_layer``: what a layer
    of a step of drafts costs (a quantized copy's: less than one)."""

    def __init__(self, backend, monkeypatch, draft_layer: float = 1.0):
        import runtime.engine.runner

        self.now = 0.0
        decode, verify = backend.decode, backend.verify

        def counted_decode(step, cache):
            self.now += len(step.layers) * (draft_layer if step.draft else 1.0)
            return decode(step, cache)

        def counted_verify(check, cache):
            self.now += check.depth
            return verify(check, cache)

        monkeypatch.setattr(backend, "decode", counted_decode)
        monkeypatch.setattr(backend, "verify", counted_verify)
        monkeypatch.setattr(runtime.engine.runner, "time", self)

    def perf_counter(self) -> float:
        self.now += 1e-6  # a prefill chunk takes a little time too
        return self.now


def test_rows_that_draft_badly_pause_at_full_depth(gen, full, monkeypatch):
    """On a random model a 5x draft is mostly wrong: once no number of drafts pays (runtime.lossless),
    a row decodes at plain full depth for a while, then tries one draft again, pausing twice as long
    each time it still does not pay. (Costs as layer counts: on the clock, a busy machine's noise
    decided whether a pass kept one draft in two paid: 7 passes once under pytest -n 8.)"""
    LayerClock(gen.backend, monkeypatch)
    result = gen.generate(PROMPTS[0], 48, speedup=5, lossless=True, ignore_eos=True)
    want = gen.generate(PROMPTS[0], 48, ignore_eos=True)
    assert result.token_ids == want.token_ids
    s = result.stats
    assert s.accepted_tokens < s.drafted_tokens / 4  # mostly rejected
    assert s.verify_passes <= 3  # the first pass, then one draft after each pause (16, then 32 tokens)
    full_steps = [len(step.layers) == gen.num_layers for step in s.steps]
    assert sum(full_steps) >= 47 - s.drafted_tokens - s.verify_passes and all(full_steps[-8:])
    assert s.decode_tokens == 47


def test_torch_backend_and_its_static_steps(artifact_dir, full):
    """The torch backend, its decode steps and verify passes run as the static steps CUDA graphs
    capture (EagerCapture on the CPU): the same tokens."""
    t = runtime.load(artifact_dir, backend="torch", max_batch=4, check_hashes=False)
    try:
        t.backend.use_graphs(EagerCapture())
        result = t.generate(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True)
        assert result.token_ids == full.token_ids
        assert any(key.tokens for key in t.backend.graphs.steps), "no verify pass ran as a static pass"
    finally:
        t.close()


class SlowCapture(EagerCapture):
    """Captures that take 0.3 s, as a CUDA graph's warm-up runs and capture can."""

    def __call__(self, fn):
        time.sleep(0.3)
        return fn


def test_what_captures_take_is_not_a_steps_cost(artifact_dir, full):
    """Lossless rows weigh drafting against a full-depth step's and a verify pass's measured times;
    what a call spent capturing a graph (the first of each shape) is not part of them, or a capture
    would make drafting look like a loss for tens of passes. The captures' time is still the
    requests'."""
    t = runtime.load(artifact_dir, backend="torch", max_batch=4, check_hashes=False)
    try:
        t.backend.use_graphs(SlowCapture())
        result = t.generate(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True)
        assert result.token_ids == full.token_ids
        captures = t.backend.graphs.captures
        assert result.stats.verify_passes > 0 and captures >= 3
        e = t.engine
        costs = [e.timings.step, e.timings.full, e.timings.draft, e.timings.verify]
        assert None not in costs and max(costs) < 0.1, costs
        assert result.stats.decode_seconds > 0.3 * captures
        assert t.backend.setup_seconds() >= 0.3 * captures
    finally:
        t.close()


class BothWays:
    """A torch backend's ``verify`` that runs every pass twice on the same cache state, eagerly
    (``run_verify``) and as its static pass, and checks that the static one gives the eager logits
    and K/V at every position a verified row writes, and leaves every other K/V as it was."""

    def __init__(self, backend):
        self.backend, self.static = backend, backend.verify
        self.passes = []  # (rows' lengths, tokens, capacity) of each pass compared
        backend.verify = self

    def __call__(self, check, cache):
        storage = self.backend.storage
        buffers = [*storage.keys, *storage.values]
        before = [b.clone() for b in buffers]
        want = run_verify(self.backend, check, cache)
        eager = [b.clone() for b in buffers]
        for b, old in zip(buffers, before):
            b.copy_(old)
        got = self.static(check, cache)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        T = check.input_ids.shape[1]
        written = torch.zeros(storage.rows, storage.capacity, dtype=torch.bool)  # (rows, C)
        for r in np.flatnonzero(check.updates):
            new = check.attention_mask[r, -T:].astype(bool)
            written[r, cache.length[r] + np.flatnonzero(new)] = True
        for k, (b, old, ref) in enumerate(zip(buffers, before, eager)):
            at = written[:, None, None, :] if k < len(storage.keys) else written[:, None, :, None]
            at = at.to(b.device).expand_as(b)
            torch.testing.assert_close(b[at], ref[at], rtol=0, atol=1e-5)
            assert torch.equal(b[~at], old[~at]), "the static pass wrote where the eager one does not"
        self.passes.append((cache.length[: check.rows].copy(), T, storage.capacity))
        return got


def ride_along_at_the_capacity(gen, full, monkeypatch):
    """A plain row decoding to the KV capacity (64) while a lossless row's verify passes run: it
    rides along them, writes nothing, and both give their tokens. A pass places every row's new
    positions, so its tokens stop at the capacity for the riding row (the drafts past it are
    dropped). When the lossless row starts is swept, so that some pass's drafts reach past the
    capacity for the riding row (costs as layer counts: the same passes on every machine)."""
    verify, drafted, overflows = gen.backend.verify, [], []
    plan_verify = gen.engine.scheduler._verify_plan

    def counting(seqs, ready):  # the tokens the pass would have had for its drafts
        drafted.append(1 + max(len(s.drafts) for s in ready))
        return plan_verify(seqs, ready)

    def recording(check, cache):  # whether a riding row's length + the pass's drafts pass the capacity
        riding = int(cache.length[: check.rows][~check.updates].max(initial=0))
        assert riding + check.input_ids.shape[1] <= cache.capacity
        overflows.append(riding + drafted[-1] > cache.capacity)
        return verify(check, cache)

    monkeypatch.setattr(gen.engine.scheduler, "_verify_plan", counting)
    monkeypatch.setattr(gen.backend, "verify", recording)
    LayerClock(gen.backend, monkeypatch)
    want = None
    for at in [None, *range(52, 60)]:  # None: the plain row alone
        with gen.stepper() as stepper:
            plain = stepper.add(PROMPTS[2:], 61, ignore_eos=True)  # 3 prompt tokens: to the capacity
            for _ in range(at or 0):
                stepper.step()
            if at is not None:
                lossless = stepper.add(PROMPTS[:1], 8, speedup=2, lossless=True, ignore_eos=True)
            while not stepper.done:
                stepper.step()
        assert plain.error is None, plain.error
        want = want or plain.result.token_ids
        assert plain.result.token_ids == want
        if at is not None:
            assert lossless.result.token_ids == [full.token_ids[0][:8]]
    assert any(overflows), "no verify pass had drafts past the capacity for a riding row"


def test_a_plain_row_at_the_capacity_rides_along_a_verify_pass(artifact_dir, full, monkeypatch):
    """A verify pass beside a row riding along 2 positions short of the capacity failed with 'rows
    would hold 65 positions, past the KV capacity 64' when it made room for every row, then (with
    room for the verified rows only) failed the fused graphs' inputs."""
    g = runtime.load(artifact_dir, max_batch=4, max_length=64, check_hashes=False)
    try:
        ride_along_at_the_capacity(g, full, monkeypatch)
    finally:
        g.close()


LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 2)  # 25 tokens: near a page's end


def mixed_rows_across_a_page(g, monkeypatch):
    """Plain rows of different lengths (25 and 6 prompt tokens) decode past the first page's end
    (32) while lossless rows with short prompts join at each step of a sweep: their verify passes
    carry the plain rows along, one of them longer than every verified row and within the pass's
    tokens of the page's end. Every row gives what it gives alone (a pass reserved room for the
    verified rows only, and the fused graphs' inputs, which place every row's new positions,
    failed the whole batch with 'index 32 is out of bounds for axis 1 with size 32')."""
    verify, passes = g.backend.verify, []

    def recording(check, cache):  # (the longest riding row, the longest verified one, tokens)
        lengths = cache.length[: check.rows]
        passes.append((int(lengths[~check.updates].max(initial=0)), int(lengths[check.updates].max()),
                       check.input_ids.shape[1]))
        return verify(check, cache)

    monkeypatch.setattr(g.backend, "verify", recording)
    LayerClock(g.backend, monkeypatch)
    plain_prompts, lossless_prompts = [LONG_PROMPT, PROMPTS[1]], [PROMPTS[2], PROMPTS[0]]
    want_plain = stepped(g, plain_prompts, 20, speedup=2, ignore_eos=True)
    want_lossless = stepped(g, lossless_prompts, 10, ignore_eos=True)  # full depth's
    for at in range(12):
        with g.stepper() as stepper:
            plain = stepper.add(plain_prompts, 20, speedup=2, ignore_eos=True)
            for _ in range(at):
                stepper.step()
            lossless = stepper.add(lossless_prompts, 10, speedup=2, lossless=True, ignore_eos=True)
            while not stepper.done:
                stepper.step()
        assert (plain.error, lossless.error) == (None, None), f"joined at step {at}"
        assert plain.result.token_ids == want_plain, f"joined at step {at}"
        assert lossless.result.token_ids == want_lossless, f"joined at step {at}"
    page = 32
    crossing = [(r, v, T) for r, v, T in passes if r > v and r < page < r + T and v + T <= page]
    assert crossing, f"no pass carried a longer row within its tokens of the page's end: {passes}"


@pytest.fixture(scope="module")
def fused_artifact(tmp_path_factory):
    """A Llama 3 artifact with fused layer graphs (GroupQueryAttention's CPU kernel needs head_dim 16)."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("fused-ckpt"), "llama3", hidden_size=64)
    out = tmp_path_factory.mktemp("fused-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False), log=lambda *_: None)
    return out


@pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True)  # one OPT variant: the paths are the sweep
@pytest.mark.parametrize("path", ["plain", "fused", "fused-llama-plain", "iobinding", "torch", "torch-static",
                                  "tensorrt"])
def test_mixed_rows_across_a_page_on_every_path(artifact_dir, fused_artifact, tmp_path, fake_gpu, monkeypatch,
                                                 path):
    if path == "tensorrt":
        from tests.runtime.test_tensorrt_backend import build as build_engines
        from tests.runtime.test_tensorrt_backend import load as load_engines

        fake_gpu()
        g = load_engines(artifact_dir, build_engines(artifact_dir, tmp_path), check_hashes=False)
    else:
        artifact = fused_artifact if path.startswith("fused") else artifact_dir
        kwargs = {"plain": {}, "fused": {"fused": True}, "fused-llama-plain": {"fused": False},
                  "iobinding": {"device": "cpu"}, "torch": {"backend": "torch"},
                  "torch-static": {"backend": "torch"}}[path]
        g = runtime.load(artifact, max_batch=4, check_hashes=False, **kwargs)
    try:
        if path == "torch-static":
            g.backend.use_graphs(EagerCapture())
        mixed_rows_across_a_page(g, monkeypatch)
    finally:
        g.close()


def test_a_riding_row_at_the_capacity_on_the_fused_graphs(fused_artifact, monkeypatch):
    """The fused graphs' inputs place a riding row's new positions too: near the capacity, inside it."""
    with runtime.load(fused_artifact, max_batch=4, check_hashes=False) as reference:
        full = reference.generate(PROMPTS, NEW, ignore_eos=True)
    g = runtime.load(fused_artifact, max_batch=4, max_length=64, fused=True, check_hashes=False)
    try:
        ride_along_at_the_capacity(g, full, monkeypatch)
    finally:
        g.close()


def static_verify_is_the_eager_pass(artifact, device, monkeypatch):
    """Each verify pass, run as the static pass (a CUDA graph on a GPU, EagerCapture on the CPU)
    and eagerly on the same cache, gives the same logits and K/V: for rows with fewer drafts than
    others (padded tokens), for a plain row riding along near the KV capacity (its padded
    positions lie past the capacity, and the pass must not write there), in a batch of lossless
    rows; and the tokens stay full depth's (ONNX Runtime's)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to PyTorch on this machine; CUDA graphs are captured only on a GPU")
    with runtime.load(artifact, max_batch=4, check_hashes=False) as reference:
        full = reference.generate(PROMPTS, NEW, ignore_eos=True)
    t = runtime.load(artifact, backend="torch", device=device, max_batch=4, max_length=64, check_hashes=False)
    try:
        if device == "cpu":
            t.backend.use_graphs(EagerCapture())
        both = BothWays(t.backend)
        with t.stepper() as stepper:
            batch = stepper.add(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True)
            while not stepper.done:
                stepper.step()
        assert batch.result.token_ids == full.token_ids
        ride_along_at_the_capacity(t, full, monkeypatch)
        past_capacity = [lengths.max() + tokens_bucket(T) > capacity for lengths, T, capacity in both.passes]
        assert any(past_capacity), f"no pass rode a row along near the capacity: {both.passes}"
        assert any(T > 2 for _, T, _ in both.passes), "no pass verified more than one draft"
        # the passes' graphs of one batch and token bucket share their logits, whatever their width
        passes = [(key, step) for key, (step, _) in t.backend.graphs.steps.items() if key.tokens]
        assert passes and all(step.logits is t.backend.pass_logits[key.batch, key.tokens] for key, step in passes)
    finally:
        t.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_static_verify_pass_is_the_eager_pass(artifact_dir, device, monkeypatch):
    static_verify_is_the_eager_pass(artifact_dir, device, monkeypatch)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_static_verify_pass_llama_family(llama_artifact, device, monkeypatch):
    """Llama 3 and Qwen3 (grouped KV heads, RoPE, Qwen3's q/k norms) over T tokens."""
    static_verify_is_the_eager_pass(llama_artifact, device, monkeypatch)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="no CUDA device visible to PyTorch on this machine; CUDA graphs are captured only on a GPU")
def test_torch_backend_on_cuda(artifact_dir):
    """On a GPU: drafts and verify passes as captured CUDA graphs over the same device K/V rows;
    greedy lossless gives the CUDA full depth's tokens."""
    g = runtime.load(artifact_dir, backend="torch", device="cuda", max_batch=4, check_hashes=False)
    try:
        want = g.generate(PROMPTS, NEW, ignore_eos=True)
        for speedup in (2, 5):
            got = g.generate(PROMPTS, NEW, speedup=speedup, lossless=True, ignore_eos=True)
            assert got.token_ids == want.token_ids and got.stats.verify_passes > 0
        assert any(key.tokens for key in g.backend.graphs.steps), "no verify pass was captured"
    finally:
        g.close()


def test_iobinding_storage(artifact_dir, full):
    io = runtime.load(artifact_dir, device="cpu", max_batch=4, check_hashes=False)  # IOBinding storage
    try:
        assert io.generate(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True).token_ids == full.token_ids
    finally:
        io.close()


def test_tensorrt_engines_whose_profile_takes_few_tokens(artifact_dir, tmp_path, fake_gpu, full):
    """Engines built for at most 4 tokens a call (max_prompt): a verify pass is one call of drafts + 1
    tokens, so a row drafts at most 3; the tokens are full depth's (the fake TensorRT of
    tests/engines/fakes.py)."""
    from tests.runtime.test_tensorrt_backend import build as build_engines
    from tests.runtime.test_tensorrt_backend import load as load_engines

    fake_gpu()
    trt = load_engines(artifact_dir, build_engines(artifact_dir, tmp_path, max_prompt=4))
    try:
        assert trt.backend.max_tokens() == 4
        result = trt.generate(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True)
        assert result.token_ids == full.token_ids
        assert result.stats.tokens_per_verify <= 4 and result.stats.verify_passes > 0
    finally:
        trt.close()


@pytest.mark.parametrize("speedup", [2, 5])
def test_llama_family_fused_layers(llama_artifact, speedup):
    g = runtime.load(llama_artifact, max_batch=4, check_hashes=False)
    try:
        want = g.generate(PROMPTS, NEW, ignore_eos=True)
        got = g.generate(PROMPTS, NEW, speedup=speedup, lossless=True, ignore_eos=True)
        assert got.token_ids == want.token_ids
        assert got.stats.verify_passes > 0
    finally:
        g.close()


@pytest.fixture(scope="module")
def draft_head_artifact(tmp_path_factory):
    """A Llama 3 artifact with an int4 draft head (export --draft-head): drafts read it, passes the head."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("draft-head-ckpt"), "llama3", hidden_size=64)
    out = tmp_path_factory.mktemp("draft-head-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, draft_head="int4", block_size=16),
          log=lambda *_: None)
    return out


@pytest.mark.parametrize("speedup", [2, 5])
def test_drafts_read_the_draft_head_and_tokens_stay_full_depths(draft_head_artifact, speedup):
    g = runtime.load(draft_head_artifact, max_batch=4, check_hashes=False)
    try:
        want = g.generate(PROMPTS, NEW, ignore_eos=True)
        reads, head = [], g.backend.draft_head
        g.backend.draft_head = lambda hidden: reads.append(len(hidden)) or head(hidden)
        got = g.generate(PROMPTS, NEW, speedup=speedup, lossless=True, ignore_eos=True)
        assert got.token_ids == want.token_ids
        assert reads and got.stats.verify_passes > 0  # draft steps read it; the passes decided
        drafted = len(reads)
        g.generate(PROMPTS, NEW, speedup=speedup, ignore_eos=True)
        assert len(reads) == drafted  # a plain (lossy) row's steps read the head
    finally:
        g.close()


@pytest.fixture(scope="module")
def trained_gen(checkpoint_dir, tmp_path_factory):
    """The tiny checkpoint as if fine-tuned under SkipDecode: its skipdecode.json's horizon (47
    steps) is the manifest's, as tools.finetune's output makes it."""
    ckpt = tmp_path_factory.mktemp("trained-ckpt") / "ckpt"
    shutil.copytree(checkpoint_dir, ckpt)
    (ckpt / "skipdecode.json").write_text(json.dumps({"format": "skipdecode-finetune", "horizon": 47,
                                                      "warmup_layers": 1, "speedups": [1.0, 2.0]}))
    out = tmp_path_factory.mktemp("trained-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False), log=lambda *_: None)
    g = runtime.load(out, max_batch=4, check_hashes=False)
    yield g
    g.close()


def _draft_sets(g, result, policy):
    drafts = [s for s in result.stats.steps if len(s.layers) < g.num_layers]
    smallest = policy.active_layers(policy.horizon)
    return drafts, smallest, [s for s in drafts if s.layers != smallest]


def test_a_trained_models_rows_draft_at_their_own_set_before_pausing(trained_gen, monkeypatch):
    """A row drafts first at its policy's smallest set; when that does not pay, a model fine-tuned
    under the policy drafts at the row's own decaying set (what it ran at that step in training),
    and only when that does not pay either does the row pause."""
    g = trained_gen
    LayerClock(g.backend, monkeypatch)
    result = g.generate(PROMPTS[0], 48, speedup=2, lossless=True, ignore_eos=True)
    assert result.token_ids == g.generate(PROMPTS[0], 48, ignore_eos=True).token_ids
    policy = g.policy_for(48, speedup=2)
    assert policy.horizon == 47 and policy.active_layers(0) != policy.active_layers(47)
    drafts, smallest, own = _draft_sets(g, result, policy)
    assert drafts[0].layers == smallest  # the first pass's drafts
    assert own and all(s.layers == policy.active_layers(s.step) for s in own)  # then each step's own


def test_an_untuned_models_rows_pause_without_the_own_set_trial(gen, monkeypatch):
    LayerClock(gen.backend, monkeypatch)
    result = gen.generate(PROMPTS[0], 48, speedup=2, lossless=True, ignore_eos=True)
    drafts, smallest, own = _draft_sets(gen, result, gen.policy_for(48, speedup=2))
    assert drafts and not own  # its own set drafts no better than its smallest: it pauses instead


def test_prefill_policy_is_refused(gen):
    with pytest.raises(InvalidArgumentError, match="prefill='policy' leaves the layers outside step 0's set"):
        gen.generate(PROMPTS[0], 4, speedup=2, lossless=True, prefill="policy")
    with pytest.raises(InvalidArgumentError, match="lossless must be True or False, got 1"):
        gen.generate(PROMPTS[0], 4, lossless=1)


# -- sampling: full depth's distribution ----------------------------------------------------------


def test_verify_draft_keeps_the_target_distribution():
    """Speculative sampling's rule: whatever q the draft came from, the token is distributed as p."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6) * 0.3)
    q[2] = 0.0
    q /= q.sum()
    n = 60000
    drafts = rng.choice(6, size=n, p=q)
    tokens = np.array([verify_draft(p, int(d), q, rng) for d in drafts])
    seen = np.bincount(tokens, minlength=6) / n
    assert np.abs(seen - p).sum() / 2 < 0.01  # total variation; ~0.003 expected at this n


def test_sampled_lossless_rows_follow_full_depth(gen):
    """The second and third tokens of many seeds, sampled with top_k=3 so that few tokens carry the
    mass: lossless at 3x and plain full depth give the same distribution (total variation within
    what 400 draws each allow), and a seed repeats its tokens."""
    options = dict(do_sample=True, top_k=3, temperature=1.5, ignore_eos=True)
    seeds = range(400)
    ours = [tuple(gen.generate(PROMPTS[2], 3, seed=s, speedup=3, lossless=True, **options).token_ids[0][1:])
            for s in seeds]
    theirs = [tuple(gen.generate(PROMPTS[2], 3, seed=s + 10_000, **options).token_ids[0][1:]) for s in seeds]
    for position in (0, 1):
        a = np.array([t[position] for t in ours])
        b = np.array([t[position] for t in theirs])
        support = np.union1d(a, b)
        pa = np.array([(a == v).mean() for v in support])
        pb = np.array([(b == v).mean() for v in support])
        assert np.abs(pa - pb).sum() / 2 < 0.12, (position, dict(zip(support.tolist(), zip(pa, pb))))
    again = gen.generate(PROMPTS[2], 3, seed=7, speedup=3, lossless=True, **options).token_ids[0][1:]
    assert tuple(again) == ours[7]


@pytest.fixture(scope="module")
def draft_layers_artifact(tmp_path_factory):
    """A Llama 3 artifact whose fused layers have int8 copies (export --draft-layers) and an int8 head copy."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("draft-layers-ckpt"), "llama3", hidden_size=64,
                                intermediate_size=96, head_dim=16)
    out = tmp_path_factory.mktemp("draft-layers-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, draft_head="int8", draft_layers="int8"),
          log=lambda *_: None)
    return out


def test_drafts_at_full_depth_on_the_quantized_copies_pay(draft_layers_artifact, monkeypatch):
    """At speedup 1 a lossless row drafts through every layer's quantized copy (a GGUF's own int4
    blocks for a float export of it: export.gguf_blocks), which agrees with the float layers nearly
    always. Its draft steps run every layer, and must be weighed as the drafts they are, not as
    full-depth steps: a clock where a draft step costs a quarter of a full one lets the row's k grow
    past its first passes (weighed as full steps, drafts never paid and the rows paused)."""
    g = runtime.load(draft_layers_artifact, max_batch=4, check_hashes=False)
    try:
        LayerClock(g.backend, monkeypatch, draft_layer=0.25)
        want = g.generate(PROMPTS[:2], 40, ignore_eos=True)  # (and the engine's full-depth step timed)
        got = g.generate(PROMPTS[:2], 40, speedup=1, lossless=True, ignore_eos=True)
        assert got.token_ids == want.token_ids
        stats = got.stats
        assert stats.drafted_tokens >= 0.8 * 2 * 40 and stats.accepted_tokens >= 0.8 * stats.drafted_tokens
        assert stats.tokens_per_verify > 4, stats.tokens_per_verify  # k grew: the drafts paid
    finally:
        g.close()
