import numpy as np
import pytest

from runtime.decoding.sampling import SamplingConfig, select
from runtime.errors import SkipDecodeError

LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], dtype=np.float32))


def frequencies(config, n=20000):
    rng = np.random.default_rng(0)
    draws = np.stack([select(LOGITS, config, rng) for _ in range(n // 100) for _ in range(100)])
    return np.stack([np.bincount(draws[:, b], minlength=4) / len(draws) for b in range(2)])


def test_greedy_is_argmax():
    assert select(LOGITS, SamplingConfig(), np.random.default_rng()).tolist() == [0, 3]


def test_sampling_follows_the_distribution():
    freq = frequencies(SamplingConfig(do_sample=True, top_k=0), n=4000)
    np.testing.assert_allclose(freq[0], [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_and_top_p_remove_the_tail():
    freq = frequencies(SamplingConfig(do_sample=True, top_k=2), n=2000)
    assert freq[0][2:].sum() == 0 and freq[1][:2].sum() == 0
    # top_p=0.7: 0.5 alone < 0.7, so keep 0.5 and 0.3; drop the rest
    freq = frequencies(SamplingConfig(do_sample=True, top_k=0, top_p=0.7), n=2000)
    assert freq[0][2:].sum() == 0
    np.testing.assert_allclose(freq[0][:2], [0.625, 0.375], atol=0.05)


@pytest.mark.parametrize("kwargs, message", [
    (dict(do_sample=True, temperature=0), "temperature must be > 0 when do_sample=True, got 0"),
    (dict(temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(top_k=-1), "top_k must be an int >= 0 (0 disables it), got -1"),
    (dict(top_k=2.5), "top_k must be an int >= 0 (0 disables it), got 2.5"),
    (dict(top_p=1.5), "top_p must be a number in (0, 1] (1 disables it), got 1.5"),
    (dict(seed="x"), "seed must be None or an int >= 0, got 'x'"),
    (dict(seed=-1), "seed must be None or an int >= 0, got -1")])
def test_invalid_settings(kwargs, message):
    # a SkipDecodeError (one except catches every deliberate error) that is still a ValueError
    with pytest.raises(SkipDecodeError) as info:
        SamplingConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)
