import contextlib

import numpy as np
import pytest
import torch

import runtime
from runtime.backends.base import run_decode, run_layers
from runtime.models.opt import SkipOPT
from runtime.errors import InputTooLongError, PolicyError
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS

LOGIT_ATOL = 1e-4  # fp32 ONNX Runtime vs transformers' OPT, every step of a greedy generation
NEW = 12


def hf_generate(hf_model, tokenizer, prompts, max_new_tokens=NEW):
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=1,
                                eos_token_id=2, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, enc["input_ids"].shape[1]:].tolist()
    return tokens, out.logits


def padded(rows, length, pad=1):
    return [r + [pad] * (length - len(r)) for r in rows]


def assert_same_steps(ours, theirs, new, atol, **options):
    """Streaming PROMPTS, both generators give the same tokens, and fp32 logits within ``atol``, every step."""
    a_steps = list(ours.stream(PROMPTS, new, ignore_eos=True, **options))
    b_steps = list(theirs.stream(PROMPTS, new, ignore_eos=True, **options))
    assert len(a_steps) == len(b_steps) == new
    for step, (a, b) in enumerate(zip(a_steps, b_steps)):
        assert a.logits.dtype == np.float32
        np.testing.assert_allclose(a.logits, b.logits, atol=atol, rtol=0, err_msg=f"step {step}")
        assert a.token_ids == b.token_ids


def test_full_depth_batch_equals_transformers(generator, hf_model, tokenizer):
    expected, _ = hf_generate(hf_model, tokenizer, PROMPTS)
    result = generator.generate(PROMPTS, NEW)
    assert padded(result.token_ids, NEW) == expected
    assert result.texts == [tokenizer.decode(t, skip_special_tokens=True) for t in result.token_ids]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_full_depth_single_prompt_equals_transformers(generator, hf_model, tokenizer, prompt):
    expected, _ = hf_generate(hf_model, tokenizer, [prompt])
    assert padded(generator.generate(prompt, NEW).token_ids, NEW) == expected


def test_full_depth_logits_every_step(generator, hf_model, tokenizer):
    expected, hf_logits = hf_generate(hf_model, tokenizer, PROMPTS)
    stream = generator.stream(PROMPTS, NEW)
    ours = [event.logits for event in stream]
    assert len(ours) == len(hf_logits)
    for step, (a, b) in enumerate(zip(ours, hf_logits)):
        np.testing.assert_allclose(a, b.numpy(), atol=LOGIT_ATOL, rtol=0, err_msg=f"step {step}")


def test_one_row_streams_its_logits_every_step(generator, hf_model, tokenizer):
    # a request of one row streams its row of the step's logits as it is (no copy): still each
    # step's own, (1, V) float32, and the consumer's to keep
    _, hf_logits = hf_generate(hf_model, tokenizer, PROMPTS[:1])
    ours = [event.logits for event in generator.stream(PROMPTS[0], NEW)]
    assert len(ours) == len(hf_logits)
    for step, (a, b) in enumerate(zip(ours, hf_logits)):
        assert a.shape == (1, b.shape[-1]) and a.dtype == np.float32
        np.testing.assert_allclose(a, b.numpy(), atol=LOGIT_ATOL, rtol=0, err_msg=f"step {step}")


class SpyBackend:
    """Records what the decode loop asks of the real backend: the calls, each decode step's
    per-layer updates, and the rows and past width every layer call binds."""

    def __init__(self, inner):
        self.inner, self.calls, self.updates, self.bound = inner, [], [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def embed(self, ids, mask):
        self.calls.append("embed")
        return self.inner.embed(ids, mask)

    def layer(self, index, hidden, mask, past_key, past_value):
        self.calls.append(index)
        self.bound.append((index, *mask.shape))  # (layer, rows, past width + new tokens)
        return self.inner.layer(index, hidden, mask, past_key, past_value)

    def run_layers(self, cache, start, count, hidden, mask, layers, updates=None, draft=False):
        if getattr(self.inner, "fused", False):  # its graphs write the cache: the layers are one call
            for index in layers:
                self.calls.append(index)
                self.bound.append((index, *mask.shape))
            return self.inner.run_layers(cache, start, count, hidden, mask, layers, updates, draft)
        return run_layers(self, cache, start, count, hidden, mask, layers, updates)  # each through self.layer

    def head(self, hidden, rows=None):
        self.calls.append("head")
        return self.inner.head(hidden, rows)

    def decode(self, step, cache):  # the default step, so that the spy sees its embed, layers and head
        self.updates += [(i, u.copy()) for i, u in zip(step.layers, step.updates)]
        return run_decode(self, step, cache)


@contextlib.contextmanager
def spying(generator):
    """Put a SpyBackend between ``generator`` and its backend for the duration."""
    real = generator.engine.backend
    generator.engine.backend = SpyBackend(real)
    try:
        yield generator.engine.backend
    finally:
        generator.engine.backend = real


@pytest.fixture
def spy(generator):
    with spying(generator) as spy_backend:
        yield spy_backend


def policy_calls(num_layers: int, policy, new_tokens: int) -> list:
    """The graph calls of a run under ``policy``: the prompt runs every layer; then each step is
    embed, exactly its active set, head."""
    calls = ["embed", *range(num_layers), "head"]
    for g in range(new_tokens - 1):
        calls += ["embed", *policy.active_layers(g), "head"]
    return calls


@pytest.mark.parametrize("max_layers, min_layers, warmup", [(5, 2, 1), (4, 4, 2), (3, 1, 1), (6, 6, 0)])
def test_skip_policy_matches_reference_and_runs_only_active_layers(generator, hf_model, tokenizer, spy,
                                                                   max_layers, min_layers, warmup):
    L = generator.num_layers
    policy = SkipPolicy(L, max_layers, min_layers, warmup_layers=warmup, horizon=NEW - 1)
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    expected = SkipOPT(hf_model).greedy(enc["input_ids"], enc["attention_mask"], NEW, policy, eos_token_id=2)
    result = generator.generate(PROMPTS, NEW, policy=policy)
    assert padded(result.token_ids, expected.tokens.shape[1]) == expected.tokens.tolist()

    assert spy.calls == policy_calls(L, policy, result.stats.new_tokens)
    assert [s.layers for s in result.stats.steps] == [policy.active_layers(g) for g in range(len(result.stats.steps))]


@pytest.mark.parametrize("shape", [{"decay": "power", "exponent": 2.0}, {"prefill": "policy"},
                                   {"decay": "power", "exponent": 0.5, "prefill": "policy"}])
def test_policy_shape_matches_reference_tokens_and_logits(generator, hf_model, tokenizer, spy, shape):
    L = generator.num_layers
    policy = SkipPolicy(L, 5, 2, warmup_layers=1, horizon=NEW - 1, **shape)
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    expected = SkipOPT(hf_model).greedy(enc["input_ids"], enc["attention_mask"], NEW, policy, eos_token_id=2)
    with generator.stream(PROMPTS, NEW, policy=policy) as stream:
        logits = [event.logits for event in stream]
    result = stream.result
    assert padded(result.token_ids, expected.tokens.shape[1]) == expected.tokens.tolist()
    for step, (ours, ref) in enumerate(zip(logits, expected.step_logits)):
        np.testing.assert_allclose(ours, ref.numpy(), atol=LOGIT_ATOL, rtol=0, err_msg=f"step {step}")
    # the prompt runs its prefill layers only (step 0's set under prefill="policy")
    want = ["embed", *policy.prefill_layers(), "head"]
    for g in range(result.stats.new_tokens - 1):
        want += ["embed", *policy.active_layers(g), "head"]
    assert spy.calls == want
    assert policy.prefill_layers() == (tuple(range(L)) if policy.prefill == "full" else (0, L - 4, L - 3, L - 2, L - 1))


def test_generate_shape_options_choose_the_policy(generator):
    L = generator.num_layers
    result = generator.generate(PROMPTS[0], 16, speedup=2, decay="power", exponent=3.0, prefill="policy")
    assert result.policy == SkipPolicy.for_speedup(L, 2, horizon=15, decay="power", exponent=3.0,
                                                   prefill="policy")
    mine = generator.policy_for(16, {"max_layers": 4, "min_layers": 2}, prefill="policy")
    assert (mine.max_layers, mine.prefill, mine.decay) == (4, "policy", "linear")
    with pytest.raises(PolicyError, match="decay must be one of linear, power, got 'cubic'"):
        generator.generate(PROMPTS[0], 4, speedup=2, decay="cubic")
    with pytest.raises(PolicyError, match="conflict with the SkipPolicy passed"):
        generator.generate(PROMPTS[0], 4, policy=SkipPolicy(L, 4, 2), prefill="policy")


def test_stats_report_budgets_and_speedup(generator):
    result = generator.generate(PROMPTS, 16, speedup=2, ignore_eos=True)
    stats, policy = result.stats, result.policy
    assert stats.new_tokens == 16 and len(stats.steps) == 15
    assert stats.layers_per_step == [policy.budget(g) for g in range(15)]
    assert stats.layer_reduction == pytest.approx(policy.theoretical_speedup(15))
    assert stats.achieved_layer_ratio == pytest.approx(stats.layer_reduction)
    assert 1.7 < stats.layer_reduction < 2.3
    assert stats.steps[0].theoretical_ratio == generator.num_layers / policy.max_layers
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert stats.to_dict()["layers_per_step"] == stats.layers_per_step


def test_streaming_yields_every_token(generator):
    events = []
    result = generator.generate(PROMPTS, NEW, streamer=events.append, ignore_eos=True)
    assert len(events) == NEW
    for b in range(len(PROMPTS)):
        assert [e.token_ids[b] for e in events] == result.token_ids[b]
        assert "".join(e.texts[b] for e in events) == result.texts[b]
    stream = generator.stream(PROMPTS[0], 4)
    assert [len(e.token_ids) for e in stream] == [1] * stream.result.stats.new_tokens


def test_generate_without_a_streamer_wakes_its_caller_only_for_the_result(generator, monkeypatch):
    """A caller that reads no events is not sent one per step (each woke it on the engine's
    thread: on a busy engine that slowed every step); its result is the streamed one."""
    import queue

    class Recorded(queue.Queue):
        def put(self, item, *args, **kwargs):
            self.seen.append(item)
            super().put(item, *args, **kwargs)

    queues = []
    submit = generator.engine.submit

    def recording(request, *args, **kwargs):
        request.events = Recorded()
        request.events.seen = []
        queues.append(request.events)
        submit(request, *args, **kwargs)

    monkeypatch.setattr(generator.engine, "submit", recording)
    quiet = generator.generate(PROMPTS, NEW, ignore_eos=True)
    events = []
    streamed = generator.generate(PROMPTS, NEW, ignore_eos=True, streamer=events.append)
    assert quiet.token_ids == streamed.token_ids and quiet.texts == streamed.texts
    assert [type(x).__name__ for x in queues[0].seen] == ["GenerationResult", "object"]  # result, DONE
    assert len(queues[1].seen) == NEW + 2 and len(events) == NEW


def test_eos_finishes_a_row_while_others_continue(generator):
    full = generator.generate(PROMPTS, NEW, ignore_eos=True)
    eos = full.token_ids[0][2]
    stopped = generator.generate(PROMPTS, NEW, eos_token_id=eos)
    row0 = stopped.token_ids[0]
    assert row0 == full.token_ids[0][: full.token_ids[0].index(eos) + 1]
    for b in range(1, len(PROMPTS)):
        expect = full.token_ids[b]
        if eos in expect:
            expect = expect[: expect.index(eos) + 1]
        assert stopped.token_ids[b] == expect


def test_stop_strings_end_the_row_at_the_token_that_completes_them(generator):
    full = generator.generate(PROMPTS[0], NEW, ignore_eos=True)
    stop = full.texts[0][3:5]
    result = generator.generate(PROMPTS[0], NEW, ignore_eos=True, stop_strings=[stop])
    ids = result.token_ids[0]
    assert ids == full.token_ids[0][: len(ids)] and len(ids) < NEW
    # as transformers: the text is the tokens' text, stop string included, up to the token's end
    assert result.texts[0] == generator.tokenizer.decode(ids, skip_special_tokens=True)
    assert stop in result.texts[0] and stop not in generator.tokenizer.decode(ids[:-1], skip_special_tokens=True)


def test_sampling_is_seeded_and_top_k_1_is_greedy(generator):
    kw = dict(do_sample=True, temperature=1.5, top_p=0.9, ignore_eos=True)
    a = generator.generate(PROMPTS, NEW, seed=7, **kw)
    b = generator.generate(PROMPTS, NEW, seed=7, **kw)
    assert a.token_ids == b.token_ids
    greedy = generator.generate(PROMPTS, NEW, ignore_eos=True)
    assert generator.generate(PROMPTS, NEW, do_sample=True, top_k=1, seed=1, ignore_eos=True).token_ids == greedy.token_ids


def test_prompt_over_the_limit(generator):
    prompt = "Hello, my name is"
    n = len(generator.tokenizer(prompt).input_ids)
    with pytest.raises(InputTooLongError) as info:
        generator.generate(prompt, 64)
    assert str(info.value) == (
        f"prompt of {n} tokens + max_new_tokens 64 = {n + 64} exceeds max_length 64 of this "
        f"Generator (the model's max_position_embeddings is 64); lower max_new_tokens to at most {64 - n}")
    assert generator.generate(prompt, 64 - n).stats.new_tokens <= 64 - n


def test_impossible_policies(generator):
    L = generator.num_layers
    with pytest.raises(PolicyError, match=f"max_layers \\({L + 1}\\) must be <= num_layers \\({L}\\)"):
        generator.generate("Hi", 4, policy={"max_layers": L + 1, "min_layers": 2})
    with pytest.raises(PolicyError, match="pass either policy= or speedup=, not both"):
        generator.generate("Hi", 4, speedup=2, policy={"max_layers": 4, "min_layers": 2})
    with pytest.raises(PolicyError, match=f"speedup {L + 1} is out of range for {L} layers"):
        generator.generate("Hi", 4, speedup=L + 1)
    with pytest.raises(PolicyError, match=f"policy is for 24 layers but the model has {L}"):
        generator.generate("Hi", 4, policy=SkipPolicy(24, 16, 8))


def test_bad_arguments(generator):
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        generator.generate("Hi", 0)
    with pytest.raises(ValueError, match="prompts must be a string or a non-empty list of strings"):
        generator.generate([], 4)
    with pytest.raises(ValueError, match="top_p must be a number in \\(0, 1\\] \\(1 disables it\\), got 0"):
        generator.generate("Hi", 4, do_sample=True, top_p=0)


def test_generate_accepts_a_directory(artifact_dir, generator):
    by_dir = runtime.generate(artifact_dir, PROMPTS, max_new_tokens=6, speedup=2, threads=1)
    assert by_dir.token_ids == generator.generate(PROMPTS, 6, speedup=2).token_ids
