"""GenerationConfig: one object for a generation's arguments, the same tokens whichever way it is
spelled (a config, keyword arguments, both), checked where it is made."""

import pytest

import runtime
from runtime import GenerationConfig
from runtime.errors import InvalidArgumentError
from runtime.generation_config import FIELDS
from tests.conftest import PROMPTS


def test_a_config_and_keyword_arguments_give_the_same_tokens(generator):
    config = GenerationConfig(7, speedup=2, do_sample=True, top_k=5, seed=3, ignore_eos=True, logprobs=2)
    by_config = generator.generate(PROMPTS[:2], config=config)
    by_kwargs = generator.generate(PROMPTS[:2], 7, speedup=2, do_sample=True, top_k=5, seed=3, ignore_eos=True,
                                   logprobs=2)
    assert by_config.token_ids == by_kwargs.token_ids and [len(t) for t in by_config.token_ids] == [7, 7]
    assert by_config.policy == by_kwargs.policy
    # keyword arguments (and max_new_tokens given positionally) override the config's fields
    other = generator.generate(PROMPTS[:2], 7, config=GenerationConfig(3, speedup=2, do_sample=True, top_k=5,
                                                                       ignore_eos=True, logprobs=2), seed=4)
    assert other.token_ids == generator.generate(PROMPTS[:2], 7, speedup=2, do_sample=True, top_k=5, seed=4,
                                                 ignore_eos=True).token_ids
    request = generator.request(PROMPTS[0], config=config)
    assert request.config is config and request.max_new_tokens == 7


def test_unknown_and_invalid_arguments_are_refused_where_the_config_is_made(generator):
    with pytest.raises(InvalidArgumentError, match=r"unknown generation argument\(s\) 'max_tokens'; the "
                                                   r"arguments are GenerationConfig's fields: max_new_tokens, "):
        generator.generate(PROMPTS[0], max_tokens=3)
    with pytest.raises(InvalidArgumentError, match="top_p must be a number in \\(0, 1\\]"):
        GenerationConfig(top_p=0)
    with pytest.raises(InvalidArgumentError, match="config must be a GenerationConfig, got dict"):
        generator.generate(PROMPTS[0], config={"max_new_tokens": 3})


def test_every_field_is_a_keyword_of_generate_and_the_defaults_are_one_set():
    assert FIELDS[0] == "max_new_tokens" and len(set(FIELDS)) == len(FIELDS)
    d = GenerationConfig()
    assert (d.max_new_tokens, d.top_k, d.temperature, d.do_sample) == (32, 50, 1.0, False)
    assert runtime.GenerationConfig is GenerationConfig
