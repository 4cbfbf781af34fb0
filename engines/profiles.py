"""Optimization profiles for the two phases of generation, derived from the manifest's dims.

Profile 0, prefill: the prompt (or a chunk of it) at full depth, sequence 1..max_prompt, over a
                   bound past of past_sequence page..(max_seq in whole pages) positions (one page of zeros
                   for a prompt's first chunk, its rows' block at the cache's width for later ones).
Profile 1, decode:  one token per step over past_sequence page..(max_seq in whole pages) positions.

The bound past width (past_sequence) is always whole pages of the manifest's kv_cache.page_size,
at least one, wide enough for the longest row in use once it holds the step's new positions
(runtime.kvcache), so at most max_seq rounded up to pages. The attention mask covers the bound
past and the new positions, so total_sequence = past_sequence + sequence in both profiles, at min,
opt and max. The embedding has no past input but gets the same mask as the layers.

Every input of every graph (embed, layers, head) gets min/opt/max from its manifest dims: fixed
ints stay fixed, names come from the table below. opt sits mid-range, as TensorRT-LLM does for its
batch and sequence dims, so tactics are tuned for a typical rather than an extreme shape. The
decode profile's shapes all lie inside the prefill profile's too; the runtime picks the profile per
call with ``choose_profile``, naming the phase it runs (``prefer``).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.artifact.manifest import GraphSpec
from runtime.kvcache import bound_width, pages_width

from .config import EngineBuildConfig
from .errors import EngineConfigError, EngineLimitError

PREFILL, DECODE = 0, 1
PROFILE_NAMES = ("prefill", "decode")


@dataclass(frozen=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def contains(self, shape) -> bool:
        shape = tuple(shape)
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max))

    def to_dict(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    @classmethod
    def from_dict(cls, d: dict) -> "ShapeRange":
        return cls(tuple(d["min"]), tuple(d["opt"]), tuple(d["max"]))


@dataclass(frozen=True)
class Profile:
    name: str  # "prefill" or "decode"
    shapes: dict  # input name -> ShapeRange

    def contains(self, shapes: dict) -> bool:
        return all(name in self.shapes and self.shapes[name].contains(shape)
                   for name, shape in shapes.items())

    def to_dict(self) -> dict:
        return {"name": self.name, "shapes": {k: v.to_dict() for k, v in self.shapes.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(d["name"], {k: ShapeRange.from_dict(v) for k, v in d["shapes"].items()})


def _mid(hi: int) -> int:
    return max(1, (hi + 1) // 2)


def dim_ranges(config: EngineBuildConfig, page_size: int) -> list[dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of every named dim, per profile (prefill, decode); the same for every graph
    (the embedding's mask is the layers')."""
    b, p, page = config.max_batch, config.prompt_limit, page_size
    widest = pages_width(config.max_seq, page)
    batch, sequence = (1, _mid(b), b), (1, _mid(p), p)
    # total = past + sequence at min, opt and max, so opt is a shape that really occurs
    prefill_past = (page, bound_width(0, sequence[1], page), widest)  # opt: a prompt into fresh rows
    decode_past = (page, _mid(widest // page) * page, widest)
    return [{"batch": batch, "sequence": sequence, "past_sequence": prefill_past,
             "total_sequence": tuple(w + n for w, n in zip(prefill_past, sequence))},
            {"batch": batch, "sequence": (1, 1, 1), "past_sequence": decode_past,
             "total_sequence": tuple(w + 1 for w in decode_past)}]


def graph_profiles(spec: GraphSpec, config: EngineBuildConfig, page_size: int) -> list[Profile]:
    """The prefill and decode profiles of one graph, one ShapeRange per input.

    page_size: the artifact's KV page (``Manifest.page_size``).
    """
    profiles = []
    for name, ranges in zip(PROFILE_NAMES, dim_ranges(config, page_size)):
        shapes = {}
        for tensor in spec.inputs:
            per_dim = []
            for dim in tensor.dims:
                if isinstance(dim, int):
                    per_dim.append((dim, dim, dim))
                elif dim in ranges:
                    per_dim.append(ranges[dim])
                else:
                    raise EngineConfigError(
                        f"graph {spec.name} input {tensor.name} has dim {dim!r}, which no "
                        f"optimization profile knows (expected an int or one of {sorted(ranges)}); "
                        f"the artifact is from another exporter: re-export with `python -m export build`")
            shapes[tensor.name] = ShapeRange(*(tuple(d[i] for d in per_dim) for i in range(3)))
        profiles.append(Profile(name, shapes))
    return profiles


def choose_profile(profiles: list[Profile], shapes: dict, current: int | None = None,
                   graph: str = "graph", prefer: int | None = None) -> int:
    """Index of a profile that holds every input shape: ``prefer`` when it does, else the current
    one when it does, else the first that does.

    Staying on the current profile avoids a switch (each switch invalidates the context's input
    shapes and may enqueue setup copies). ``prefer`` is for callers that know the phase: every
    decode step also fits the prefill profile, whose kernels are tuned for long prompts.
    """
    for index in (prefer, current):
        if index is not None and 0 <= index < len(profiles) and profiles[index].contains(shapes):
            return index
    for index, profile in enumerate(profiles):
        if profile.contains(shapes):
            return index
    limits = "; ".join(
        f"{p.name}: " + ", ".join(f"{n} {list(r.min)}..{list(r.max)}" for n, r in p.shapes.items())
        for p in profiles)
    got = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
    raise EngineLimitError(
        f"{graph}: input shapes {got} fit no optimization profile ({limits}); rebuild the engines "
        f"with larger --max-batch / --max-seq / --max-prompt")
