"""Optimization profiles for the two phases of generation, derived from the manifest's dims.

Profile 0, prefill: the prompt at full depth, sequence 1..max_prompt, no past.
Profile 1, decode:  one token per step, past 0..max_seq-1 (so total_sequence 1..max_seq).

Every input of every graph (embed, layers, head) gets min/opt/max from its manifest dims: fixed
ints stay fixed, names come from the table below. opt sits mid-range, as TensorRT-LLM does for its
batch and sequence dims, so tactics are tuned for a typical rather than an extreme shape. The
runtime picks the profile per call with ``choose_profile``.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.manifest import GraphSpec

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


def dim_ranges(config: EngineBuildConfig) -> list[dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of every named dim, per profile (prefill, decode)."""
    b, s, p = config.max_batch, config.max_seq, config.prompt_limit
    batch = (1, _mid(b), b)
    past_opt = _mid(s - 1) if s > 1 else 0
    prefill = {"batch": batch, "sequence": (1, _mid(p), p), "past_sequence": (0, 0, 0),
               "total_sequence": (1, _mid(p), p)}
    decode = {"batch": batch, "sequence": (1, 1, 1), "past_sequence": (0, past_opt, s - 1),
              "total_sequence": (1, past_opt + 1, s)}  # total = past + 1, kept consistent at opt
    return [prefill, decode]


def graph_profiles(spec: GraphSpec, config: EngineBuildConfig) -> list[Profile]:
    """The prefill and decode profiles of one graph, one ShapeRange per input."""
    profiles = []
    for name, ranges in zip(PROFILE_NAMES, dim_ranges(config)):
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
                   graph: str = "graph") -> int:
    """Index of a profile that holds every input shape; the current one when it does.

    Staying on the current profile avoids a switch (each switch invalidates the context's input
    shapes and may enqueue setup copies).
    """
    if current is not None and 0 <= current < len(profiles) and profiles[current].contains(shapes):
        return current
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
