"""The user-facing generator: ``runtime.load`` / ``runtime.generate`` and ``Generator``.

A Generator is thread-safe: every ``generate``/``stream`` call becomes a request of its engine
(runtime/engine/), which batches the calls step by step with per-row SkipDecode budgets."""

from __future__ import annotations

import dataclasses
import queue
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import validate
from .artifact.manifest import Manifest, load_manifest
from .backends import Backend, create_backend
from .decoding.copying import DeepCopies
from .decoding.detokenize import IncrementalDetokenizer
from .decoding.structured import Structured
from .engine import DONE, AUTO, Engine, EngineClosedError, Request
from .errors import InvalidArgumentError, PolicyError
from .generation_config import FIELDS, GenerationConfig
from .kvcache import KVStorage
from .policy import SkipPolicy
from .prefix_cache import PrefixCache
from .stats import GenerationResult, TokenEvent
from .tokenizer import load_tokenizer

DEFAULT_MAX_BATCH = 8  # KV rows when load() is not told; a TensorRT build may allow fewer
# Prompt tokens a joining request runs per round while other rows decode: "auto" sizes them to
# about a decode step each (runtime/engine/), so a running row's longest wait stays near two
# steps (docs/benchmarks.md, "A prompt joins")
DEFAULT_PREFILL_CHUNK = AUTO


class GenerationStream:
    """Iterator of TokenEvent for one request; ``.result`` holds the GenerationResult once it is
    exhausted. The engine runs the request whether or not the stream is read: a stream paused
    while another runs loses nothing. ``close()`` (or dropping the stream) cancels the request
    and frees its rows at the engine's next step."""

    def __init__(self, engine: Engine, request: Request):
        self._engine, self._request = engine, request
        self.result: GenerationResult | None = None
        self._done = False

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> TokenEvent:
        while not self._done:
            item = self._request.events.get()
            if item is DONE:
                self._done = True
            elif isinstance(item, GenerationResult):
                self.result = item
            elif isinstance(item, BaseException):
                self._done = True
                raise item
            else:
                return item
        raise StopIteration

    @property
    def step_times(self) -> list[float]:
        """``time.perf_counter()`` when each step's tokens were chosen, so far (the engine's clock;
        with or without events)."""
        return list(self._request.step_times)

    @property
    def prompt_lengths(self) -> list[int]:
        """Tokens of each row's prompt (its padding left out)."""
        return [int(n) for n in self._request.attention_mask.sum(axis=1)]

    def close(self) -> None:
        """Cancel the request if it is still running (its rows go to other requests)."""
        if not self._done:
            self._done = True
            self._engine.cancel(self._request)

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._engine.cancel(self._request)


class Generator:
    """An artifact loaded onto a backend, ready to generate. Build with ``runtime.load``."""

    def __init__(self, directory, manifest: Manifest, backend: Backend, tokenizer, max_batch: int | None = None,
                 max_length: int | None = None, max_queue: int | None = None,
                 prefill_chunk: int | str | None = DEFAULT_PREFILL_CHUNK, prefix_cache_mb: float = 0,
                 batch_invariant: bool | None = None):
        self.directory = Path(directory)
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        limit = manifest.model.max_position_embeddings
        rows_limit, length_limit = backend.limits()  # e.g. what TensorRT engines were built for
        if max_batch is None:
            max_batch = min(DEFAULT_MAX_BATCH, rows_limit or DEFAULT_MAX_BATCH)
        if max_length is None:
            max_length = min(limit, length_limit or limit)
        for name, value, low, high in (("max_batch", max_batch, 1, None), ("max_length", max_length, 2, limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bound = f"in [{low}, {high}] (max_position_embeddings)" if high else f">= {low}"
                raise InvalidArgumentError(f"{name} must be an int {bound}, got {value!r}")
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
            raise InvalidArgumentError(f"max_queue must be None or an int >= 0, got {max_queue!r}")
        if prefill_chunk not in (None, AUTO) and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                                  or prefill_chunk < 1):
            raise InvalidArgumentError(f"prefill_chunk must be 'auto', None or an int >= 1, got {prefill_chunk!r}")
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) or prefix_cache_mb < 0:
            raise InvalidArgumentError(f"prefix_cache_mb must be a number >= 0 (0: no prompt reuse), got {prefix_cache_mb!r}")
        if batch_invariant not in (None, True, False):
            raise InvalidArgumentError(f"batch_invariant must be None (on for int8/int4 weights), True or False, "
                                       f"got {batch_invariant!r}")
        backend.check_limits(max_batch, max_length)
        self.max_batch, self.max_length = max_batch, max_length
        entry = manifest.policy.get("deep_copies")  # the manifest's deep copies, parsed once (checked at load)
        self.named_copies = None if entry is None else DeepCopies.from_manifest(entry, manifest.model.num_layers)
        self.engine = Engine(backend, manifest.model.num_layers, max_batch, max_length, manifest.page_size,
                             max_queue, prefill_chunk)
        # int8/int4 layers quantize their activations, where float noise shifts a rounding and then
        # the text: each row's prompt runs alone (no other prompt's padding), in chunks that end at
        # its own pages alone as under load (no chunk sized by the load), where reused prefixes end
        self.batch_invariant = self.engine.scheduler.batch_invariant = (manifest.quantized if batch_invariant is None
                                                               else batch_invariant)
        if prefix_cache_mb and type(self.engine.cache.storage).read is KVStorage.read:
            warnings.warn(f"prefix_cache_mb={prefix_cache_mb:g}: the {type(backend).__name__}'s KV storage cannot copy a "
                          f"row's K/V out, so prompts are not reused on it", stacklevel=3)
        elif prefix_cache_mb:  # whole pages of prompts that ran, for the rows that start with them
            self.engine.scheduler.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20), manifest.page_size)
        # json_schema's compiler, over the artifact's tokenizer; llguidance loads on the first schema
        self.structured = Structured(self.directory / manifest.tokenizer_dir / "tokenizer.json",
                                     manifest.model.vocab_size, manifest.model.eos_ids)

    @property
    def num_layers(self) -> int:
        return self.manifest.model.num_layers

    def policy_for(self, max_new_tokens: int | None = None, policy=None, speedup: float | None = None, *,
                   config: GenerationConfig | None = None, **fields) -> SkipPolicy:
        """The policy a call with these arguments runs (``config`` with ``max_new_tokens``,
        ``policy``, ``speedup`` and GenerationConfig's other ``fields`` over it): the module-level
        ``policy_for``, the one route from a call's arguments to its SkipPolicy."""
        given = {"max_new_tokens": max_new_tokens, "policy": policy, "speedup": speedup}
        return policy_for(self.manifest, GenerationConfig.build(
            config, **{k: v for k, v in given.items() if v is not None}, **fields))

    def stream(self, prompts: str | Sequence[str], max_new_tokens: int | None = None, *, events: bool = True,
               logits: bool = True, **kwargs) -> GenerationStream:
        """Like ``generate``, but yields a TokenEvent per step as tokens are produced. ``events=False``:
        none (the stream ends with its ``result``; ``step_times`` still says when each step's tokens
        came): a caller that waits for the whole result is then not woken at every step of the
        engine's thread, which on a busy engine slowed every step by a third (docs/benchmarks.md,
        "Rows at different depths"). ``logits=False``: events without the step's logits
        (``TokenEvent.logits`` None), so that greedy rows' tokens may be picked where the logits are
        (a GPU's: runtime.backends.base, ``DecodeStep.argmax``)."""
        request = self.request(prompts, max_new_tokens, **kwargs)
        request.streams, request.logits = events, logits
        self.engine.submit(request)
        return GenerationStream(self.engine, request)

    def request(self, prompts: str | Sequence[str], max_new_tokens: int | None = None, *,
                config: GenerationConfig | None = None, **kwargs) -> Request:
        """The engine request of a ``generate`` call, checked and tokenized (not yet submitted).

        The generation's arguments are ``config`` (a GenerationConfig; default: its defaults) with
        ``max_new_tokens`` and the keyword arguments (GenerationConfig's field names) applied over
        it. ``prompts`` may also be token ids (a list of lists of ints), run as given.
        ``logprobs=k`` records every generated token's log-probability and its k most likely
        alternatives (``GenerationResult.logprobs``, ``TokenEvent.logprobs``)."""
        if max_new_tokens is not None:
            kwargs["max_new_tokens"] = max_new_tokens
        c = GenerationConfig.build(config, **kwargs)
        vocab = self.manifest.model.vocab_size
        ids = _token_id_rows(prompts, vocab)
        prompts = ids if ids is not None else validate.check_prompts(prompts)
        max_new_tokens = validate.check_max_new_tokens(c.max_new_tokens)
        eos = validate.check_eos(c.eos_token_id, vocab, self.manifest.model.eos_ids, c.ignore_eos)
        stops = validate.check_stop_strings(c.stop_strings)
        if c.logprobs is not None and (isinstance(c.logprobs, bool) or not isinstance(c.logprobs, int)
                                       or not 0 <= c.logprobs <= vocab):
            raise InvalidArgumentError(f"logprobs must be None or an int in [0, {vocab}] (the vocabulary), "
                                       f"got {c.logprobs!r}", param="logprobs")
        chosen = policy_for(self.manifest, c)
        constraint = None if c.json_schema is None else self.structured.compile(c.json_schema)
        if ids is not None:
            width = max(map(len, ids))
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            input_ids = np.array([[pad] * (width - len(r)) + r for r in ids], dtype=np.int64)  # (B, T0)
            attention_mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in ids], dtype=np.int64)
        else:
            enc = self.tokenizer(prompts, padding=True, return_tensors="np")
            input_ids = enc["input_ids"].astype(np.int64)  # (B, T0), left padded
            attention_mask = enc["attention_mask"].astype(np.int64)  # (B, T0)
            validate.check_nonempty_rows(attention_mask, prompts)
        # Each row runs alone as far as its KV is concerned (the engine cuts the padding that all
        # rows seated together share), so each row's own length is what must fit.
        longest = int(attention_mask.sum(axis=1).max())
        validate.check_length(longest, max_new_tokens, self.max_length,
                              limit_name=f"max_length {{limit}} of this Generator (the model's "
                                         f"max_position_embeddings is {self.manifest.model.max_position_embeddings})",
                              last_resort="load with a larger max_length")
        copies = deep_copies(self.named_copies, self.manifest.model.num_layers, c, chosen)
        return Request(input_ids, attention_mask, max_new_tokens, chosen, c.sampling(), eos, stops,
                       [IncrementalDetokenizer(self.tokenizer) for _ in prompts], c.logprobs, config=c,
                       constraint=constraint, lossless=c.lossless,
                       # a model fine-tuned under SkipDecode (its manifest keeps the trained horizon) ran
                       # each step's own set in training: a better draft than an untuned model's
                       trained=self.manifest.policy.get("horizon") is not None,
                       copies=copies, prompts=None if copies is None else [
                           self.tokenizer.decode(r[m.astype(bool)], skip_special_tokens=True)
                           for r, m in zip(input_ids, attention_mask)])

    def stepper(self) -> "Stepper":
        """A synchronous driver of this Generator's engine for an app's own loop (no threads).
        See ``Stepper``."""
        return Stepper(self)

    def generate(self, prompts, max_new_tokens: int | None = None, *,
                 streamer: Callable[[TokenEvent], None] | None = None, logits: bool = True,
                 **kwargs) -> GenerationResult:
        """Generate for a batch of prompts: ``config=`` a GenerationConfig and/or its fields as
        keyword arguments (``max_new_tokens`` default 32). See ``runtime.generate``. ``logits=False``:
        the streamer's events without the step's logits (``stream``)."""
        with self.stream(prompts, max_new_tokens, events=streamer is not None, logits=logits, **kwargs) as stream:
            for event in stream:  # (none without a streamer)
                streamer(event)
        return stream.result

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """End the engine and release the backend. Waits for the running and queued requests to
        finish; ``cancel=True`` ends them at once instead (their streams raise EngineClosedError).
        An open stepper is closed first, which cancels its requests (nothing else would step them)."""
        if self.engine.stepper is not None:
            self.engine.stepper.close()
        self.engine.close(cancel=cancel, timeout=timeout)
        self.backend.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepRequest:
    """A request added to a Stepper: its events so far, and its result once done."""

    def __init__(self, request: Request):
        self._request = request
        self.events: list[TokenEvent] = []
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.done = False

    def _drain(self) -> list[TokenEvent]:
        new = []
        while True:
            try:
                item = self._request.events.get_nowait()
            except queue.Empty:
                return new
            if item is DONE:
                self.done = True
            elif isinstance(item, GenerationResult):
                self.result = item
            elif isinstance(item, BaseException):
                self.error = item
            else:
                new.append(item)
                self.events.append(item)


class Stepper:
    """Decoding driven by the caller's own loop, with no threads: a robot's control tick or a UI
    frame calls ``step()`` when it has time (the spirit of onnxruntime-genai's ``Generator``)::

        stepper = gen.stepper()
        req = stepper.add("name[The Eagle], food[French]", 32, speedup=2)
        while not stepper.done:
            for r, event in stepper.step():  # the tokens of this step, request by request
                print(event.texts[0], end="")
        print(req.result.texts[0])

    ``add`` takes what ``Generator.generate`` takes. A step is one round of the engine, the same one
    ``generate``/``stream`` run from their worker thread: a prefill chunk of a joining request and
    one token for every decoding row. A Generator is driven one way at a time: ``stepper()`` is
    refused once ``generate``/``stream`` started its worker thread, and they are refused while a
    stepper is open (``close()`` it, or use it as a context manager).
    """

    def __init__(self, generator: Generator):
        self._generator, engine = generator, generator.engine
        with engine.lock:
            if engine.closing:
                raise EngineClosedError("this Generator is closed; load the artifact again")
            if engine.thread is not None or engine.stepper is not None:
                raise InvalidArgumentError(
                    "this Generator is already driven by " + ("another stepper" if engine.stepper else
                    "its worker thread (generate/stream were called)") + "; load another Generator "
                    "for a step loop")
            engine.stepper = self
        self._engine = engine
        self._requests: list[StepRequest] = []

    def add(self, prompts, max_new_tokens: int | None = None, *, logits: bool = True, **kwargs) -> StepRequest:
        """Queue a request; its rows join at the next steps, as KV rows free up. ``logits=False``:
        its events without the step's logits (``Generator.stream``)."""
        if self._engine.stepper is not self:
            raise InvalidArgumentError("this stepper is closed")
        handle = StepRequest(self._generator.request(prompts, max_new_tokens, **kwargs))
        handle._request.logits = logits
        self._engine.submit(handle._request, thread=False)
        self._requests.append(handle)
        return handle

    def cancel(self, handle: StepRequest) -> None:
        """End ``handle``'s request at the next step; its rows go to the others. Its ``result`` then
        holds the tokens it had, with finish reason "cancelled" for the rows still running."""
        self._engine.cancel(handle._request)

    def step(self) -> list[tuple[StepRequest, TokenEvent]]:
        """One round of the engine; the events it produced, in order. A request that failed has
        ``error`` set (it does not stop the others)."""
        if self._engine.stepper is not self:
            raise InvalidArgumentError("this stepper is closed")
        self._engine.step()
        out = [(h, e) for h in self._requests for e in h._drain()]
        self._requests = [h for h in self._requests if not h.done]
        return out

    @property
    def done(self) -> bool:
        """No request running or waiting."""
        return not self._engine.busy

    def close(self) -> None:
        """Cancel what is still running and give the Generator back (to generate/stream or a new stepper)."""
        if self._engine.stepper is self:
            for h in self._requests:
                self._engine.cancel(h._request)
            while self._engine.busy:
                self._engine.step()
            for h in self._requests:
                h._drain()
            self._engine.stepper = None

    def __enter__(self) -> "Stepper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _token_id_rows(prompts, vocab_size: int) -> list[list[int]] | None:
    """``prompts`` as token-id rows when it is a non-empty list of non-empty lists of ints (checked
    against the vocabulary), else None (text prompts, checked by validate.check_prompts)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts \
            or not all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
        return None
    rows = []
    for i, p in enumerate(prompts):
        row = [int(t) for t in p if isinstance(t, (int, np.integer)) and not isinstance(t, bool)]
        if not row or len(row) != len(p):
            raise InvalidArgumentError(f"token-id prompt {i} must be a non-empty list of ints, got {list(p)!r}",
                param="prompts")
        outside = [t for t in row if not 0 <= t < vocab_size]
        if outside:
            raise InvalidArgumentError(f"token-id prompt {i} holds {outside[0]}, outside the vocabulary "
                                       f"[0, {vocab_size - 1}] of this model", param="prompts")
        rows.append(row)
    return rows


def policy_for(manifest: Manifest, config: GenerationConfig) -> SkipPolicy:
    """The policy a call runs, from its GenerationConfig and the artifact's manifest: the one route
    from the API's arguments, the CLI's flags and the server's fields to a SkipPolicy. Explicit
    ``policy`` (a SkipPolicy, or a dict of its fields or of ``speedup`` and the shape:
    SkipPolicy.from_fields), a ``speedup`` target, or the manifest default.

    A policy's horizon is the one the manifest records (a model fine-tuned under SkipDecode
    must decay as in training), else the decode steps of the call (``max_new_tokens - 1``: the
    first new token comes from the full-depth prompt pass), so the decay spans the generation.
    ``decay``, ``exponent`` and ``prefill`` (SkipPolicy's fields) override the manifest's; a
    speedup target is then met under that decay curve. A lossless call's prompt runs at full depth
    (its verify passes read every layer's K/V).
    """
    chosen = _policy(manifest, config)
    if config.lossless and chosen.prefill != "full":  # the artifact's default: verify passes read every layer
        chosen = dataclasses.replace(chosen, prefill="full")
    return chosen


def deep_copies(named: DeepCopies | None, num_layers: int, config: GenerationConfig,
                policy: SkipPolicy) -> DeepCopies | None:
    """The deep-copy setting a call runs under (runtime.decoding.copying): the one the manifest
    ``named``, unless the call turns it off; a default one where the call turns it on. None where
    nothing skips (full depth, lossless rows) or the prompt skips layers too (a deep step reads
    the prompt's K/V at every layer it runs)."""
    on = config.deep_copies if config.deep_copies is not None else named is not None
    if not on or config.lossless or policy.is_full_depth:
        return None
    if policy.prefill != "full":
        if config.deep_copies:
            raise InvalidArgumentError("deep_copies=True reads the prompt's K/V at every layer a deep step "
                                       "runs: it needs prefill='full'", param="deep_copies")
        return None
    return named or DeepCopies.default(num_layers)


def _policy(manifest: Manifest, c: GenerationConfig) -> SkipPolicy:
    L = manifest.model.num_layers
    default = manifest.policy
    horizon = default.get("horizon") or max(c.max_new_tokens - 1, 1)
    policy, speedup = c.policy, c.speedup
    if policy is not None and speedup is not None:
        raise PolicyError("pass either policy= or speedup=, not both", param="speedup")
    given = {k: v for k, v in (("decay", c.decay), ("exponent", c.exponent), ("prefill", c.prefill))
             if v is not None}
    shape = {k: default[k] for k in ("decay", "exponent", "prefill") if k in default} | given
    if shape.get("decay", "linear") == "linear" and "exponent" not in given:
        shape.pop("exponent", None)  # a power decay's exponent means nothing to a linear one
    if policy is not None and not isinstance(policy, (dict, SkipPolicy)):
        raise PolicyError(f"policy must be a SkipPolicy or a dict of its fields, got {type(policy).__name__}",
                          param="policy")
    if not isinstance(policy, SkipPolicy):
        # the manifest's warm-up (the one a model was trained with) unless the call sets one
        fields = ({"speedup": speedup} if speedup is not None else policy if policy is not None
                  else {k: default.get(k) for k in ("max_layers", "min_layers")})
        fields = _own_policy(default, fields, given)
        return SkipPolicy.from_fields(L, {**shape, "warmup_layers": default.get("warmup_layers"), **fields}, horizon)
    if given and any(getattr(policy, k) != v for k, v in given.items()):
        raise PolicyError(f"{', '.join(given)} conflict with the SkipPolicy passed: set them on the "
                          f"policy itself (dataclasses.replace)", param=next(iter(given)))
    if policy.num_layers != L:
        raise PolicyError(f"policy is for {policy.num_layers} layers but the model has {L}", param="num_layers")
    return policy


def _own_policy(default: dict, fields: dict, given: dict) -> dict:
    """``fields`` with a speedup target the model has a policy of its own for (the manifest's
    ``speedup_policies``, measured on its task: runtime.policy.speedup_policies) replaced by that
    policy's budgets; as they are where the call sets anything else of the policy."""
    table, target = default.get("speedup_policies") or {}, fields.get("speedup")
    others = {k: v for k, v in fields.items() if k != "speedup" and v is not None}
    if target is None or given or (others and others != {"warmup_layers": default.get("warmup_layers")}):
        return fields
    for key, budgets in table.items():
        if float(key) == float(target):
            return {**{k: v for k, v in fields.items() if k != "speedup"}, **budgets}
    return fields


def load(directory, backend: str = "onnxruntime", check_hashes: bool | str = True, max_batch: int | None = None,
         max_length: int | None = None, max_queue: int | None = None,
         prefill_chunk: int | str | None = DEFAULT_PREFILL_CHUNK, prefix_cache_mb: float = 0,
         batch_invariant: bool | None = None, **backend_options) -> Generator:
    """Load an artifact directory written by ``python -m export build``.

    Validates the manifest and every file's size and sha256, opens the graphs on ``backend`` and
    checks their I/O names against the manifest. ``check_hashes``: True hashes only the files
    changed since they were last verified (runtime.artifact.integrity: an untouched artifact loads without
    hashing), "full" hashes every file, False none (see ``runtime.artifact.manifest.load_manifest``).
    max_batch: rows decoded together (KV rows); calls from any thread share them (default 8, or
        the backend's limit if lower, e.g. TensorRT engines built for fewer). A step costs what
        its running rows cost, so a lone request runs as fast on 8 rows as on 1; a call of more
        prompts than rows runs them as rows free up.
    max_length: positions per row, prompt + new tokens (default: the model's
        max_position_embeddings, or the backend's limit if lower, e.g. the engines' max_seq); the
        KV cache is preallocated for max_batch x max_length.
    max_queue: requests allowed to wait for a row (None: unbounded); past it, QueueFullError.
    prefill_chunk: prompt tokens a joining request runs per step while other rows decode: an int,
        "auto" (the default: chunks of about one decode step's time, adjusted as they run) or None
        (every prompt whole, stalling the running rows for its length).
    prefix_cache_mb: MiB of prompt prefixes' K/V kept for reuse (runtime.prefix_cache): a one-prompt
        request whose prompt starts with whole pages another's already ran takes their K/V and runs
        only the rest (exact). 0, the default here (the server's is 256), keeps none.
    batch_invariant: True runs each prompt's prefill alone, never padded beside another prompt of
        its call, in chunks of one page (``page_size`` positions) whether or not other rows decode,
        so that a row's greedy text is the one it gets alone (docs/design.md, "Batch invariance";
        a call of several prompts reaches its first tokens ~17% later; ``prefill_chunk`` is then
        unused); None, the default, is True for int8/int4 weights (whose activation rounding turns
        float noise into other tokens) and False for float ones.
    ``backend_options`` go to the backend (onnxruntime: ``providers``, ``threads``, and ``spin``:
        False, the default, makes its worker threads sleep whenever they wait; True lets them
        busy-wait, for a device whose cores no other process uses; "auto" (the command lines'
        default) spins where no other process uses the cores at load (runtime.platform.cpu_idle): spinning
        runs every ONNX Runtime session of the process on one shared pool; ``huge_pages``: True
        moves the weights it packed onto 2 MiB pages where Linux allows, ~2 ms per MiB at load
        for a faster decode, runtime/platform/hugepages.py; ``int4_kernel``: "auto", the default, runs an
        int4 artifact's products on this project's kernel where it can run (x86-64 Linux with
        AVX-512 VNNI or AVX2, a C compiler: runtime/platform/kernels), else on ONNX Runtime's MatMulNBits; "skipdecode"
        insists on the former, "onnxruntime" on the latter (the torch backend: "auto", its Triton kernel on
        a GPU, or "tinygemm", PyTorch's own int4 product); ``deterministic``: True runs every int8/int4
        product at float activations (as the export writes them by default), where MatMulNBits too
        (1.2x-40x slower), so that greedy text does not depend on the batch; False, the default, runs
        MatMulNBits' at int8 activations, docs/design.md "Batch invariance").
    """
    validate.check_backend_options(backend_options)
    manifest = load_manifest(directory, check_hashes=check_hashes)
    tokenizer = load_tokenizer(Path(directory) / manifest.tokenizer_dir, manifest.model.pad_token_id)
    return Generator(directory, manifest, create_backend(backend, directory, manifest, **backend_options),
                     tokenizer, max_batch=max_batch, max_length=max_length, max_queue=max_queue,
                     prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb, batch_invariant=batch_invariant)


def generate(model, prompts, max_new_tokens: int | None = None, **kwargs) -> GenerationResult:
    """Generate text with SkipDecode.

    model: an artifact directory or a Generator from ``runtime.load``.
    prompts: a string or a list of strings (batched with left padding), or token ids (a list of
        lists of ints, run as given: no BOS added).
    The generation's arguments: ``config=`` a GenerationConfig, and/or its fields as keyword
        arguments (runtime/generation_config.py says what each does and its default):
        max_new_tokens (32); the skip policy: speedup (a horizon speedup target, e.g. 2 picks
        min/max layers for L/2 layers on average over the decode steps) or policy (a SkipPolicy or
        a dict of its fields), neither = the artifact's default (full depth unless set at export),
        and decay, exponent, prefill (the policy's shape, overriding the artifact's); sampling as
        in transformers (do_sample, temperature, top_k, top_p, seed) with OpenAI's
        presence_penalty and frequency_penalty; when a row ends (eos_token_id, ignore_eos,
        stop_strings: a row stopped by a stop string keeps it, with the rest of the token that
        completed it, as transformers; the server leaves it out, as OpenAI); logprobs.
    streamer: called with a TokenEvent after every step; ``logits=False``: its events without the
        step's logits (TokenEvent.logits None), so that greedy rows' tokens may be picked on a GPU.
    Keyword arguments of ``runtime.load`` and of the backends (backend, check_hashes, providers,
    threads, spin, huge_pages, fused, int4_kernel, deterministic, device, cuda_graphs, compile_steps, engine_dir) apply
    when ``model`` is a directory.
    """
    # what is not the generation's (GenerationConfig's fields, config, streamer, logits) is runtime.load's
    # and the backend's, which check it
    load_keys = set(kwargs) - {*FIELDS, "config", "streamer", "logits"}
    if isinstance(model, Generator):
        if load_keys:
            raise InvalidArgumentError(
                f"{sorted(load_keys)} apply only when model is a directory; pass them to runtime.load "
                f"instead (generation arguments are GenerationConfig's fields: {', '.join(FIELDS)})",
                param=sorted(load_keys)[0])
        return model.generate(prompts, max_new_tokens, **kwargs)
    load_kwargs = {k: kwargs.pop(k) for k in load_keys}
    load_kwargs.setdefault("max_batch", 1 if isinstance(prompts, str) else
                           min(max(len(prompts or ()), 1), DEFAULT_MAX_BATCH))
    generator = load(model, **load_kwargs)
    try:
        return generator.generate(prompts, max_new_tokens, **kwargs)
    finally:
        generator.close()
