"""The SkipDecode layer policy (Del Corro et al., arXiv 2307.02628), as in docs/design.md section 1.

One layer budget per generation step, shared by the whole batch, decaying from ``max_layers`` to
``min_layers`` over ``horizon`` steps: linearly (the paper), or along a power curve
``min + (max - min) * (1 - t) ** exponent`` of the decay's progress t in [0, 1] (the paper's future
work; exponent > 1 drops the budget early and flattens out, < 1 holds it high and drops late).
A step runs the ``warmup_layers`` bottom layers plus the top ``budget - warmup_layers`` layers; the
hidden state passes unchanged from the last warm-up layer to the first active upper layer. Because
the budget never grows, each active set is a subset of the previous one, so every layer a token
runs already holds the K/V of every earlier position: the KV cache is never recomputed.

Step ``g`` is the forward pass whose *input* is the g-th generated token (g = 0 for the token the
prompt pass predicted). The prompt runs at full depth (``prefill="full"``), or at step 0's active
set (``prefill="policy"``): every later set is a subset of it, so the KV cache is still complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .errors import PolicyError


@dataclass(frozen=True)
class SkipPolicy:
    num_layers: int  # L: decoder layers of the model
    max_layers: int  # budget of the first generated token (<= L)
    min_layers: int  # budget once the decay reaches the horizon (>= warmup_layers)
    warmup_layers: int = 1  # bottom layers every step runs; the paper uses 1
    horizon: int = 128  # generation steps the decay spans; later steps stay at min_layers
    decay: str = "linear"  # budget curve over the horizon: "linear" (the paper) or "power"
    exponent: float = 2.0  # "power" only: budget = min + (max - min) * (1 - t) ** exponent
    prefill: str = "full"  # the prompt's layers: "full" depth, or "policy" (step 0's active set)

    def __post_init__(self) -> None:
        L, lo, hi, w, h = (self.num_layers, self.min_layers, self.max_layers,
                           self.warmup_layers, self.horizon)
        for name in ("num_layers", "max_layers", "min_layers", "warmup_layers", "horizon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"{name} must be an int, got {value!r}", param=name)
        if L < 1:
            raise PolicyError(f"num_layers must be >= 1, got {L}", param="num_layers")
        if w < 0:
            raise PolicyError(f"warmup_layers must be >= 0, got {w}", param="warmup_layers")
        if lo < 1:
            raise PolicyError(f"min_layers must be >= 1, got {lo}", param="min_layers")
        if w > lo:
            raise PolicyError(
                f"warmup_layers ({w}) must be <= min_layers ({lo}): the budget counts the warm-up "
                f"layers; lower warmup_layers or raise min_layers", param="warmup_layers")
        if lo > hi:
            raise PolicyError(
                f"min_layers ({lo}) must be <= max_layers ({hi}): the budget only decays",
                param="min_layers")
        if hi > L:
            raise PolicyError(
                f"max_layers ({hi}) must be <= num_layers ({L}): the model has {L} decoder layers",
                param="max_layers")
        if h < 1:
            raise PolicyError(f"horizon must be >= 1, got {h}", param="horizon")
        _check_shape(self.decay, self.exponent, self.prefill)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_fields(cls, num_layers: int, fields, horizon: int = 128) -> "SkipPolicy":
        """The one place where policy fields become a policy: a manifest's default, a call's
        ``policy=`` dict, the server's ``policy`` object, the command lines' flags.

        ``fields``: SkipPolicy's fields with ``max_layers`` and ``min_layers`` together, or
        ``speedup`` instead of them (``for_speedup``); a field given as None takes its default,
        and ``horizon`` absent or None is the ``horizon`` argument. Every error is a PolicyError
        whose message starts with the field it is about, and whose ``param`` names it."""
        fields = {k: v for k, v in dict(fields).items() if v is not None}
        layers = fields.pop("num_layers", num_layers)  # to_dict's dicts carry it
        if layers != num_layers:
            raise PolicyError(f"policy is for {layers} layers but the model has {num_layers}",
                              param="num_layers")
        unknown = sorted(set(fields) - {*POLICY_FIELDS, "speedup"})
        if unknown:
            raise PolicyError(f"{unknown[0]} is not a policy field; a policy has {', '.join(POLICY_FIELDS)}, "
                              f"or speedup instead of max_layers and min_layers", param=unknown[0])
        horizon = fields.pop("horizon", horizon)
        if "speedup" in fields:
            both = [k for k in ("max_layers", "min_layers") if k in fields]
            if both:
                raise PolicyError(f"{both[0]} and speedup exclude each other: pass speedup, or "
                                  f"max_layers and min_layers", param=both[0])
            return cls.for_speedup(num_layers, fields.pop("speedup"), horizon, **fields)
        for name, other in (("max_layers", "min_layers"), ("min_layers", "max_layers")):
            if name not in fields:
                raise PolicyError(f"{name} is required{' with ' + other if other in fields else ''}: "
                                  f"max_layers and min_layers go together", param=name)
        return cls(num_layers, horizon=horizon, **fields)

    @classmethod
    def full_depth(cls, num_layers: int, horizon: int = 128) -> "SkipPolicy":
        """The plain model: every step runs every layer."""
        return cls(num_layers, num_layers, num_layers, warmup_layers=min(1, num_layers),
                   horizon=horizon)

    @classmethod
    def for_speedup(cls, num_layers: int, speedup: float, horizon: int = 128,
                    warmup_layers: int = 1, decay: str = "linear", exponent: float = 2.0,
                    prefill: str = "full") -> "SkipPolicy":
        """The policy whose theoretical speedup over ``horizon`` steps is closest to ``speedup``,
        under the given decay curve (the theoretical speedup counts decode steps only).

        Among the candidates that tie, prefer max/min close to 2 (the paper's Table 2 settings
        are about 2:1, e.g. 16/8 for 2x on 24 layers) and then the larger budgets.
        """
        _check_shape(decay, exponent, prefill)
        if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not math.isfinite(speedup):
            raise PolicyError(f"speedup must be a finite number, got {speedup!r}", param="speedup")
        if horizon < 1:
            raise PolicyError(f"horizon must be >= 1, got {horizon}", param="horizon")
        if not 0 <= warmup_layers <= num_layers:
            raise PolicyError(f"warmup_layers must lie in [0, {num_layers}] (the model's layers), got "
                              f"{warmup_layers}", param="warmup_layers")
        lo_bound = max(warmup_layers, 1)
        ceiling = num_layers / lo_bound
        if speedup < 1 or speedup > ceiling + 1e-9:
            raise PolicyError(
                f"speedup {speedup:g} is out of range for {num_layers} layers with "
                f"{warmup_layers} warm-up layer(s): it must lie in [1, {ceiling:g}] "
                f"(num_layers / max(warmup_layers, 1))", param="speedup")
        hi, lo = _closest(num_layers, float(speedup), horizon, lo_bound, decay, exponent)
        return cls(num_layers, hi, lo, warmup_layers=warmup_layers, horizon=horizon, decay=decay,
                   exponent=exponent, prefill=prefill)

    # -- evaluation ---------------------------------------------------------------------------

    @property
    def is_full_depth(self) -> bool:
        return self.min_layers == self.num_layers

    def budget(self, step: int) -> int:
        """Layers run by generation step ``step`` (0-based), warm-up layers included."""
        return _budget(self.max_layers, self.min_layers, self.horizon, step, self.decay, self.exponent)

    def active_layers(self, step: int) -> tuple[int, ...]:
        """Indices of the layers step ``step`` runs, ascending."""
        b = self.budget(step)
        w = self.warmup_layers
        return tuple(range(w)) + tuple(range(self.num_layers - (b - w), self.num_layers))

    def prefill_layers(self) -> tuple[int, ...]:
        """Indices of the layers the prompt runs, ascending."""
        return self.active_layers(0) if self.prefill == "policy" else tuple(range(self.num_layers))

    def mean_budget(self, steps: int | None = None) -> float:
        steps = self.horizon if steps is None else steps
        if steps < 1:
            raise PolicyError(f"steps must be >= 1, got {steps}", param="steps")
        return sum(self.budget(g) for g in range(steps)) / steps

    def theoretical_speedup(self, steps: int | None = None) -> float:
        """L / mean(budget) over ``steps`` generation steps (default: the horizon)."""
        return self.num_layers / self.mean_budget(steps)

    def to_dict(self) -> dict:
        """The fields; decay, exponent and prefill only where they differ from the paper's
        (linear, full-depth prompt), so the dicts and manifests of such policies stay as they were."""
        d = {"num_layers": self.num_layers, "max_layers": self.max_layers,
             "min_layers": self.min_layers, "warmup_layers": self.warmup_layers,
             "horizon": self.horizon}
        if self.decay != "linear":
            d.update(decay=self.decay, exponent=self.exponent)
        if self.prefill != "full":
            d["prefill"] = self.prefill
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SkipPolicy":
        return cls(**{k: d[k] for k in ("num_layers", "max_layers", "min_layers", "warmup_layers",
                                        "horizon", "decay", "exponent", "prefill") if k in d})

    def __str__(self) -> str:
        shape = "" if self.decay == "linear" else f" ({self.decay} decay, exponent {self.exponent:g})"
        prompt = ", prompt at step 0's layers" if self.prefill == "policy" else ""
        return (f"SkipPolicy(L={self.num_layers}, layers {self.max_layers}->{self.min_layers} over "
                f"{self.horizon} steps{shape}, warm-up {self.warmup_layers}{prompt}, "
                f"{self.theoretical_speedup():.2f}x fewer layers over the horizon)")


def speedup_policies(default: SkipPolicy, table) -> dict:
    """A model's own policy for some speedup targets (a manifest policy's ``speedup_policies``:
    ``{"2": {"max_layers": 17, "min_layers": 13}}``), each used for its target in place of
    ``SkipPolicy.for_speedup``'s pick, which prefers max:min near 2:1 (the paper's): a model may
    keep its quality at a flatter policy of the same horizon speedup, faster on short texts.

    Checked against the model's ``default`` policy, whose horizon, warm-up and shape every entry
    shares: each key a speedup >= 1, each value a valid policy whose horizon speedup is its key's
    (within 0.05: a "2x" must be 2x). Returns the table with string keys; a PolicyError names the
    entry."""
    if not isinstance(table, dict):
        raise PolicyError(f"speedup_policies must map speedups to policies, got {type(table).__name__}",
                          param="speedup_policies")
    out = {}
    for key, budgets in table.items():
        try:
            target = float(key)
        except (TypeError, ValueError):
            target = float("nan")
        if not math.isfinite(target) or target < 1:
            raise PolicyError(f"speedup_policies: {key!r} is not a speedup >= 1", param="speedup_policies")
        if not isinstance(budgets, dict) or set(budgets) != {"max_layers", "min_layers"}:
            raise PolicyError(f"speedup_policies[{key!r}] must hold max_layers and min_layers, got {budgets!r}",
                              param="speedup_policies")
        policy = replace(default, **budgets)  # SkipPolicy's own checks
        if abs(policy.theoretical_speedup() - target) > 0.05:
            raise PolicyError(f"speedup_policies[{key!r}]: {budgets['max_layers']}->{budgets['min_layers']} is a "
                              f"{policy.theoretical_speedup():.2f}x policy over {policy.horizon} steps, not {target:g}x",
                              param="speedup_policies")
        out[f"{target:g}"] = {"max_layers": policy.max_layers, "min_layers": policy.min_layers}
    return out


DECAYS = ("linear", "power")
PREFILLS = ("full", "policy")
# what a dict of policy fields may hold (SkipPolicy.from_fields): the layer count is the model's
POLICY_FIELDS = tuple(f.name for f in fields(SkipPolicy) if f.name != "num_layers")


def _check_shape(decay, exponent, prefill) -> None:
    if decay not in DECAYS:
        raise PolicyError(f"decay must be one of {', '.join(DECAYS)}, got {decay!r}", param="decay")
    if (isinstance(exponent, bool) or not isinstance(exponent, (int, float))
            or not math.isfinite(exponent) or exponent <= 0):
        raise PolicyError(f"exponent must be a finite number > 0 (1 = linear), got {exponent!r}", param="exponent")
    if prefill not in PREFILLS:
        raise PolicyError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}", param="prefill")


def _budget(max_layers: int, min_layers: int, horizon: int, step: int, decay: str = "linear",
            exponent: float = 2.0) -> int:
    if step < 0:
        raise PolicyError(f"step must be >= 0, got {step}", param="step")
    t = min(max(step / max(horizon - 1, 1), 0.0), 1.0)
    if decay == "linear":
        x = (1.0 - t) * max_layers + t * min_layers
    else:  # (1 - t) ** exponent falls from 1 to 0 as t goes 0 -> 1 and never rises
        x = min_layers + (1.0 - t) ** exponent * (max_layers - min_layers)
    # round() is banker's rounding; floor(x + 0.5) matches the usual round-half-up of the paper's code
    b = math.floor(x + 0.5)
    return min(max(b, min_layers), max_layers)


@lru_cache(maxsize=256)
def _closest(num_layers: int, speedup: float, horizon: int, lo_bound: int, decay: str,
             exponent: float) -> tuple[int, int]:
    """(max_layers, min_layers) of ``SkipPolicy.for_speedup``: a search over every pair, kept per
    request shape (0.4 ms a request at 30 layers, 1.7 ms at 64, before the first token)."""
    best = None
    for lo in range(lo_bound, num_layers + 1):
        for hi in range(lo, num_layers + 1):
            achieved = _speedup(num_layers, hi, lo, horizon, decay, exponent)
            key = (round(abs(achieved - speedup), 9), abs(math.log(hi / lo) - math.log(2)), -hi, -lo)
            if best is None or key < best[0]:
                best = (key, hi, lo)
    return best[1], best[2]


@lru_cache(maxsize=4096)
def _speedup(num_layers: int, max_layers: int, min_layers: int, horizon: int, decay: str = "linear",
             exponent: float = 2.0) -> float:
    total = sum(_budget(max_layers, min_layers, horizon, g, decay, exponent) for g in range(horizon))
    return num_layers * horizon / total
