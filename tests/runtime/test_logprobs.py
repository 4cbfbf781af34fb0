"""What the server's OpenAI fields rest on: per-token log-probabilities, token-id prompts and the
presence/frequency penalties, in the Python API."""

import numpy as np
import pytest

from runtime.decoding.sampling import SamplingConfig, penalize
from runtime.errors import InvalidArgumentError
from tests.conftest import PROMPTS

NEW = 8


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("sampling", [dict(), dict(do_sample=True, temperature=0.7, top_k=0, seed=3)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_the_log_softmax_of_the_logits_sampled_from(generator, sampling):
    events = []
    result = generator.generate(PROMPTS, NEW, logprobs=3, ignore_eos=True, streamer=events.append, **sampling)
    assert result.token_ids == generator.generate(PROMPTS, NEW, ignore_eos=True, **sampling).token_ids
    for b in range(len(PROMPTS)):
        lps = result.logprobs[b]
        assert [lp.token_id for lp in lps] == result.token_ids[b]
        for event, lp in zip(events, lps):
            assert event.logprobs[b] is lp
            expect = _log_softmax(event.logits[b])
            assert lp.logprob == pytest.approx(expect[lp.token_id], abs=1e-6)
            top3 = np.argsort(-expect)[:3]
            assert [i for i, _ in lp.top] == top3.tolist()
            assert [v for _, v in lp.top] == pytest.approx(expect[top3].tolist(), abs=1e-6)
            if not sampling:  # greedy: the chosen token is the most likely one
                assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    assert generator.generate(PROMPTS[0], 2).logprobs is None  # not asked: not computed
    assert generator.generate(PROMPTS[0], 2, logprobs=0).logprobs[0][0].top == []


def test_token_id_prompts_run_as_their_text(generator):
    ids = [generator.tokenizer(p)["input_ids"] for p in PROMPTS]
    by_text = generator.generate(PROMPTS, NEW, ignore_eos=True)
    by_ids = generator.generate(ids, NEW, ignore_eos=True)
    assert by_ids.token_ids == by_text.token_ids and by_ids.texts == by_text.texts


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2], []], "token-id prompt 1 must be a non-empty list of ints"),
    ([[1, 2.5]], "token-id prompt 0 must be a non-empty list of ints"),
    ([[1, 10 ** 6]], "outside the vocabulary"),
])
def test_bad_token_id_prompts(generator, prompts, message):
    with pytest.raises(InvalidArgumentError, match=message):
        generator.generate(prompts, 2)


def test_penalties_as_openai_defines_them():
    logits = np.zeros(5, np.float32)
    out = penalize(logits, [1, 1, 3], SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [0, -1.0, 0, -0.75, 0]  # 1: 0.5 + 2 * 0.25; 3: 0.5 + 0.25
    with pytest.raises(InvalidArgumentError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        SamplingConfig(presence_penalty=3)


def test_frequency_penalty_breaks_a_greedy_loop(generator):
    plain = generator.generate(PROMPTS[0], 24, ignore_eos=True).token_ids[0]
    penalized = generator.generate(PROMPTS[0], 24, ignore_eos=True, frequency_penalty=2.0,
                                   presence_penalty=2.0, logprobs=0).token_ids[0]
    assert penalized[0] == plain[0]  # nothing generated yet: nothing to penalize
    assert len(set(penalized)) > len(set(plain)), (plain, penalized)
