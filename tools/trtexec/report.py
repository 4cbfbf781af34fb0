"""Read trtexec's --exportTimes / --exportProfile JSON and print a Markdown table per graph.

The formats, from NVIDIA/TensorRT samples/common/sampleReporting.cpp (exportJSONTrace and
Profiler::exportJSONProfile) and the readers samples/trtexec/tracer.py and profiler.py:

  times:   [ {"startEnqMs", "endEnqMs", "startH2dMs", "endH2dMs", "startComputeMs", "endComputeMs",
              "startD2hMs", "endD2hMs", "h2dMs", "computeMs", "d2hMs", "latencyMs"}, ... ]
           one entry per query, times in ms since the start of inference. Older trtexec also writes
           "endToEndMs" and includes the warm-up queries; newer trtexec skips them.
  profile: [ {"count": iterations}, {"name", "timeMs", "averageMs", "medianMs", "percentage"}, ... ]
           one entry per TensorRT layer; "medianMs" only in newer trtexec.

Statistics follow trtexec's own summary (sampleReporting.cpp), so the numbers match its log:
warm-up queries are those whose compute starts before --warmUp ms; the median of an even count is the
mean of the two middle values; percentile p is the sorted value at index max(n - 1 - int((1 - p/100) * n), 0);
throughput is queries / (last query's D2H end - first query's H2D start).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import TrtexecOutputError

# The oldest tracer.py names (startInMs, ...) mapped onto today's.
_OLD_KEYS = {"startInMs": "startH2dMs", "endInMs": "endH2dMs", "startOutMs": "startD2hMs",
             "endOutMs": "endD2hMs", "inMs": "h2dMs", "outMs": "d2hMs"}


@dataclass(frozen=True)
class TimeStats:
    queries: int  # timed queries after warm-up
    median_ms: float  # of latencyMs: H2D + GPU compute + D2H (compute only with --noDataTransfers)
    mean_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    compute_median_ms: float  # GPU compute time alone
    throughput_qps: float  # queries per second of host walltime


@dataclass(frozen=True)
class LayerTime:
    name: str  # TensorRT layer name (fused layers join the ONNX node names)
    average_ms: float  # per iteration
    median_ms: float | None  # None from trtexec versions that do not write it
    percentage: float  # share of the graph's total profiled time


@dataclass(frozen=True)
class GraphResult:
    graph: str
    phase: str  # "decode" or "prefill"
    batch: int
    sequence: int
    past: int
    times: TimeStats
    layers: list[LayerTime] = field(default_factory=list)  # slowest first
    profile_iterations: int = 0


def _load_json_list(path: Path, what: str) -> list:
    path = Path(path)
    if not path.is_file():
        raise TrtexecOutputError(f"trtexec wrote no {what} file at {path}; check its log beside it for the error")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TrtexecOutputError(
            f"{path} is not valid JSON ({exc}); rerun trtexec, the file may be truncated") from exc
    if not isinstance(data, list) or not data:
        raise TrtexecOutputError(f"{path} is not a non-empty JSON list as trtexec writes {what}; rerun trtexec")
    return data


def percentile(sorted_values: list[float], p: float) -> float:
    """trtexec's findPercentile on ascending values, in float32 as trtexec computes it: in float64,
    (1 - 90/100) * 20 is 1.9999999999999996 and drops a different sample than trtexec's 2.0000005."""
    n = len(sorted_values)
    exclude = int((np.float32(1) - np.float32(p) / np.float32(100)) * np.float32(n))
    return sorted_values[max(n - 1 - exclude, 0)]


def median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    m = n // 2
    return sorted_values[m] if n % 2 else (sorted_values[m - 1] + sorted_values[m]) / 2


def _normalise(entry: dict) -> dict:
    e = {_OLD_KEYS.get(k, k): v for k, v in entry.items()}
    if "latencyMs" not in e and "computeMs" in e:
        e["latencyMs"] = e.get("h2dMs", 0.0) + e["computeMs"] + e.get("d2hMs", 0.0)
    return e


def time_stats(entries: list[dict], warmup_ms: float = 0.0, source: str = "times") -> TimeStats:
    trace = [_normalise(e) for e in entries if isinstance(e, dict)]
    missing = [k for k in ("startComputeMs", "computeMs", "latencyMs") if any(k not in e for e in trace)]
    if not trace or missing:
        raise TrtexecOutputError(
            f"{source} lacks {', '.join(missing) or 'entries'}: not trtexec --exportTimes output")
    timed = [e for e in trace if e["startComputeMs"] >= warmup_ms]
    if not timed:
        raise TrtexecOutputError(
            f"{source}: all {len(trace)} queries fall in the {warmup_ms} ms warm-up; "
            f"raise --duration or --iterations")
    lat = sorted(e["latencyMs"] for e in timed)
    start = timed[0].get("startH2dMs", timed[0]["startComputeMs"])
    end = timed[-1].get("endD2hMs", timed[-1].get("endComputeMs", start))
    walltime_ms = end - start
    return TimeStats(
        queries=len(timed), median_ms=median(lat), mean_ms=sum(lat) / len(lat),
        p90_ms=percentile(lat, 90), p99_ms=percentile(lat, 99), min_ms=lat[0], max_ms=lat[-1],
        compute_median_ms=median(sorted(e["computeMs"] for e in timed)),
        throughput_qps=len(timed) / walltime_ms * 1000 if walltime_ms > 0 else float("nan"))


def read_times(path: Path, warmup_ms: float = 0.0) -> TimeStats:
    return time_stats(_load_json_list(path, "--exportTimes"), warmup_ms, str(path))


def read_profile(path: Path) -> tuple[int, list[LayerTime]]:
    """(iterations, layers slowest first) from an --exportProfile file."""
    data = _load_json_list(path, "--exportProfile")
    head = data[0] if isinstance(data[0], dict) else {}
    if "count" not in head:
        raise TrtexecOutputError(
            f"{path} does not start with {{\"count\": N}}: not trtexec --exportProfile output")
    try:
        layers = [LayerTime(str(d["name"]), float(d["averageMs"]),
                            float(d["medianMs"]) if "medianMs" in d else None, float(d["percentage"]))
                  for d in data[1:]]
    except (KeyError, TypeError, ValueError) as exc:
        raise TrtexecOutputError(f"{path} has a layer entry without name/averageMs/percentage ({exc})") from exc
    layers.sort(key=lambda layer: layer.average_ms, reverse=True)
    return int(head["count"]), layers


# -- Markdown -------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def latency_table(results: list[GraphResult]) -> str:
    head = ["graph", "phase", "batch", "seq", "past", "queries", "median ms", "mean ms", "p90 ms", "p99 ms",
            "GPU median ms", "queries/s", "tokens/s"]
    lines = [_row(head), "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in results:
        t = r.times
        lines.append(_row([r.graph, r.phase, r.batch, r.sequence, r.past, t.queries, _ms(t.median_ms),
                           _ms(t.mean_ms), _ms(t.p90_ms), _ms(t.p99_ms), _ms(t.compute_median_ms),
                           f"{t.throughput_qps:.1f}", f"{t.throughput_qps * r.batch * r.sequence:.1f}"]))
    if len(results) > 1:  # one step at full depth runs every graph once
        lines.append(_row(["**sum**", "", "", "", "", "", _ms(sum(r.times.median_ms for r in results)),
                           _ms(sum(r.times.mean_ms for r in results)), "", "",
                           _ms(sum(r.times.compute_median_ms for r in results)), "", ""]))
    return "\n".join(lines)


def layer_table(result: GraphResult, top: int) -> str:
    lines = [f"#### {result.graph}: slowest TensorRT layers ({result.profile_iterations} profiled iterations)", "",
             _row(["TensorRT layer", "avg ms", "median ms", "% of graph"]), "|---|---:|---:|---:|"]
    for layer in result.layers[:top]:
        name = layer.name.replace("|", "\\|")
        lines.append(_row([name, _ms(layer.average_ms), _ms(layer.median_ms), f"{layer.percentage:.1f}"]))
    return "\n".join(lines)


def markdown_report(results: list[GraphResult], top: int = 5) -> str:
    parts = [latency_table(results)]
    if top > 0:
        parts += [layer_table(r, top) for r in results if r.layers]
    return "\n\n".join(parts) + "\n"
