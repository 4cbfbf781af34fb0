"""Batched SkipDecode generation: prefill at full depth, then per step embed, the policy's active
layers, head. The loop talks only to the Backend interface."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .backends import Backend, create_backend
from .detokenize import IncrementalDetokenizer
from . import validate
from .errors import InvalidArgumentError, PolicyError
from .manifest import Manifest, load_manifest
from .policy import SkipPolicy
from .sampling import SamplingConfig, select


@dataclass
class StepStats:
    step: int  # generation step g (its input is the g-th generated token)
    budget: int  # the policy's layer budget for this step
    layers: tuple[int, ...]  # layers the backend ran, in order
    seconds: float  # wall time of embed + layers + head
    num_layers: int  # L, for the ratios

    @property
    def theoretical_ratio(self) -> float:
        """L / budget: the speedup this step would give if time were proportional to layers."""
        return self.num_layers / self.budget

    @property
    def achieved_ratio(self) -> float:
        """L / layers actually run."""
        return self.num_layers / max(len(self.layers), 1)


@dataclass
class GenerationStats:
    num_layers: int
    batch_size: int
    prompt_tokens: int  # padded prompt length
    new_tokens: int  # tokens generated per row (until every row finished)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: list[StepStats] = field(default_factory=list)

    @property
    def layers_per_step(self) -> list[int]:
        return [len(s.layers) for s in self.steps]

    @property
    def theoretical_speedup(self) -> float:
        """L / mean(policy budget) over the decode steps run (1.0 when none ran)."""
        if not self.steps:
            return 1.0
        return self.num_layers * len(self.steps) / sum(s.budget for s in self.steps)

    @property
    def achieved_layer_ratio(self) -> float:
        """L / mean(layers the backend actually ran) over the decode steps."""
        if not self.steps:
            return 1.0
        return self.num_layers * len(self.steps) / sum(len(s.layers) for s in self.steps)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.batch_size * len(self.steps) / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "batch_size": self.batch_size,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6),
                "decode_seconds": round(self.decode_seconds, 6),
                "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
                "layers_per_step": self.layers_per_step,
                "theoretical_speedup": round(self.theoretical_speedup, 4),
                "achieved_layer_ratio": round(self.achieved_layer_ratio, 4)}

    def __repr__(self) -> str:
        return f"GenerationStats({self.to_dict()})"


@dataclass
class GenerationResult:
    texts: list[str]  # generated text per prompt (prompt excluded)
    token_ids: list[list[int]]  # generated ids per prompt, up to and including EOS / stop
    stats: GenerationStats
    policy: SkipPolicy


@dataclass
class TokenEvent:
    """One generation step, as streamed: the new token of every row still running."""

    step: int
    token_ids: list[int | None]  # None for rows that had already finished
    texts: list[str]  # text each row gained at this step ("" for finished rows)
    finished: list[bool]
    logits: np.ndarray  # (B, V) fp32 scores the tokens were chosen from, before sampling


class GenerationStream:
    """Iterator of TokenEvent; ``.result`` holds the GenerationResult once it is exhausted."""

    def __init__(self, events: Iterator[TokenEvent]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        self.result = yield from self._events


class Generator:
    """An artifact loaded onto a backend, ready to generate. Build with ``runtime.load``."""

    def __init__(self, directory, manifest: Manifest, backend: Backend, tokenizer):
        self.directory = Path(directory)
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer

    @property
    def num_layers(self) -> int:
        return self.manifest.model.num_layers

    def policy_for(self, max_new_tokens: int, policy=None, speedup: float | None = None) -> SkipPolicy:
        """The policy a call runs: explicit ``policy``, a ``speedup`` target, or the manifest default.

        A policy's horizon is the one the manifest records (a model fine-tuned under SkipDecode
        must decay as in training), else the decode steps of the call (``max_new_tokens - 1``: the
        first new token comes from the full-depth prompt pass), so the decay spans the generation.
        """
        L = self.num_layers
        default = self.manifest.policy
        horizon = default.get("horizon") or max(max_new_tokens - 1, 1)
        if policy is not None and speedup is not None:
            raise PolicyError("pass either policy= or speedup=, not both")
        if speedup is not None:
            return SkipPolicy.for_speedup(L, speedup, horizon=horizon,
                                          warmup_layers=default.get("warmup_layers", 1))
        if policy is None:
            return SkipPolicy(L, default["max_layers"], default["min_layers"],
                              default["warmup_layers"], horizon)
        if isinstance(policy, dict):
            policy = SkipPolicy(**{"num_layers": L, "horizon": horizon, **policy})
        if not isinstance(policy, SkipPolicy):
            raise PolicyError(f"policy must be a SkipPolicy or a dict of its fields, got {type(policy).__name__}")
        if policy.num_layers != L:
            raise PolicyError(f"policy is for {policy.num_layers} layers but the model has {L}")
        return policy

    def stream(self, prompts: str | Sequence[str], max_new_tokens: int = 32, *, policy=None,
               speedup: float | None = None, do_sample: bool = False, temperature: float = 1.0,
               top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
               eos_token_id: int | Sequence[int] | None = None, ignore_eos: bool = False,
               stop_strings: str | Sequence[str] | None = None) -> GenerationStream:
        """Like ``generate``, but yields a TokenEvent per step as tokens are produced."""
        prompts = validate.check_prompts(prompts)
        max_new_tokens = validate.check_max_new_tokens(max_new_tokens)
        eos = validate.check_eos(eos_token_id, self.manifest.model.vocab_size,
                                 self.manifest.model.eos_token_id, ignore_eos)
        stops = validate.check_stop_strings(stop_strings)
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        chosen = self.policy_for(max_new_tokens, policy, speedup)
        enc = self.tokenizer(prompts, padding=True, return_tensors="np")
        input_ids = enc["input_ids"].astype(np.int64)  # (B, T0), left padded
        attention_mask = enc["attention_mask"].astype(np.int64)  # (B, T0)
        validate.check_nonempty_rows(attention_mask, prompts)
        validate.check_length(int(attention_mask.sum(axis=1).max()), max_new_tokens,
                              self.manifest.model.max_position_embeddings)
        return GenerationStream(self._decode(input_ids, attention_mask, max_new_tokens, chosen,
                                             sampling, eos, stops))

    def generate(self, prompts, max_new_tokens: int = 32, *, streamer: Callable[[TokenEvent], None] | None = None,
                 **kwargs) -> GenerationResult:
        """Generate for a batch of prompts. See ``runtime.generate`` for the arguments."""
        stream = self.stream(prompts, max_new_tokens, **kwargs)
        for event in stream:
            if streamer is not None:
                streamer(event)
        return stream.result

    def _decode(self, input_ids, attention_mask, max_new_tokens, policy, sampling, eos, stops):
        backend, L = self.backend, self.num_layers
        B = input_ids.shape[0]
        pad = self.manifest.model.pad_token_id
        rng = np.random.default_rng(sampling.seed)
        stats = GenerationStats(L, B, input_ids.shape[1], 0)
        backend.reset(B, input_ids.shape[1] + max_new_tokens)

        start = time.perf_counter()
        hidden = backend.embed(input_ids, attention_mask)
        for i in range(L):  # the prompt runs at full depth
            hidden = backend.layer(i, hidden, attention_mask)
        logits = backend.head(hidden)  # (B, V)
        stats.prefill_seconds = time.perf_counter() - start

        texts = [""] * B
        detok = [IncrementalDetokenizer(self.tokenizer) for _ in range(B)]  # also holds each row's ids
        finished = np.zeros(B, dtype=bool)
        running = set(range(L))
        for g in range(max_new_tokens):
            tokens = select(logits, sampling, rng)  # (B,)
            tokens[finished] = pad
            event = TokenEvent(g, [None] * B, [""] * B, [False] * B, logits)
            last = g == max_new_tokens - 1
            for b in np.flatnonzero(~finished):
                token = int(tokens[b])
                delta = detok[b].add(token)
                if token in eos or last:
                    delta += detok[b].flush()
                text = texts[b] + delta
                hit = _first_stop(text, stops, len(texts[b]))
                if hit is not None:
                    text = text[:hit]
                event.token_ids[b], event.texts[b] = token, text[len(texts[b]):]
                texts[b] = text
                if token in eos or hit is not None:
                    finished[b] = True
            event.finished = finished.tolist()
            stats.new_tokens = g + 1
            yield event
            if last or finished.all():
                break

            step_start = time.perf_counter()
            active = policy.active_layers(g)
            for i in sorted(running.difference(active)):
                backend.release(i)  # the budget never grows back: this layer is done for the batch
            running.intersection_update(active)
            attention_mask = np.concatenate([attention_mask, np.ones((B, 1), np.int64)], axis=1)
            hidden = backend.embed(tokens[:, None], attention_mask)
            for i in active:
                hidden = backend.layer(i, hidden, attention_mask)
            logits = backend.head(hidden)
            seconds = time.perf_counter() - step_start
            stats.decode_seconds += seconds
            stats.steps.append(StepStats(g, policy.budget(g), active, seconds, L))
        return GenerationResult(texts, [d.tokens for d in detok], stats, policy)

    def close(self) -> None:
        self.backend.close()


def _first_stop(text: str, stops: list[str], new_from: int = 0) -> int | None:
    """End index of the earliest stop string in ``text`` (kept in the output, as transformers).

    Only matches that end after ``new_from`` (the text before it was searched at earlier steps)
    are looked for, so a step searches a bounded tail, not the whole text.
    """
    ends = []
    for s in stops:
        if s:
            found = text.find(s, max(new_from - len(s) + 1, 0))
            if found >= 0:
                ends.append(found + len(s))
    return min(ends) if ends else None


def load(directory, backend: str = "onnxruntime", check_hashes: bool | str = True, **backend_options) -> Generator:
    """Load an artifact directory written by ``python -m export build``.

    Validates the manifest and every file's size and sha256, opens the graphs on ``backend`` and
    checks their I/O names against the manifest. ``check_hashes``: True hashes only the files
    changed since they were last verified (runtime.integrity: an untouched artifact loads without
    hashing), "full" hashes every file, False none (see ``runtime.manifest.load_manifest``).
    ``backend_options`` go to the backend (onnxruntime: ``providers``, ``threads``).
    """
    validate.check_backend_options(backend_options)
    manifest = load_manifest(directory, check_hashes=check_hashes)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(directory) / manifest.tokenizer_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = manifest.model.pad_token_id
    return Generator(directory, manifest, create_backend(backend, directory, manifest, **backend_options),
                     tokenizer)


def generate(model, prompts, max_new_tokens: int = 32, **kwargs) -> GenerationResult:
    """Generate text with SkipDecode.

    model: an artifact directory or a Generator from ``runtime.load``.
    prompts: a string or a list of strings (batched with left padding).
    max_new_tokens: tokens to generate per prompt.
    speedup / policy: a theoretical speedup target (e.g. 2 picks min/max layers for L/2 layers on
        average over max_new_tokens steps), or a SkipPolicy / dict of its fields; neither = the
        artifact's default policy (full depth unless set at export).
    do_sample, temperature, top_k, top_p, seed: sampling, as in transformers.
    eos_token_id (int or list; default the model's), ignore_eos, stop_strings: when a row ends.
    streamer: called with a TokenEvent after every step.
    Keyword arguments of ``runtime.load`` and of the backends (backend, check_hashes, providers,
    threads, device, cuda_graphs, engine_dir) apply when ``model`` is a directory.
    """
    load_keys = {"backend", "check_hashes", "providers", "threads", "device", "cuda_graphs", "engine_dir"}
    if isinstance(model, Generator):
        if load_keys & kwargs.keys():
            raise InvalidArgumentError(
                f"{sorted(load_keys & kwargs.keys())} apply only when model is a directory; pass them "
                f"to runtime.load instead")
        return model.generate(prompts, max_new_tokens, **kwargs)
    load_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in load_keys}
    generator = load(model, **load_kwargs)
    try:
        return generator.generate(prompts, max_new_tokens, **kwargs)
    finally:
        generator.close()
