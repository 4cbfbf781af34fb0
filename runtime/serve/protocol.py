"""The OpenAI completions protocol, without the web framework: parse and check a request body,
build responses and stream chunks, cut stop sequences as OpenAI does.

Kept free of Starlette and uvicorn so it can be read and tested on its own; ``app.py`` is the thin
HTTP layer on top.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field

from ..errors import SkipDecodeError
from ..stats import GenerationResult

MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
# SkipPolicy's fields a request may set; decay/exponent/prefill: the shape options (runtime.policy)
POLICY_FIELDS = ("max_layers", "min_layers", "warmup_layers", "horizon", "decay", "exponent", "prefill")


class RequestError(SkipDecodeError, ValueError):
    """A request the server refuses, answered in OpenAI's error shape with ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error",
                 retry_after: int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.retry_after = retry_after  # seconds, sent as Retry-After (with 503)

    def to_dict(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    """One checked ``/v1/completions`` body, in the runtime's terms."""

    prompts: list[str]  # one choice per prompt; all of them run as one engine request (its rows)
    max_tokens: int  # new tokens per prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and skipdecode
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # extension; 0 disables (OpenAI samples from the whole vocabulary)
    seed: int | None
    stop: list[str]
    ignore_eos: bool  # extension (as vLLM): generate max_tokens even past EOS, for benchmarks
    speedup: float | None  # extension: SkipDecode theoretical speedup target
    policy: dict | None  # extension: SkipPolicy fields (POLICY_FIELDS)

    def generate_kwargs(self) -> dict:
        """Keyword arguments of ``Generator.stream`` / ``runtime.generate`` for this request."""
        greedy = self.temperature == 0
        return dict(speedup=self.speedup, policy=self.policy, do_sample=not greedy,
                    temperature=1.0 if greedy else self.temperature, top_k=self.top_k,
                    top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos,
                    stop_strings=self.stop or None)


# Fields OpenAI defines that this server accepts only at their neutral value: the message says why.
_NEUTRAL = {
    "n": (1, "n > 1 is not supported: send the prompt several times (or as a list) instead"),
    "best_of": (1, "best_of > 1 is not supported"),
    "echo": (False, "echo is not supported: the response holds the completion only"),
    "logprobs": (None, "logprobs are not supported"),
    "suffix": (None, "suffix (insertion) is not supported by OPT"),
    "presence_penalty": (0, "presence_penalty is not supported; send 0 or leave it out"),
    "frequency_penalty": (0, "frequency_penalty is not supported; send 0 or leave it out"),
}
_IGNORED = {"user"}  # accepted and not used, as many OpenAI-compatible servers do
_KNOWN = {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p",
          "top_k", "seed", "stop", "ignore_eos", "speedup", "policy", "logit_bias",
          *_NEUTRAL, *_IGNORED}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    inside = _is_number(v) and (v > low if low_open else v >= low) and v <= high
    if not inside:
        bound = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(f"{name} must be a number in {bound}, got {v!r}", name)
    return float(v)


def parse_completion(body, model_id: str, max_batch: int, default_max_tokens: int = 16,
                     default_speedup: float | None = None) -> CompletionRequest:
    """Check a decoded JSON body; raise RequestError naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise RequestError(f"unrecognized request field {unknown[0]!r}; this server accepts "
                           f"{', '.join(sorted(_KNOWN))}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(f"model {model!r} is not served here; this server serves {model_id!r} "
                           f"(GET /v1/models)", "model", status=404, code="model_not_found")
    for name, (neutral, why) in _NEUTRAL.items():
        if body.get(name) is not None and body.get(name) != neutral:
            raise RequestError(f"{why} (got {name}={body[name]!r})", name, code="unsupported")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported; leave it out or send {}", "logit_bias",
                           code="unsupported")

    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(p) or isinstance(p, list) for p in prompt):
        raise RequestError("token-id prompts are not supported; send the prompt as text", "prompt",
                           code="unsupported")
    else:
        raise RequestError(f"prompt is required: a string or a non-empty list of strings, got {prompt!r}",
                           "prompt")
    if len(prompts) > max_batch:
        raise RequestError(f"{len(prompts)} prompts exceed this server's --max-batch {max_batch}; "
                           f"send at most {max_batch} per request", "prompt")

    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"max_tokens must be an int >= 1, got {max_tokens!r}", "max_tokens")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise RequestError(f"stream_options must be {{\"include_usage\": true|false}}, got {options!r}",
                               "stream_options")
        include_usage = options.get("include_usage", False)

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)  # OpenAI's default and range
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < 0:
        raise RequestError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an int, got {seed!r}", "seed")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise RequestError(f"seed must lie in [0, 2**63), got {seed!r}", "seed")

    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"stop must be a non-empty string or a list of at most "
                           f"{MAX_STOP_SEQUENCES} non-empty strings, got {stop!r}", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, got {ignore_eos!r}", "ignore_eos")

    speedup, policy = body.get("speedup"), body.get("policy")
    if speedup is not None and policy is not None:
        raise RequestError("send either speedup or policy, not both", "speedup")
    if speedup is not None and not _is_number(speedup):
        raise RequestError(f"speedup must be a number >= 1, got {speedup!r}", "speedup")
    if policy is not None:
        if not isinstance(policy, dict):
            raise RequestError(f"policy must be an object with {', '.join(POLICY_FIELDS)}, got {policy!r}",
                               "policy")
        for key in policy:
            if key not in POLICY_FIELDS:
                raise RequestError(f"unknown policy field {key!r}; a policy has {', '.join(POLICY_FIELDS)}",
                                   f"policy.{key}")
        for key in ("max_layers", "min_layers"):
            if key not in policy:
                raise RequestError(f"policy.{key} is required", f"policy.{key}")
    if speedup is None and policy is None:
        speedup = default_speedup
    return CompletionRequest(prompts, max_tokens, stream, include_usage, temperature, top_p, top_k,
                             seed, stops, ignore_eos, None if speedup is None else float(speedup), policy)


def policy_error_param(message: str, request: CompletionRequest) -> str:
    """The field a PolicyError is about: ``speedup``, or ``policy.<field>`` when its message starts
    with a policy field's name (SkipPolicy's messages do)."""
    if request.speedup is not None:
        return "speedup"
    first = re.match(r"\w+", message)
    if first and first.group(0) in POLICY_FIELDS:
        return f"policy.{first.group(0)}"
    return "policy"


# -- stop sequences --------------------------------------------------------------------------------


def cut_stop(text: str, stops: list[str]) -> str:
    """The runtime keeps the stop string it stopped at (as transformers); OpenAI leaves it out.
    The runtime's text ends exactly at the stop string that ended it: drop the longest that fits."""
    ends = [s for s in stops if s and text.endswith(s)]
    return text[: len(text) - max(map(len, ends))] if ends else text


@dataclass
class StopHoldback:
    """Streams one choice's text without ever sending part of a stop sequence.

    A stop string may arrive over several tokens; text that could still become one is held back
    until the next token proves otherwise, so the streamed text equals the non-streamed one."""

    stops: list[str]
    text: str = ""  # everything the runtime produced so far
    sent: int = 0  # characters of ``text`` already streamed

    def push(self, delta: str) -> str:
        """Add the runtime's text of one step; return what may be sent now."""
        self.text += delta
        safe = len(self.text) - self._open_prefix()
        out = self.text[self.sent: safe]
        self.sent = max(self.sent, safe)
        return out

    def finish(self, delta: str, reason: str) -> str:
        """Add the last step's text; return the rest of the choice's text, without the stop string
        it stopped at ("eos" too: a flush at EOS may complete one; the runtime then says "eos")."""
        self.text += delta
        final = self.text if reason == "length" else cut_stop(self.text, self.stops)
        out = final[self.sent:]
        self.sent = len(final)
        return out

    def _open_prefix(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


# -- responses ---------------------------------------------------------------------------------------


def openai_finish_reason(reason: str | None) -> str | None:
    """The runtime's "eos" / "stop" / "length" in OpenAI's terms: "stop" for both eos and stop."""
    return None if reason is None else "length" if reason == "length" else "stop"


@dataclass
class Completion:
    """Identity shared by a response and all the chunks of its stream."""

    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}


def choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def usage(prompt_tokens: int, result: GenerationResult) -> dict:
    completion_tokens = sum(len(ids) for ids in result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def skipdecode_info(result: GenerationResult) -> dict:
    """This request's layers: ``layers_per_token[g]`` is the number of decoder layers the g-th
    generated token ran through (the policy's step g; the first token itself comes from the
    full-depth prompt pass, the last one is never run). The rows of a multi-prompt request step
    together, so each choice's list is a prefix of this one."""
    stats = result.stats
    return {"policy": result.policy.to_dict(), "num_layers": stats.num_layers,
            "layers_per_token": stats.layers_per_step,
            "theoretical_speedup": round(stats.theoretical_speedup, 4),
            "achieved_layer_ratio": round(stats.achieved_layer_ratio, 4)}


def completion_response(completion: Completion, result: GenerationResult, stops: list[str],
                        prompt_tokens: int) -> dict:
    choices = [choice(i, text if reason == "length" else cut_stop(text, stops), openai_finish_reason(reason))
               for i, (text, reason) in enumerate(zip(result.texts, result.finish_reasons))]
    return {**completion.envelope(choices), "usage": usage(prompt_tokens, result),
            "skipdecode": skipdecode_info(result)}

