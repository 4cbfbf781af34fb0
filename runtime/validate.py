"""Validation of every argument of ``Generator.generate`` / ``stream`` / ``runtime.load``.

Plain functions, no state: each checks one argument where it enters the toolkit and either returns
it in a normal form or raises a typed error (``InvalidArgumentError`` and subclasses, all
``SkipDecodeError``) whose message names the argument, the value, the limit and the fix. The
generator calls them before it touches the tokenizer or a backend, so a bad call never leaves a
half-run batch behind, and the command line turns them into one line and exit code 2.

Why here and not in the decode loop: the loop is rewritten for continuous batching; these checks
are the same for any loop, so they live apart and the loop just calls them. The calls, in order:

    # Generator.stream, before anything runs
    prompts = validate.check_prompts(prompts)
    max_new_tokens = validate.check_max_new_tokens(max_new_tokens)
    eos = validate.check_eos(eos_token_id, model.vocab_size, model.eos_ids, ignore_eos)
    stops = validate.check_stop_strings(stop_strings)
    sampling = SamplingConfig(...)  # checks do_sample, temperature, top_k, top_p, seed itself
    # after tokenizing
    validate.check_nonempty_rows(attention_mask, prompts)
    validate.check_length(prompt_tokens, max_new_tokens, limit)  # limit_name=/last_resort= to rename
    # runtime.load, first line
    validate.check_backend_options(backend_options)  # threads, device, providers
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

import numpy as np

from .errors import EmptyPromptError, InputTooLongError, InvalidArgumentError


def _is_int(value) -> bool:
    # bool is an int subclass, but max_new_tokens=True is a mistake, not 1
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_prompts(prompts) -> list[str]:
    """A string or a non-empty sequence of strings -> a list of strings."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
        raise InvalidArgumentError(
            f"prompts must be a string or a non-empty list of strings, got {type(prompts).__name__}", param="prompts")
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgumentError("prompts must be a string or a non-empty list of strings, got an empty list",
            param="prompts")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise InvalidArgumentError(
            f"prompts must be a string or a non-empty list of strings; prompt {bad[0]} is a "
            f"{type(prompts[bad[0]]).__name__}", param="prompts")
    return prompts


def check_max_new_tokens(max_new_tokens) -> int:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}",
            param="max_new_tokens")
    return int(max_new_tokens)


def check_temperature(temperature, do_sample: bool) -> float:
    """A finite number; > 0 when sampling (greedy decoding ignores it)."""
    if not _is_real(temperature) or not math.isfinite(temperature):
        raise InvalidArgumentError(f"temperature must be a finite number, got {temperature!r}", param="temperature")
    if do_sample and not temperature > 0:
        raise InvalidArgumentError(
            f"temperature must be > 0 when do_sample=True, got {temperature}; for greedy "
            f"decoding pass do_sample=False", param="temperature")
    return float(temperature)


def check_top_k(top_k) -> int:
    if not _is_int(top_k) or top_k < 0:
        raise InvalidArgumentError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}", param="top_k")
    return int(top_k)


def check_top_p(top_p) -> float:
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise InvalidArgumentError(f"top_p must be a number in (0, 1] (1 disables it), got {top_p!r}", param="top_p")
    return float(top_p)


def check_seed(seed) -> int | None:
    """None (the OS draws one) or an int >= 0, what numpy's default_rng accepts."""
    if seed is None:
        return None
    if not _is_int(seed) or seed < 0:
        raise InvalidArgumentError(f"seed must be None or an int >= 0, got {seed!r}", param="seed")
    return int(seed)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}", param=name)
    return bool(value)


def check_eos(eos_token_id, vocab_size: int, default: int | list[int], ignore_eos: bool = False) -> set[int]:
    """The set of token ids that end a row: {} with ignore_eos, the model's EOS (one or several) when None."""
    check_bool("ignore_eos", ignore_eos)
    if ignore_eos:
        return set()
    if eos_token_id is None:
        return {default} if _is_int(default) else set(default)
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, set, frozenset)) \
            or not all(_is_int(i) for i in ids):
        raise InvalidArgumentError(
            f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}", param="eos_token_id")
    outside = [int(i) for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise InvalidArgumentError(
            f"eos_token_id {outside[0]} is outside the vocabulary [0, {vocab_size - 1}] of this "
            f"model, so it could never end a row; pass an id below {vocab_size} or leave "
            f"eos_token_id=None for the model's EOS ({default})", param="eos_token_id")
    return {int(i) for i in ids}


def check_stop_strings(stop_strings) -> list[str]:
    if stop_strings is None:
        return []
    if isinstance(stop_strings, str):
        return [stop_strings]
    if not isinstance(stop_strings, Sequence) or not all(isinstance(s, str) for s in stop_strings):
        raise InvalidArgumentError(f"stop_strings must be a string or a list of strings, got {stop_strings!r}",
            param="stop_strings")
    return list(stop_strings)


def check_threads(threads) -> int | None:
    """Intra-op threads of a backend: None (the backend's default) or an int >= 1."""
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise InvalidArgumentError(
            f"threads must be an int >= 1 (or None for the backend's default), got {threads!r}", param="threads")
    return threads


def check_flag(name: str, value, true: str, false: str) -> bool | None:
    """A backend's on/off option: None (the backend's default) or a bool; ``true`` and ``false``
    say what each value does, for the message."""
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True ({true}) or False ({false}), got {value!r}", param=name)
    return value


def check_nonempty_rows(attention_mask: np.ndarray, prompts: list[str]) -> None:
    """Refuse prompts that encode to zero tokens: they have no last token to predict from (an
    IndexError alone, a row of padding decoded as garbage in a batch)."""
    empty = np.flatnonzero(attention_mask.sum(axis=1) == 0)
    if len(empty):
        i = int(empty[0])
        raise EmptyPromptError(
            f"prompt {i} ({prompts[i]!r}) encodes to zero tokens: this tokenizer adds no BOS "
            f"token, so there is nothing to continue from; pass a prompt with at least one token", param="prompts")


def too_long_message(longest: int, max_new_tokens: int, limit: int,
                     limit_name: str = "max_position_embeddings {limit} of this model",
                     last_resort: str | None = None) -> str:
    """What to do when ``longest + max_new_tokens > limit``; only advice that can work (never a
    length <= 0).

    limit_name: how the message names the limit (e.g. "max_length {limit} of this Generator" for a
    limit set at load); last_resort: the advice when neither length alone can fit (default: shorten
    the prompt below the limit and keep the sum within it).
    """
    head = (f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
            f"{longest + max_new_tokens} exceeds {limit_name.format(limit=limit)}")
    fixes = []
    if limit - max_new_tokens >= 1:
        fixes.append(f"shorten the prompt to at most {limit - max_new_tokens} tokens")
    if limit - longest >= 1:
        fixes.append(f"lower max_new_tokens to at most {limit - longest}")
    if not fixes:  # the prompt alone fills the context: both must shrink
        fixes.append(last_resort or f"shorten the prompt to fewer than {limit} tokens and keep prompt "
                                    f"tokens + max_new_tokens <= {limit}")
    return f"{head}; {' or '.join(fixes)}"


def check_length(longest: int, max_new_tokens: int, limit: int, **message) -> None:
    """InputTooLongError (with ``too_long_message``'s advice) when the row cannot fit ``limit``."""
    if longest + max_new_tokens > limit:
        raise InputTooLongError(too_long_message(longest, max_new_tokens, limit, **message))


def check_device(device) -> str | None:
    """A backend device: None (the backend's default), "cpu", "cuda" or "cuda:N".

    Only the spelling is checked here; whether the device exists is the backend's to say (torch:
    PyTorch sees it; ONNX Runtime: this onnxruntime offers its provider), so the ONNX Runtime path
    never imports torch to ask.
    """
    if device is None:
        return None
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}", param="device")
    return text


def check_providers(providers) -> list | None:
    """ONNX Runtime execution providers: None (CUDA if offered, then CPU) or names it offers here."""
    if providers is None:
        return None
    if isinstance(providers, str) or not isinstance(providers, Sequence):
        raise InvalidArgumentError(f"providers must be a list of ONNX Runtime provider names, got {providers!r}",
            param="providers")
    import onnxruntime

    available = onnxruntime.get_available_providers()
    missing = [p for p in (p if isinstance(p, str) else p[0] for p in providers) if p not in available]
    if missing:
        raise InvalidArgumentError(
            f"ONNX Runtime providers {missing} are not available here (available: {available}); "
            f"install onnxruntime-gpu (instead of onnxruntime) for CUDA/TensorRT, or leave providers=None",
                param="providers")
    return list(providers)


def check_backend_options(options: dict) -> None:
    """The options ``runtime.load`` passes to the backends: threads, spin, huge_pages, fused, deterministic,
    device, providers
    (int4_kernel: each backend checks its own)."""
    check_threads(options.get("threads"))
    if options.get("spin") != "auto":  # "auto": spin where the cores are free at load (runtime.platform.cpu_idle)
        check_flag("spin", options.get("spin"), "worker threads busy-wait briefly: a device of its own",
                   "they sleep: the default; or 'auto': spin where no other process uses the cores at load")
    check_flag("huge_pages", options.get("huge_pages"),
               "packed weights moved onto 2 MiB pages where Linux allows", "the default: left as allocated")
    check_flag("fused", options.get("fused"), "the layers' fused-operator graphs, refused where the artifact has none",
               "the plain layer graphs")
    check_flag("deterministic", options.get("deterministic"), "every int8/int4 product at float activations: "
               "greedy text independent of the batch, 1.2x-40x slower on MatMulNBits", "as exported on this "
               "project's kernel, int8 activations on MatMulNBits")
    check_device(options.get("device"))
    check_providers(options.get("providers"))
