"""Every generate argument is checked where it enters, with a typed error (a SkipDecodeError that is
still a ValueError/TypeError) naming the argument, the limit and the fix."""

import re

import pytest
from tokenizers import processors

import runtime
from export.checkpoint import build_tokenizer
from runtime import validate
from runtime.errors import EmptyPromptError, InputTooLongError, InvalidArgumentError, SkipDecodeError


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a string or a non-empty list of strings, got NoneType"),
    ([], "prompts must be a string or a non-empty list of strings, got an empty list"),
    (["a", 3], "prompt 1 is a int"),
    (b"bytes", "got bytes")])
def test_bad_prompts(generator, prompts, message):
    with pytest.raises(SkipDecodeError, match=re.escape(message)) as info:
        generator.generate(prompts, 4)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an int >= 1, got 2.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(do_sample=True, temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(seed="7"), "seed must be None or an int >= 0, got '7'"),
    (dict(top_k=None), "top_k must be an int >= 0 (0 disables it), got None"),
    (dict(do_sample="yes"), "do_sample must be True or False, got 'yes'"),
    (dict(ignore_eos=1), "ignore_eos must be True or False, got 1"),
    (dict(eos_token_id=512), "eos_token_id 512 is outside the vocabulary [0, 511] of this model"),
    (dict(eos_token_id=[2, -1]), "eos_token_id -1 is outside the vocabulary [0, 511]"),
    (dict(eos_token_id="</s>"), "eos_token_id must be an int or a list of ints, got '</s>'"),
    (dict(stop_strings=[1]), "stop_strings must be a string or a list of strings, got [1]")])
def test_bad_generate_arguments(generator, kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        generator.generate("Hi", **kwargs)


def test_eos_inside_the_vocabulary_is_accepted(generator):
    assert generator.generate("Hi", 3, eos_token_id=[2, 511]).stats.new_tokens <= 3


@pytest.mark.parametrize("options, message", [
    (dict(threads=0), "threads must be an int >= 1 (or None for the backend's default), got 0"),
    (dict(threads="2"), "threads must be an int >= 1"),
    (dict(device="gpu"), "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    (dict(providers=["NoSuchExecutionProvider"]), "ONNX Runtime providers ['NoSuchExecutionProvider'] are not available here"),
    (dict(providers="CPUExecutionProvider"), "providers must be a list of ONNX Runtime provider names")])
def test_bad_load_options(artifact_dir, options, message):
    backend = "onnxruntime" if "providers" in options else "torch"
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        runtime.load(artifact_dir, backend=backend, check_hashes=False, **options)


def test_load_options_apply_only_to_a_directory(generator):
    with pytest.raises(InvalidArgumentError, match=re.escape("['threads'] apply only when model is a directory")):
        runtime.generate(generator, "Hi", 2, threads=2)


def test_unknown_backend_is_a_skipdecode_error(artifact_dir):
    with pytest.raises(runtime.SkipDecodeError, match="unknown backend 'bogus'; available: onnxruntime, torch, tensorrt"):
        runtime.load(artifact_dir, backend="bogus", check_hashes=False)


def test_prompt_of_zero_tokens_is_refused(generator):
    """A tokenizer without BOS turns "" into an empty row: an IndexError alone, garbage in a batch."""
    tok = build_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tok.padding_side = "left"
    assert tok("")["input_ids"] == []
    no_bos = runtime.Generator(generator.directory, generator.manifest, generator.backend, tok)
    with pytest.raises(EmptyPromptError, match=re.escape("prompt 1 ('') encodes to zero tokens")):
        no_bos.generate(["Hello", ""], 4)
    with pytest.raises(EmptyPromptError):
        no_bos.generate("", 4)
    assert no_bos.generate(["Hello"], 2).stats.new_tokens >= 1


@pytest.mark.parametrize("longest, new, advice", [
    (7, 64, "; lower max_new_tokens to at most 57"),  # was "shorten the prompt to at most 0 tokens"
    (70, 1, "; shorten the prompt to at most 63 tokens"),  # was "lower max_new_tokens to at most 0"
    (70, 64, "; shorten the prompt to fewer than 64 tokens and keep prompt tokens + max_new_tokens <= 64"),
    (40, 30, "; shorten the prompt to at most 34 tokens or lower max_new_tokens to at most 24")])
def test_too_long_never_advises_zero_or_negative(longest, new, advice):
    with pytest.raises(InputTooLongError) as info:
        validate.check_length(longest, new, 64)
    message = str(info.value)
    assert message.endswith(advice), message
    assert not re.search(r"at most (-\d+|0)\b", message), message
    validate.check_length(34, 30, 64)  # exactly at the limit is fine


def test_too_long_names_the_limit_it_broke():
    message = validate.too_long_message(70, 64, 64, limit_name="max_length {limit} of this Generator",
                                        last_resort="load with a larger max_length")
    assert message == ("prompt of 70 tokens + max_new_tokens 64 = 134 exceeds max_length 64 of this "
                       "Generator; load with a larger max_length")


def test_onnxruntime_cuda_without_its_provider_names_onnxruntime_gpu(artifact_dir):
    """The ONNX Runtime path asks ONNX Runtime, not PyTorch, whether it can use a GPU."""
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime offers CUDA")
    with pytest.raises(ValueError, match="CUDAExecutionProvider.*onnxruntime-gpu"):
        runtime.load(artifact_dir, device="cuda", check_hashes=False)
