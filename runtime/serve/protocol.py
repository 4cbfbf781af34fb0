"""The OpenAI completions protocol, without the web framework: parse and check a request body,
build responses and stream chunks, cut stop sequences as OpenAI does.

Kept free of Starlette and uvicorn so it can be read and tested on its own; ``app.py`` is the thin
HTTP layer on top.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace

from ..decoding.detokenize import IncrementalDetokenizer
from ..decoding.sampling import PENALTY_RANGE
from ..decoding.structured import JSON_OBJECT
from ..errors import SkipDecodeError
from ..generation_config import GenerationConfig
from ..policy import POLICY_FIELDS
from ..stats import GenerationResult, TokenLogprob

MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`


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
    """One checked ``/v1/completions`` (or chat) body, in the runtime's terms."""

    prompts: list  # one per prompt: a string, or token ids (a list of ints)
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
    n: int = 1  # choices per prompt: rows of the same prompt, each with its own random stream
    echo: bool = False  # the prompt's text before each choice's text
    logprobs: int | None = None  # per generated token: its log-probability and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: dict | None = None  # response_format's schema: every choice's text is JSON matching it
    lossless: bool = False  # extension: the policy's layers draft, full depth verifies (full depth's text)
    deep_copies: bool | None = None  # extension: rows copying a rare string of the prompt run deeper
    # (runtime.decoding.copying); null: the model's default

    @property
    def rows(self) -> list:
        """The engine's rows: each prompt n times; choice i is row i (OpenAI's index order)."""
        return [p for p in self.prompts for _ in range(self.n)]

    def generation_config(self) -> GenerationConfig:
        """This request as the runtime's GenerationConfig (OpenAI's temperature 0 is greedy)."""
        greedy = self.temperature == 0
        return GenerationConfig(self.max_tokens, speedup=self.speedup, policy=self.policy, do_sample=not greedy,
                                temperature=1.0 if greedy else self.temperature, top_k=self.top_k,
                                top_p=self.top_p, seed=self.seed, ignore_eos=self.ignore_eos,
                                stop_strings=self.stop or None, presence_penalty=self.presence_penalty,
                                frequency_penalty=self.frequency_penalty, logprobs=self.logprobs,
                                json_schema=self.json_schema, lossless=self.lossless,
                                deep_copies=self.deep_copies)


# Fields OpenAI defines that this server accepts only at their neutral value: the message says why.
_NEUTRAL = {
    "best_of": (1, "best_of > 1 is not supported; n > 1 returns n choices"),
    "suffix": (None, "suffix (insertion) is not supported by OPT"),
}
_IGNORED = {"user"}  # accepted and not used, as many OpenAI-compatible servers do
_COMMON = {"model", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "seed",
           "stop", "ignore_eos", "speedup", "policy", "lossless", "deep_copies", "logit_bias", "n", "presence_penalty",
           "frequency_penalty", "logprobs", "response_format", *_IGNORED}
_KNOWN = {"prompt", "echo", *_COMMON, *_NEUTRAL}
MAX_LOGPROBS = 5  # OpenAI's limit of a completion's logprobs
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of a chat completion's top_logprobs


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


def _int(body: dict, name: str, default, low: int, high: int | None = None, why: str = ""):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be an int {bound}{why}, got {v!r}", name)
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {v!r}", name)
    return v


def _prompts(prompt) -> list:
    """OpenAI's four prompt forms: a string, a list of strings, token ids, a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError(f"prompt must be a string, a non-empty list of strings, a list of token ids or a "
                       f"list of token-id lists, got {prompt!r}", "prompt")


JSON_MAX_TOKENS = 256  # /v1/completions' max_tokens with a JSON response_format and none given, context allowing


def parse_completion(body, model_id: str, max_batch: int, default_max_tokens: int = 16,
                     default_speedup: float | None = None) -> CompletionRequest:
    """Check a decoded JSON body; raise RequestError naming the first field that is wrong."""
    _check_fields(body, _KNOWN, model_id)
    for name, (neutral, why) in _NEUTRAL.items():
        if body.get(name) is not None and body.get(name) != neutral:
            raise RequestError(f"{why} (got {name}={body[name]!r})", name, code="unsupported")
    prompts = _prompts(body.get("prompt"))
    echo = _bool(body, "echo")
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise RequestError("echo with logprobs is not supported: the runtime computes no log-probabilities "
                           "for prompt tokens; send echo or logprobs, not both", "echo", code="unsupported")
    max_tokens = _int(body, "max_tokens", None, 1)
    req = _request(body, prompts, max_tokens or default_max_tokens, max_batch, default_speedup, echo=echo,
                   logprobs=logprobs)
    if max_tokens is None and req.json_schema is not None:
        # a JSON answer needs room for a whole document: 16 tokens (OpenAI's default) cut most
        # objects short; 0 here, and the server gives it JSON_MAX_TOKENS or what the context leaves
        return replace(req, max_tokens=0)
    return req


_CHAT_KNOWN = {"messages", "max_completion_tokens", "top_logprobs", *_COMMON}
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body, model_id: str, max_batch: int, default_speedup: float | None = None
               ) -> tuple[CompletionRequest, list[dict]]:
    """Check a /v1/chat/completions body: the request (its ``prompts`` still to be rendered from
    the messages; ``max_tokens`` 0 when the body gives none: the rest of the context) and the
    messages, their content as text."""
    _check_fields(body, _CHAT_KNOWN, model_id)
    messages = _messages(body.get("messages"))
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    legacy, max_tokens = _int(body, "max_tokens", None, 1), _int(body, "max_completion_tokens", None, 1)
    if legacy is not None and max_tokens is not None and legacy != max_tokens:
        raise RequestError(f"max_tokens {legacy} and max_completion_tokens {max_tokens} disagree; send one "
                           f"(max_completion_tokens: max_tokens is its deprecated name)", "max_tokens")
    max_tokens = max_tokens or legacy or 0
    req = _request(body, [None], max_tokens, max_batch, default_speedup, logprobs=(top or 0) if logprobs else None)
    return req, messages


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                           f"{messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}, got "
                               f"{m!r}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only (the model reads nothing else)
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                   f"...}}) are supported by a text model", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
                               f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


def _check_fields(body, known: set, model_id: str) -> None:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unrecognized request field {unknown[0]!r}; this endpoint accepts "
                           f"{', '.join(sorted(known))}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(f"model {model!r} is not served here; this server serves {model_id!r} "
                           f"(GET /v1/models)", "model", status=404, code="model_not_found")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported; leave it out or send {}", "logit_bias",
                           code="unsupported")


def _request(body: dict, prompts: list, max_tokens: int, max_batch: int, default_speedup: float | None,
             **extra) -> CompletionRequest:
    """The fields completions and chat share."""
    n = _int(body, "n", 1, 1, max_batch, f" (this server's --max-batch {max_batch})")
    if len(prompts) * n > max_batch:
        what = f"{len(prompts)} prompts x n={n}" if n > 1 else f"{len(prompts)} prompts"
        raise RequestError(f"{what} exceed this server's --max-batch {max_batch}; send at most "
                           f"{max_batch} choices per request", "n" if n > 1 else "prompt")

    stream = _bool(body, "stream")
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
    top_k = _int(body, "top_k", 0, 0, why=" (0 disables it)")
    penalties = {name: _number(body, name, 0.0, *PENALTY_RANGE) for name in ("presence_penalty", "frequency_penalty")}
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
    ignore_eos = _bool(body, "ignore_eos")
    lossless = _bool(body, "lossless")
    deep_copies = None if body.get("deep_copies") is None else _bool(body, "deep_copies")

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
    if speedup is None and policy is None:
        speedup = default_speedup
    return CompletionRequest(prompts, max_tokens, stream, include_usage, temperature, top_p, top_k,
                             seed, stops, ignore_eos, None if speedup is None else float(speedup), policy,
                             n=n, **penalties, json_schema=_response_format(body.get("response_format")),
                             lossless=lossless, deep_copies=deep_copies, **extra)


def _response_format(value) -> dict | None:
    """OpenAI's response_format: None or {"type": "text"} (free text), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", ...}}: the schema the text must match."""
    kinds = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
             '{"name": ..., "schema": {...}}}')
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(f"response_format must be {kinds}, got {value!r}", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return dict(JSON_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise RequestError(f"response_format.json_schema must be an object with a \"schema\" object, got {spec!r}",
                           "response_format.json_schema")
    # OpenAI's name and strict change nothing here: every schema is enforced token by token
    return spec.get("schema", {})


def policy_error_param(exc, request: CompletionRequest) -> str:
    """The field a PolicyError is about: ``speedup`` when the request set one, else ``policy.<field>``
    for the policy field its ``param`` names, else ``policy``."""
    if request.speedup is not None:
        return "speedup"
    return f"policy.{exc.param}" if exc.param in POLICY_FIELDS else "policy"


# The runtime's argument names that the request spells otherwise.
REQUEST_FIELDS = {"prompts": "prompt", "max_new_tokens": "max_tokens", "stop_strings": "stop",
                  "json_schema": "response_format"}


def request_param(param: str | None) -> str | None:
    """The request's field for a runtime error's ``param`` (an InvalidArgumentError's)."""
    return REQUEST_FIELDS.get(param, param)


# -- stop sequences --------------------------------------------------------------------------------


def cut_stop(text: str, stops: list[str]) -> str:
    """The runtime keeps the stop string it stopped at and the rest of the token that completed it
    (as transformers); OpenAI returns the text before it. No stop string occurs earlier in the
    runtime's text (the row would have ended there), so the first occurrence is the one."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(found)] if found else text


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


class TextFormat:
    """The shapes of /v1/completions: ``text`` choices, OpenAI's legacy ``logprobs``."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def logprobs(self, tokenizer, offset: int = 0) -> "CompletionLogprobs":
        return CompletionLogprobs(tokenizer, offset)

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    chunk_choice = choice

    def opening(self, rows: int) -> list[dict]:
        return []


class ChatFormat:
    """The shapes of /v1/chat/completions: an assistant ``message`` (``delta`` when streamed, the
    role first), ``logprobs.content`` entries."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def logprobs(self, tokenizer, offset: int = 0) -> "ChatLogprobs":
        return ChatLogprobs(tokenizer)

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def opening(self, rows: int) -> list[dict]:
        """The first chunk of every choice: its role, as OpenAI streams it."""
        return [{"index": b, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for b in range(rows)]


TEXT, CHAT = TextFormat(), ChatFormat()


@dataclass
class Completion:
    """Identity shared by a response and all the chunks of its stream."""

    model: str
    format: TextFormat | ChatFormat = TEXT
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.format.id_prefix}{uuid.uuid4().hex}"

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        return {"id": self.id, "object": self.format.chunk_object if chunk else self.format.object,
                "created": self.created, "model": self.model, "choices": choices}


def usage(prompt_tokens: int, result: GenerationResult) -> dict:
    completion_tokens = sum(len(ids) for ids in result.token_ids)
    # OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens whose K/V were reused, not run
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens}}


def skipdecode_info(result: GenerationResult, req: CompletionRequest) -> dict:
    """This request's layers: ``layers_per_token[g]`` is the number of decoder layers the g-th
    generated token ran through (the policy's step g; the first token itself comes from the
    full-depth prompt pass, the last one is never run). The rows of a multi-prompt request step
    together, so each choice's list is a prefix of this one. ``warnings``: what the choices' finish
    reasons alone do not say (a JSON answer that max_tokens cut short does not parse)."""
    stats = result.stats
    cut = [i for i, reason in enumerate(result.finish_reasons) if reason == "length"] if req.json_schema else []
    warnings = [f"choice {i}: max_tokens ({req.max_tokens}) ended its JSON before the document did, so it does "
                f"not parse (finish_reason \"length\"); ask for more max_tokens" for i in cut]
    return {"policy": result.policy.to_dict(), "num_layers": stats.num_layers,
            "layers_per_token": stats.layers_per_step,
            "layer_reduction": round(stats.layer_reduction, 4),
            "achieved_layer_ratio": round(stats.achieved_layer_ratio, 4),
            **({} if not stats.verify_passes else {"lossless": stats.lossless_dict()}),
            **({"warnings": warnings} if warnings else {})}


def timings(prompt_tokens: int, result: GenerationResult) -> dict:
    """What this request waited, in llama.cpp server's ``timings`` fields (milliseconds): the prompt
    pass (``prompt_n`` tokens run, ``cache_n`` reused), the decode (``predicted_n`` tokens of its
    longest choice; ``predicted_per_token_ms`` is a choice's wait per token after the first), and
    the wall clock from admission to the first token and to the last, other requests' work included."""
    s = result.stats
    ran = prompt_tokens - s.cached_tokens
    return {"prompt_n": ran, "cache_n": s.cached_tokens, "prompt_ms": round(s.prefill_seconds * 1e3, 3),
            "prompt_per_second": round(ran / s.prefill_seconds, 2) if s.prefill_seconds else 0.0,
            "predicted_n": s.new_tokens, "predicted_ms": round(s.decode_seconds * 1e3, 3),
            "predicted_per_token_ms": round(s.decode_ms_per_token, 3),
            "predicted_per_second": round(1e3 / s.decode_ms_per_token, 2) if s.decode_ms_per_token else 0.0,
            "first_token_ms": round(s.first_token_seconds * 1e3, 3), "total_ms": round(s.seconds * 1e3, 3)}


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text, special tokens included (OpenAI's ``tokens``)."""
    return tokenizer.decode([token_id])


class CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` of one choice: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (the k most likely tokens, and the chosen one) and ``text_offset`` (each token's first
    character in the choice's text, echoed prompt included). A token that only completes a
    character split across tokens starts where that character does."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer, self.offset = tokenizer, offset
        self.detok = IncrementalDetokenizer(tokenizer)

    def add(self, lps: list[TokenLogprob], texts: list[str] | None = None) -> dict:
        """The object for ``lps``; ``texts``: the text each token added, when the caller has it."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for j, lp in enumerate(lps):
            top = {token_text(self.tokenizer, i): v for i, v in lp.top}
            out["tokens"].append(token_text(self.tokenizer, lp.token_id))
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({**top, out["tokens"][-1]: lp.logprob})
            out["text_offset"].append(self.offset)
            self.offset += len(texts[j] if texts is not None else self.detok.add(lp.token_id))
        return out


class ChatLogprobs:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = token_text(self.tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def add(self, lps: list[TokenLogprob], texts: list[str] | None = None) -> dict:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in lp.top]} for lp in lps]}


def completion_response(completion: Completion, result: GenerationResult, req: CompletionRequest,
                        prompt_tokens: int, echoes: list[str], tokenizer) -> dict:
    """The whole response; ``echoes``: each choice's prompt text with echo, else ""."""
    fmt, choices = completion.format, []
    for i, (text, reason) in enumerate(zip(result.texts, result.finish_reasons)):
        logprobs = None
        if result.logprobs is not None:
            logprobs = fmt.logprobs(tokenizer, len(echoes[i])).add(result.logprobs[i])
        text = text if reason == "length" else cut_stop(text, req.stop)
        choices.append(fmt.choice(i, echoes[i] + text, openai_finish_reason(reason), logprobs))
    return {**completion.envelope(choices), "usage": usage(prompt_tokens, result),
            "timings": timings(prompt_tokens, result), "skipdecode": skipdecode_info(result, req)}
