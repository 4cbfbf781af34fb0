"""Raw outcomes -> one ResultRow per (architecture, shape, row), with every derived figure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from export.quantize import BLOCK_SIZE
from runtime.kvcache import bound_width

from . import stats
from .rows import FULL_ONLY, LLAMACPP, ORTGENAI, QUANTIZED, RUNTIME

PAGE_SIZE = 32  # runtime rows' KV page when a run's model info predates recording it


@dataclass
class ResultRow:
    arch: str
    batch: int
    prompt: int
    backend: str
    speedup: float | None  # requested theoretical speedup; None = full depth
    policy: dict | None  # max_layers, min_layers, warmup_layers, horizon (runtime rows)
    num_layers: int
    theoretical: float  # L / mean(budget) over the decode steps
    figures: stats.RowFigures | None = None  # None: not measured (see reason)
    reason: str = ""  # why the row is unavailable, or why rounds failed
    measured_speedup: float = math.nan  # decode tokens/s vs full depth on the same backend
    realised: float = math.nan  # measured / theoretical
    floor_s: float = math.nan  # bandwidth floor of one decode step
    distance: float = math.nan  # median per-token latency / floor
    ceiling: float = math.nan  # bandwidth-bound speedup ceiling (lm_head read every step)
    peers: dict = field(default_factory=dict)  # peer backend -> this row's decode tok/s over its full depth's

    @property
    def name(self) -> str:
        return f"{self.backend} {'full' if self.speedup is None else f'{self.speedup:g}x'}"

    @property
    def available(self) -> bool:
        return self.figures is not None


def build_rows(data: dict) -> list[ResultRow]:
    """``data``: the run's JSON (meta + jobs + outcomes), as the CLI saves it."""
    bandwidth = data["bandwidth"]["best"]
    out: list[ResultRow] = []
    by_key: dict[tuple, ResultRow] = {}
    for job in data["jobs"]:
        model = data["models"][job["arch"]]
        key = (job["arch"], job["batch"], job["prompt"], job["backend"], job["speedup"])
        row = ResultRow(job["arch"], job["batch"], job["prompt"], job["backend"], job["speedup"],
                        job.get("policy"), model["num_layers"], job["theoretical"],
                        reason=job.get("unavailable", ""))
        rounds, errors, stored = [], [], None
        for o in data["outcomes"]:
            if tuple(o["key"]) != key:
                continue
            if o.get("record"):
                rounds.append(stats.round_figures(o["record"], job["batch"]))
                # a peer whose file says what it stores (llama.cpp's GGUF types) over the formula's
                stored = o["record"].get("weight_bytes", stored)
            elif o.get("error"):
                errors.append(o["error"])
        if rounds:
            row.figures = stats.combine(rounds)
            if errors:
                row.reason = f"{len(errors)} round(s) failed: {errors[0]}"
        elif errors and not row.reason:
            row.reason = errors[0]
        block = data["settings"].get("block_size", BLOCK_SIZE)  # runs from before --block-size: the default
        layer, head = stored or row_weight_bytes(row.backend, model, block)
        if row.figures:
            kv = row_kv_bytes(row.backend, model, job["batch"], job["prompt"],
                              data["settings"]["new_tokens"])
            row.floor_s = stats.floor_seconds(row.figures.avg_layers, layer, head, bandwidth, kv)
            row.distance = stats.ratio(row.figures.token_median_s, row.floor_s)
            row.ceiling = stats.bandwidth_ceiling(row.num_layers, row.figures.avg_layers, layer, head, kv)
        by_key[key] = row
        out.append(row)
    for row in out:  # ratios to full depth on the same backend and shape
        full = by_key.get((row.arch, row.batch, row.prompt, row.backend, None))
        if row.figures and full and full.figures:
            row.measured_speedup = stats.measured_speedup(row.figures.decode_tokens_per_s,
                                                          full.figures.decode_tokens_per_s)
            row.realised = stats.realised_fraction(row.measured_speedup, row.theoretical)
        if row.figures and row.backend not in FULL_ONLY:
            for peer in FULL_ONLY:
                other = by_key.get((row.arch, row.batch, row.prompt, peer, None))
                if other and other.figures:
                    row.peers[peer] = stats.ratio(row.figures.decode_tokens_per_s,
                                                  other.figures.decode_tokens_per_s)
    return out


def row_kv_bytes(backend: str, model: dict, batch: int, prompt: int, new_tokens: int) -> float:
    """K/V bytes one active layer reads per decode step, the mean over the steps: the peers read
    each row's past exactly; this project's rows bind whole pages of it (runtime.kvcache)."""
    size = 2 if model.get("dtype") == "float16" or backend in LLAMACPP else 4  # llama.cpp's cache: f16
    steps = range(max(new_tokens - 1, 1))  # decode step g runs token g with a past of prompt + g
    if backend in RUNTIME:
        page = model.get("page_size", PAGE_SIZE)
        widths = [bound_width(prompt + g, 1, page) for g in steps]
    else:
        widths = [prompt + g for g in steps]
    kv_width = model.get("kv_width", model["hidden_size"])  # KV heads x head_dim (results before it: OPT's)
    return stats.kv_bytes(kv_width, sum(widths) / len(widths), batch, size)


def row_weight_bytes(backend: str, model: dict, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(one layer's, the head's) weight bytes as the row's own export stores them: float, or for the
    quantized rows their matmuls as MatMulNBits blocks (export.plan.quantized_bytes: ``block_size``
    weights, default BLOCK_SIZE, a scale of the model's dtype and a zero point per block; GenAI's
    int4 has no zero points); biases and layer norms stay float."""
    genai = (ORTGENAI[backend],) * 2 if ORTGENAI.get(backend) == "int4" else None  # its builder quantizes both
    layers, head = QUANTIZED.get(backend) or genai or ("float", "float")
    if (layers, head) == ("float", "float"):
        return model["layer_bytes"], model["head_bytes"]
    from export.plan import QUANT_BITS, quantized_bytes

    D, F, V = model["hidden_size"], model["ffn_dim"], model["vocab_size"]
    size = 2 if model["dtype"] == "float16" else 4

    def matmuls(shapes, precision):
        if precision == "float":
            return sum(k * n for k, n in shapes) * size
        return sum(quantized_bytes(k, n, QUANT_BITS[precision], block_size, size, symmetric=backend in ORTGENAI)
                   for k, n in shapes)

    small = (4 * D + F + D + 4 * D) * size  # biases and the two layer norms
    return (matmuls([(D, D)] * 4 + [(D, F), (F, D)], layers) + small,
            matmuls([(D, V)], head) + 2 * D * size)
