"""The Markdown page: command, machine, bandwidth, policies, one table per architecture, targets.

Text between the NOTES markers of an existing page (the analysis a person wrote) is kept when the
page is regenerated.
"""

from __future__ import annotations

import math
import re
import shlex

from export.quantize import BLOCK_SIZE

from .results import ResultRow
from .rows import BACKENDS
from .targets import Target

NOTES_BEGIN = "<!-- notes: kept when the page is regenerated -->"
NOTES_END = "<!-- /notes -->"
COLUMNS = ("batch", "prompt", "row", "policy max→min", "layers/token", "theor.", "prefill ms",
           "decode tok/s", "token ms p50", "token ms p90", "peak RSS MB", "speedup", "realised",
           "floor ms", "× floor", "vs peers")


HUGE_NOTE = "; their packed weights on 2 MiB pages (--huge-pages: runtime.load's huge_pages=True)"


def _spin_note(spin: str) -> str:
    """What --spin made of the ONNX Runtime rows' workers, for the settings line."""
    if spin == "auto":
        return ("; this project's ONNX Runtime rows with spin='auto', the command lines' default (their "
                "workers spin where no other process uses the cores at load), ort-spin's always")
    return "; this project's ONNX Runtime rows with sleeping workers (runtime.load's default), ort-spin's spinning"


def _f(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def command_line(argv: list[str]) -> str:
    return "python -m tools.bench " + " ".join(shlex.quote(a) for a in argv)


def table_cells(r: ResultRow) -> list[str]:
    policy = "–" if not r.policy else f"{r.policy['max_layers']}→{r.policy['min_layers']}"
    head = [str(r.batch), str(r.prompt), r.name, policy]
    if not r.available:
        return head + [_f(float(r.num_layers if r.speedup is None else math.nan), ".1f"),
                       _f(r.theoretical, ".2f"), f"unavailable: {r.reason}"] + [""] * (len(COLUMNS) - 7)
    f = r.figures
    return head + [
        _f(f.avg_layers, ".1f"), _f(r.theoretical, ".2f"), _f(f.prefill_s * 1e3, ".1f"),
        _f(f.decode_tokens_per_s, ".1f"), _f(f.token_median_s * 1e3, ".2f"),
        _f(f.token_p90_s * 1e3, ".2f"), _f(f.peak_rss_bytes / 1e6, ".0f"),
        _f(r.measured_speedup, ".2f") + ("x" if not math.isnan(r.measured_speedup) else ""),
        _f(r.realised * 100 if not math.isnan(r.realised) else math.nan, ".0f")
        + ("%" if not math.isnan(r.realised) else ""),
        _f(r.floor_s * 1e3, ".2f"), _f(r.distance, ".2f"), peers_cell(r)]


def peers_cell(r: ResultRow) -> str:
    """Decode tok/s against each peer's full depth at the same shape; bold where this row is faster."""
    cells = []
    for peer, rel in r.peers.items():
        text = f"{rel:.2f}x {peer}"
        cells.append(f"**{text}**" if rel > 1 else text)
    return ", ".join(cells) or "–"


def by_shape(rows: list[ResultRow]) -> list[ResultRow]:
    """Rows grouped by (batch, prompt), in planned order within a shape (a stable sort)."""
    return sorted(rows, key=lambda r: (r.batch, r.prompt))


def markdown_table(rows: list[ResultRow]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(table_cells(r)) + " |")
    return "\n".join(lines)


def targets_block(targets: list[Target]) -> str:
    if not targets:
        return "No ONNX Runtime rows in this run: no target evaluated."
    return "\n".join(f"- **{t.status}** ({t.backend}): {t.name}. {t.detail}" for t in targets)


def keep_notes(previous: str | None) -> str:
    if previous and NOTES_BEGIN in previous and NOTES_END in previous:
        return previous.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    return "_No analysis written yet._"


def keep_after_notes(previous: str | None) -> str:
    """What a previous page holds after its notes block (hand-written sections a page keeps below its
    analysis, e.g. docs/quality.md's), kept as it is; "" when there is none."""
    if previous and NOTES_BEGIN in previous and NOTES_END in previous:
        return previous.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[1].strip("\n")
    return ""


def peer_line(name: str, peer: dict) -> str:
    """The page's line on a peer's venv (``tools.bench.venv``): its python and versions, or why not."""
    if peer.get("available"):
        versions = ", ".join(f"{k} {x}" for k, x in peer.get("versions", {}).items())
        return f"- {name} peer: its own venv (`{peer.get('python')}`): {versions}"
    return f"- {name} peer: unavailable: {peer.get('reason', 'not requested')}"


def render(data: dict, rows: list[ResultRow], targets: list[Target], plot_name: str | None,
           previous: str | None = None) -> str:
    m, bw = data["machine"], data["bandwidth"]
    v = m["versions"]
    lines = [
        "# Benchmarks: SkipDecode's measured wall-clock speedup, and the peers",
        "",
        "Produced by this command (one interleaved run):",
        "",
        "```",
        command_line(data["argv"]),
        "```",
        "",
        f"- Date: {m['date']}; total run time {data.get('elapsed_s', 0) / 60:.1f} min.",
        f"- Machine: {m['cpu']}, {m['cores']} cores, "
        f"{_f(m.get('memory_gib'), '.0f')} GiB memory; Python {m['python']}; torch {v['torch']}, "
        f"onnxruntime {v['onnxruntime']}, transformers {v['transformers']}, numpy {v['numpy']}.",
        peer_line("Optimum", data.get("optimum", {})),
        *([peer_line("ONNX Runtime GenAI", data["ortgenai"])] if "ortgenai" in data else []),
        *([peer_line("llama.cpp", data["llamacpp"])] if "llamacpp" in data else []),
        f"- Threads: {data['settings']['threads']} for every row (ORT intra-op threads, "
        f"torch.set_num_threads, OMP/MKL){_spin_note(data['settings'].get('spin', 'off'))}"
        f"{HUGE_NOTE if data['settings'].get('huge_pages') else ''}. Weights: random, fp32, at each "
        f"architecture's real shapes, seed "
        f"{data['settings']['seed']}; every row runs the same weights (the artifact and each peer's "
        f"export, build or GGUF are all made from one saved checkpoint).",
        f"- {data['settings']['rounds']} rounds; each round runs every row once, in a shuffled order "
        f"(seeded per round); each run is a fresh process (so peak RSS is per row) that loads the "
        f"model, generates {data['settings']['warmup_tokens']} tokens to warm up, then the timed "
        f"{data['settings']['new_tokens']} tokens, greedy, EOS ignored. Figures are medians across rounds.",
        f"- Memory read bandwidth (numpy sum over {bw['array_bytes'] / 2**30:.0f} GiB, best of 5): "
        f"{bw['one_thread'] / 1e9:.1f} GB/s on one thread, {bw['all_threads'] / 1e9:.1f} GB/s on "
        f"{bw['threads']}" + (f" before the rows; after them {bw['end']['one_thread'] / 1e9:.1f} and "
                              f"{bw['end']['all_threads'] / 1e9:.1f} GB/s" if "end" in bw else "")
        + f"; the floor uses {bw['best'] / 1e9:.1f} GB/s" + (", the highest" if "end" in bw else "") + ".",
        "",
        "Rows: " + "; ".join(f"`{k}` = {d.format(block=data['settings'].get('block_size', BLOCK_SIZE))}"
                             for k, d in BACKENDS.items()
                             if any(r.backend == k for r in rows)) + ".",
        "",
        "Policies (1 warm-up layer; `SkipPolicy.for_speedup(L, s, horizon=new_tokens - 1)`: the "
        "max/min layer budgets whose theoretical speedup L / mean(budget) over the decode steps is "
        "closest to s, preferring a max:min near 2:1 as in the paper's Table 2, linear decay over "
        "the whole generation):",
        "",
    ]
    for arch, pols in data["policies"].items():
        L = data["models"][arch]["num_layers"]
        cells = ", ".join(f"{s}: {p['max_layers']}→{p['min_layers']} ({p['theoretical']:.2f}x)"
                          for s, p in pols.items())
        lines.append(f"- {arch} ({L} layers): {cells or 'full depth only'}")
    lines += [
        "",
        "Columns: *layers/token* = mean decoder layers run per generated token (decode steps); "
        "*theor.* = L / that mean; *prefill* = time to first token (tokenizing, prompt at full depth, "
        "head); *decode tok/s* = batch × decode steps / decode time; *token ms* = per-token (per-step) "
        "latency between consecutive tokens; *speedup* = decode tok/s over the same backend's full "
        "depth at the same shape (ratio of medians); *realised* = speedup / theor.; *floor* = "
        "(layers/token × (one layer's weight bytes + its K/V) + lm_head bytes) / bandwidth, the time to "
        "read what a step reads once: the weights as the row stores them (the quantized rows their "
        "MatMulNBits blocks, scales and zero points), and each active layer's K/V over the mean past "
        "(the peers exactly the past, this project whole KV pages of it); "
        "*× floor* = token ms p50 / floor; *vs peers* = the row's decode tok/s over transformers' (hf) and "
        "Optimum's at full depth at the same shape, bold where the row is faster.",
        "",
    ]
    for arch in data["models"]:
        arch_rows = by_shape([r for r in rows if r.arch == arch])
        if not arch_rows:
            continue
        model = data["models"][arch]
        lines += [f"## {arch} shapes ({model['num_layers']} layers, hidden {model['hidden_size']}, "
                  f"{model['layer_bytes'] / 1e6:.1f} MB per layer, lm_head {model['head_bytes'] / 1e6:.1f} MB)",
                  "", markdown_table(arch_rows), ""]
    lines += ["## Targets", "", targets_block(targets), ""]
    if plot_name:
        lines += ["## Measured speedup against active layers", "",
                  f"![measured speedup vs average active layers]({plot_name})", "",
                  "Solid line: the ideal L / layers; dashed: the bandwidth-bound ceiling, which is "
                  "lower because the lm_head is read at every step whatever the policy.", ""]
    lines += ["## Analysis", "", NOTES_BEGIN, keep_notes(previous), NOTES_END, ""]
    return "\n".join(lines)


def terminal_summary(rows: list[ResultRow], targets: list[Target]) -> str:
    out = []
    for arch in dict.fromkeys(r.arch for r in rows):
        out += [f"{arch}", markdown_table(by_shape([r for r in rows if r.arch == arch])), ""]
    out += ["targets:", targets_block(targets)]
    return re.sub(r"\*\*", "", "\n".join(out))
