"""The issue's targets, evaluated on a run's rows: held, missed, or not measured.

1. ONNX Runtime SkipDecode realises >= 90% of the theoretical speedup at 2x and >= 80% at 5x, at
   batch 1 and 8, on OPT-1.3B shapes.
2. ONNX Runtime at full depth is no slower than Optimum's ORTModelForCausalLM (decode tokens/s),
   and at least 1.5x faster than transformers generate.
3. Batch-1 decode at full depth within 1.5x of the bandwidth floor.

Each is evaluated separately for every ONNX Runtime row kind in the run (ort, ort-nospin); a
target holds when every measured shape it covers holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .results import ResultRow, find
from .rows import ORT

HELD, MISSED, NOT_MEASURED = "held", "missed", "not measured"
REALISED = {2.0: 0.90, 5.0: 0.80}  # speedup -> minimum realised fraction
TARGET_ARCH = "opt-1.3b"
TARGET_BATCHES = (1, 8)
VS_OPTIMUM = 1.0
VS_HF = 1.5
FLOOR_DISTANCE = 1.5


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
    for batch in TARGET_BATCHES:
        for speedup, need in REALISED.items():
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
    return Target("SkipDecode realises >= 90% of theoretical at 2x, >= 80% at 5x "
                  "(batch 1 and 8, OPT-1.3B)", backend, status, "; ".join(parts))


def peers_target(rows: list[ResultRow], backend: str, peer: str, factor: float, title: str) -> Target:
    checks, parts = [], []
    for r in rows:
        if r.backend != backend or r.speedup is not None or not r.available:
            continue
        other = find(rows, r.arch, r.batch, r.prompt, peer, None)
        if other is None or not other.available:
            continue
        rel = r.figures.decode_tokens_per_s / other.figures.decode_tokens_per_s
        ok = rel >= factor
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


def evaluate(rows: list[ResultRow]) -> list[Target]:
    out = []
    for backend in ORT:
        if not any(r.backend == backend for r in rows):
            continue
        out.append(realised_target(rows, backend))
        out.append(peers_target(rows, backend, "optimum", VS_OPTIMUM,
                                "full depth no slower than Optimum ORTModelForCausalLM"))
        out.append(peers_target(rows, backend, "hf", VS_HF,
                                f"full depth >= {VS_HF}x transformers generate"))
        out.append(floor_target(rows, backend))
    return out
