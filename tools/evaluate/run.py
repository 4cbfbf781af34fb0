"""Generation for one artifact at every speedup, interleaved per batch, with the decode timings.

Each unique prompt is generated once per speedup (greedy, until EOS or ``max_new_tokens``). For
every batch the speedups run one after another in an order shuffled with a fixed seed, so machine
noise (the training job beside it, turbo, caches) hits every policy alike. Round 0 gives the
hypotheses and the layer counts; rounds 1.. (``timing_rounds`` > 1) rerun the same batches for
timing only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    directory: str


@dataclass
class RunSettings:
    speedups: list[float]  # 1 = full depth
    max_new_tokens: int = 64
    batch_size: int = 16
    backend: str = "onnxruntime"
    threads: int | None = None
    timing_rounds: int = 1
    seed: int = 0
    progress: bool = True
    load_options: dict = field(default_factory=dict)  # extra runtime.load keyword arguments
    policy_options: dict = field(default_factory=dict)  # decay / exponent / prefill / deep_copies of the skipping policies


def batch_slices(n: int, size: int) -> list[range]:
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def generation_kwargs(generator, speedup: float, max_new_tokens: int, policy_options: dict | None = None) -> dict:
    """Keyword arguments of ``generate`` for a speedup target. Full depth is an explicit policy:
    without one the artifact's default policy applies, which may skip layers. ``policy_options``
    (decay, exponent, prefill) shape the skipping policies; full depth has no shape."""
    from runtime.policy import SkipPolicy

    if speedup == 1:
        return {"policy": SkipPolicy.full_depth(generator.num_layers, horizon=max(max_new_tokens - 1, 1))}
    options = dict(policy_options or {})
    generator.policy_for(max_new_tokens, speedup=speedup, **options)  # a PolicyError now, not mid-run
    return {"speedup": speedup, **options}


def _empty_run(speedup: float, n: int) -> dict:
    return {"speedup": speedup, "policy": None, "hypotheses": [None] * n, "decode_tokens": 0,
            "layers_run": 0, "deep_steps": 0, "filled_positions": 0, "generated_tokens": 0, "prefill_seconds": 0.0,
            "timing": {"rounds": 0, "decode_seconds": 0.0, "decode_steps": 0, "prefill_seconds": 0.0,
                       "round_decode_seconds": [], "round_decode_steps": []}}


def run_model(spec: ModelSpec, prompts: list[str], settings: RunSettings) -> dict:
    """Generate ``prompts`` with the artifact at every speedup; the model's raw results."""
    import runtime
    from runtime.policy import SkipPolicy
    from tqdm import tqdm

    options = dict(settings.load_options)
    if settings.threads is not None:
        options["threads"] = settings.threads
    options.setdefault("max_batch", settings.batch_size)  # KV slots for one evaluation batch
    generator = runtime.load(spec.directory, backend=settings.backend, **options)
    try:
        kwargs = {s: generation_kwargs(generator, s, settings.max_new_tokens, settings.policy_options)
                  for s in settings.speedups}
        runs = {s: _empty_run(s, len(prompts)) for s in settings.speedups}
        # untimed warm-up: every layer's session runs once, in a prefill and in a decode step
        generator.generate(prompts[:1], min(2, settings.max_new_tokens),
                           policy=SkipPolicy.full_depth(generator.num_layers))
        slices = batch_slices(len(prompts), settings.batch_size)
        rng = random.Random(settings.seed)
        total = settings.timing_rounds * len(slices) * len(settings.speedups)
        with tqdm(total=total, desc=spec.name, unit="batch", disable=not settings.progress,
                  dynamic_ncols=True) as bar:
            for round_ in range(settings.timing_rounds):
                for run in runs.values():
                    run["timing"]["round_decode_seconds"].append(0.0)
                    run["timing"]["round_decode_steps"].append(0)
                for rows in slices:
                    order = list(settings.speedups)
                    rng.shuffle(order)
                    for s in order:
                        result = generator.generate([prompts[i] for i in rows], settings.max_new_tokens,
                                                    **kwargs[s])
                        _record(runs[s], result, rows, first_round=round_ == 0)
                        bar.update()
                for run in runs.values():
                    run["timing"]["rounds"] += 1
        m = generator.manifest
        return {"name": spec.name, "dir": str(spec.directory),
                "resolved_dir": str(Path(spec.directory).resolve()),
                "num_layers": generator.num_layers, "dtype": m.dtype, "manifest_policy": m.policy,
                "source": m.source, "runs": [runs[s] for s in sorted(runs)]}
    finally:
        generator.close()


def _record(run: dict, result, rows: range, first_round: bool) -> None:
    stats = result.stats
    run["timing"]["decode_seconds"] += stats.decode_seconds
    run["timing"]["decode_steps"] += stats.decode_calls
    run["timing"]["prefill_seconds"] += stats.prefill_seconds
    run["timing"]["round_decode_seconds"][-1] += stats.decode_seconds
    run["timing"]["round_decode_steps"][-1] += stats.decode_calls
    if not first_round:
        return
    policy = result.policy.to_dict()
    if run["policy"] is None:
        run["policy"] = policy
    elif run["policy"] != policy:  # generate picks the policy from max_new_tokens, the same per call
        raise AssertionError(f"speedup {run['speedup']:g}: policy changed between batches: "
                             f"{run['policy']} then {policy}")
    for i, text in zip(rows, result.texts):
        run["hypotheses"][i] = text.strip()
    tokens, layers = stats.row_steps  # per token: a deep copy's row runs more layers than its batch
    run["decode_tokens"] += tokens
    run["layers_run"] += layers
    run["deep_steps"] += stats.deep_steps
    run["filled_positions"] += stats.filled_positions
    run["generated_tokens"] += sum(len(ids) for ids in result.token_ids)
    run["prefill_seconds"] += stats.prefill_seconds
