"""min/opt/max and run shapes for one graph, from the manifest's named dims and the CLI limits.

Two phases, as the engines use them (issue 3):
  decode:  sequence 1, past 0 .. max_seq-1       (one new token per step over a growing KV cache)
  prefill: sequence 1 .. max_prompt, past 0      (the prompt at full depth from an empty cache)
The layers' bound past is whole pages (manifest kv_cache.page_size) wide enough for the past and
the step's new positions (runtime.kvcache.bound_width): a step of s tokens at past p > 0 binds
past_sequence = ceil((p + s) / page) * page, so a decode step at p binds ceil((p + 1) / page)
pages, and a prefill (p = 0) one page of zeros, masked; total_sequence = past_sequence + s. The embedding has no
past input but gets the layers' mask (bound past + new positions), as the runtime passes it.
The opt point is the run point: the kernels are tuned for the shape being measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.artifact.manifest import GraphSpec
from runtime.kvcache import bound_width

from .errors import ProfileLimitError

DIM_NAMES = ("batch", "sequence", "past_sequence", "total_sequence")  # every dynamic dim the export writes
PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class Limits:
    batch: int = 1  # batch of the run, also the profile's opt batch
    sequence: int = 1  # tokens per step in the run: 1 to decode, the prompt length to prefill
    past: int = 0  # cached positions in the run (decode); prefill always has 0
    max_batch: int | None = None  # profile's max batch; None: the run's batch
    max_seq: int | None = None  # most positions past + sequence may reach; None: max_position_embeddings
    max_prompt: int | None = None  # prefill profile's max sequence; None: max_seq
    phase: str | None = None  # "decode" or "prefill"; None: decode when sequence == 1, else prefill


@dataclass(frozen=True)
class Profile:
    phase: str  # "decode" or "prefill"
    min: dict  # a point (see _point), for --minShapes
    opt: dict  # for --optShapes
    max: dict  # for --maxShapes
    run: dict  # for --shapes: the point that is timed


def _point(batch: int, sequence: int, past: int, page: int) -> dict:
    """One point of a profile: ``past`` cached positions (0 for a prefill), bound as a past
    ``past_sequence`` wide (``bound_width``); the graph's own sizes come from shape_spec."""
    return {"batch": batch, "sequence": sequence, "past": past,
            "past_sequence": bound_width(past, sequence, page), "page_size": page}


def graph_sizes(graph: GraphSpec, point: dict) -> dict:
    """The point's dim sizes for ``graph``: every mask (the embedding's too) covers the bound past
    and the new positions."""
    return {"batch": point["batch"], "sequence": point["sequence"], "past_sequence": point["past_sequence"],
            "total_sequence": point["past_sequence"] + point["sequence"]}


def resolve_profile(limits: Limits, max_position_embeddings: int, page_size: int) -> Profile:
    """Check the limits against each other and the model, then place the profile's points.

    page_size: the artifact's KV page (``Manifest.page_size``)."""
    b, s, p = limits.batch, limits.sequence, limits.past
    if b < 1 or s < 1 or p < 0:
        raise ProfileLimitError(
            f"batch {b}, sequence {s}, past {p}: batch and sequence must be >= 1 and past >= 0")
    max_batch = limits.max_batch if limits.max_batch is not None else b
    if max_batch < b:
        raise ProfileLimitError(f"--batch {b} exceeds --max-batch {max_batch}; raise --max-batch to at least {b}")
    max_seq = limits.max_seq if limits.max_seq is not None else max_position_embeddings
    if not 1 <= max_seq <= max_position_embeddings:
        raise ProfileLimitError(
            f"--max-seq {max_seq} is outside 1..{max_position_embeddings} (the model's "
            f"max_position_embeddings); use --max-seq {max_position_embeddings} or less")
    phase = limits.phase or ("decode" if s == 1 else "prefill")
    if phase == "decode":
        return _decode_profile(b, s, p, max_batch, max_seq, page_size)
    if phase == "prefill":
        return _prefill_profile(b, s, p, max_batch, max_seq, limits.max_prompt, page_size)
    raise ProfileLimitError(f"phase {phase!r} is not one of {', '.join(PHASES)}")


def _decode_profile(b: int, s: int, p: int, max_batch: int, max_seq: int, page: int) -> Profile:
    if s != 1:
        raise ProfileLimitError(
            f"the decode profile runs 1 token per step, got --seq {s}; use --seq 1, or --phase prefill "
            f"for a {s}-token prompt")
    if p + s > max_seq:
        raise ProfileLimitError(
            f"past {p} + sequence {s} = {p + s} positions exceed max_seq {max_seq}; use --past {max_seq - s} "
            f"or less, or raise --max-seq (at most max_position_embeddings)")
    run = _point(b, 1, p, page)
    return Profile("decode", _point(1, 1, 0, page), run, _point(max_batch, 1, max_seq - 1, page), run)


def _prefill_profile(b: int, s: int, p: int, max_batch: int, max_seq: int, max_prompt: int | None,
                     page: int) -> Profile:
    if p != 0:
        raise ProfileLimitError(
            f"the prefill profile starts from an empty KV cache (past 0), got --past {p}; use --past 0, "
            f"or --seq 1 to profile decode at past {p}")
    max_prompt = max_prompt if max_prompt is not None else max_seq
    if not 1 <= max_prompt <= max_seq:
        raise ProfileLimitError(
            f"--max-prompt {max_prompt} is outside 1..max_seq {max_seq}; use --max-prompt {max_seq} or less")
    if s > max_prompt:
        raise ProfileLimitError(f"--seq {s} exceeds --max-prompt {max_prompt}; use --seq {max_prompt} or less, "
                                f"or raise --max-prompt")
    run = _point(b, s, 0, page)  # the prompt over one page of zeros
    return Profile("prefill", _point(1, 1, 0, page), run, _point(max_batch, max_prompt, 0, page), run)


def shape_spec(graph: GraphSpec, point: dict) -> str:
    """trtexec's shape spec, ``name:d0xd1x...`` per input, comma-separated, in the graph's input order."""
    return ",".join(f"{name}:" + "x".join(map(str, dims)) for name, dims in input_dims(graph, point))


def input_dims(graph: GraphSpec, point: dict) -> list[tuple[str, list[int]]]:
    """(input name, its sizes at ``point``) in the graph's input order."""
    sizes = graph_sizes(graph, point)
    return [(t.name, [_size(graph, t.name, d, sizes) for d in t.dims]) for t in graph.inputs]


def _size(graph: GraphSpec, tensor: str, dim, sizes: dict) -> int:
    if isinstance(dim, int):
        return dim
    if dim not in sizes:
        raise ProfileLimitError(
            f"{graph.name}.{tensor} has dim {dim!r}, which this tool cannot size (it knows "
            f"{', '.join(DIM_NAMES)}); the artifact is from another exporter version: re-export it")
    return sizes[dim]
