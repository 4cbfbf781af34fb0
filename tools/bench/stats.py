"""Numbers from per-round worker records: medians across rounds, ratios, the bandwidth floor."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def median(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def percentile(values, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else math.nan


# -- one round's record ---------------------------------------------------------------------------


@dataclass
class RoundFigures:
    prefill_s: float
    decode_tokens_per_s: float  # batch x decode steps / decode time
    token_median_s: float  # per-token (per-step) latency, median over the steps
    token_p90_s: float
    peak_rss_bytes: float
    avg_layers: float  # mean layers run per generated token (decode steps)


def round_figures(record: dict, batch: int) -> RoundFigures:
    steps = record["step_s"]
    layers = record["layers_per_step"]
    return RoundFigures(
        prefill_s=record["prefill_s"],
        decode_tokens_per_s=batch * len(steps) / record["decode_s"] if record["decode_s"] else math.nan,
        token_median_s=median(steps), token_p90_s=percentile(steps, 90),
        peak_rss_bytes=record["peak_rss_bytes"],
        avg_layers=sum(layers) / len(layers) if layers else math.nan)


@dataclass
class RowFigures:
    """Medians across rounds of one row at one shape."""

    rounds: int
    prefill_s: float
    decode_tokens_per_s: float
    token_median_s: float
    token_p90_s: float
    peak_rss_bytes: float
    avg_layers: float


def combine(rounds: list[RoundFigures]) -> RowFigures:
    def m(field):
        return median(getattr(r, field) for r in rounds)

    return RowFigures(len(rounds), m("prefill_s"), m("decode_tokens_per_s"), m("token_median_s"),
                      m("token_p90_s"), m("peak_rss_bytes"), m("avg_layers"))


def measured_speedup(row_tokens_per_s: float, full_tokens_per_s: float) -> float:
    """Decode throughput relative to full depth on the same backend and shape."""
    return ratio(row_tokens_per_s, full_tokens_per_s)


def realised_fraction(measured: float, theoretical: float) -> float:
    """How much of the theoretical (layer-count) speedup the wall clock shows."""
    return ratio(measured, theoretical)


# -- weights and the bandwidth floor ----------------------------------------------------------------


def layer_bytes(hidden: int, ffn: int, dtype_bytes: int = 4) -> int:
    """One pre/post-LN OPT decoder layer: q/k/v/out (D x D + D each), fc1/fc2, two layer norms."""
    params = 4 * (hidden * hidden + hidden) + (hidden * ffn + ffn) + (ffn * hidden + hidden) + 4 * hidden
    return params * dtype_bytes


def head_bytes(hidden: int, vocab: int, dtype_bytes: int = 4) -> int:
    """lm_head (V x D) plus the final layer norm; the embedding row gather is negligible."""
    return (vocab * hidden + 2 * hidden) * dtype_bytes


def kv_bytes(hidden: int, positions: float, batch: int, dtype_bytes: int = 4) -> float:
    """K and V one layer reads per step: ``positions`` of past per row (mean over the steps)."""
    return 2 * hidden * positions * batch * dtype_bytes


def bytes_per_token(avg_layers: float, one_layer: int, head: int, kv_per_layer: float = 0) -> float:
    """Bytes one decode step reads: the active layers' weights and K/V, and the lm_head."""
    return avg_layers * (one_layer + kv_per_layer) + head


def floor_seconds(avg_layers: float, one_layer: int, head: int, bandwidth: float,
                  kv_per_layer: float = 0) -> float:
    """Bandwidth floor of one decode step (the per-token latency), bandwidth in bytes/s."""
    return bytes_per_token(avg_layers, one_layer, head, kv_per_layer) / bandwidth


def bandwidth_ceiling(num_layers: int, avg_layers: float, one_layer: int, head: int,
                      kv_per_layer: float = 0) -> float:
    """Best wall-clock speedup a bandwidth-bound decode can reach: full-depth bytes / row bytes.

    Below L / avg_layers because the lm_head is read at every step whatever the policy.
    """
    return ratio(bytes_per_token(num_layers, one_layer, head, kv_per_layer),
                 bytes_per_token(avg_layers, one_layer, head, kv_per_layer))
