"""The issues' targets, evaluated on a run's rows: held, missed, or not measured.

1. ONNX Runtime SkipDecode realises >= 90% of the theoretical speedup at 2x and >= 80% at 5x, at
   batch 1 and 8, on OPT-1.3B shapes; >= 95% / 85% with a quantized head (its rows read a head a
   sixth or a third of the fp32 one's bytes).
2. ONNX Runtime at full depth is >= 1.15x faster than Optimum's ORTModelForCausalLM and than
   transformers generate at batch 1 (decode tokens/s); at batch 8 >= 1.2x Optimum, >= 1.5x
   transformers.
3. Batch-1 decode at full depth within 1.2x of the bandwidth floor.

Each is evaluated separately for every ONNX Runtime row kind in the run (ort, ort-nospin); a
target holds when every measured shape it covers holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .results import ResultRow
from .rows import ORT, QUANTIZED

HELD, MISSED, NOT_MEASURED = "held", "missed", "not measured"
REALISED = {2.0: 0.90, 5.0: 0.80}  # speedup -> minimum realised fraction
REALISED_QUANTIZED_HEAD = {2.0: 0.95, 5.0: 0.85}  # the same with an int8/int4 head
TARGET_ARCH = "opt-1.3b"
TARGET_BATCHES = (1, 8)
VS_OPTIMUM = {1: 1.15, 8: 1.2}  # batch -> decode tok/s over Optimum's at full depth
VS_HF = {1: 1.15, 8: 1.5}  # batch -> over transformers generate's
FLOOR_DISTANCE = 1.2


@dataclass
class Target:
    name: str
    backend: str  # the ORT row kind it was evaluated on
    status: str
    detail: str


def _status(checks: list[bool]) -> str:
    if not checks:
        return NOT_MEASURED
    return HELD if all(checks) else MISSED


def _fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def realised_target(rows: list[ResultRow], backend: str) -> Target:
    checks, parts = [], []
    needs = REALISED_QUANTIZED_HEAD if QUANTIZED.get(backend, ("", "float"))[1] != "float" else REALISED
    for batch in TARGET_BATCHES:
        for speedup, need in needs.items():
            found = [r for r in rows if r.arch == TARGET_ARCH and r.batch == batch and r.backend == backend
                     and r.speedup == speedup and r.available and not math.isnan(r.realised)]
            if not found:
                parts.append(f"b{batch} {speedup:g}x not measured")
                continue
            for r in found:
                ok = r.realised >= need
                checks.append(ok)
                parts.append(f"b{batch} p{r.prompt} {speedup:g}x: {r.realised:.0%} of "
                             f"{r.theoretical:.2f}x (need {need:.0%}) {'ok' if ok else 'short'}")
    status = _status(checks)
    if status == HELD and any("not measured" in p for p in parts):
        status = f"{HELD} where measured"
    return Target(f"SkipDecode realises >= {needs[2.0]:.0%} of theoretical at 2x, >= {needs[5.0]:.0%} at 5x "
                  "(batch 1 and 8, OPT-1.3B)", backend, status, "; ".join(parts))


def peers_target(rows: list[ResultRow], backend: str, peer: str, factors: dict[int, float],
                 title: str) -> Target:
    """``factors``: batch -> the least ratio; a batch not named takes the largest batch's."""
    checks, parts = [], []
    for r in rows:
        if r.backend != backend or r.speedup is not None or not r.available or peer not in r.peers:
            continue
        rel = r.peers[peer]
        ok = rel >= factors.get(r.batch, factors[max(factors)])
        checks.append(ok)
        parts.append(f"{r.arch} b{r.batch} p{r.prompt}: {rel:.2f}x {'ok' if ok else 'short'}")
    missing = [r for r in rows if r.backend == peer and r.speedup is None and not r.available]
    if not checks and missing:
        parts.append(f"{peer} unavailable: {missing[0].reason}")
    return Target(title, backend, _status(checks), "; ".join(parts) or f"no {peer} row in this run")


def floor_target(rows: list[ResultRow], backend: str) -> Target:
    checks, parts = [], []
    for r in rows:
        if r.backend == backend and r.speedup is None and r.batch == 1 and r.available:
            ok = r.distance <= FLOOR_DISTANCE
            checks.append(ok)
            parts.append(f"{r.arch} p{r.prompt}: {r.figures.token_median_s * 1e3:.1f} ms = "
                         f"{_fmt(r.distance)}x the {r.floor_s * 1e3:.1f} ms floor {'ok' if ok else 'short'}")
    return Target(f"batch-1 full-depth decode within {FLOOR_DISTANCE}x of the bandwidth floor", backend,
                  _status(checks), "; ".join(parts) or "no batch-1 full-depth row")


def _factors(factors: dict[int, float]) -> str:
    return ", ".join(f"{f:g}x at batch {b}" for b, f in factors.items())


def evaluate(rows: list[ResultRow]) -> list[Target]:
    out = []
    for backend in ORT:
        if not any(r.backend == backend for r in rows):
            continue
        out.append(realised_target(rows, backend))
        out.append(peers_target(rows, backend, "optimum", VS_OPTIMUM, "full depth >= "
                                f"{_factors(VS_OPTIMUM)} Optimum ORTModelForCausalLM"))
        out.append(peers_target(rows, backend, "hf", VS_HF,
                                f"full depth >= {_factors(VS_HF)} transformers generate"))
        out.append(floor_target(rows, backend))
    return out
