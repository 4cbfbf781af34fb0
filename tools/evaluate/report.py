"""The Markdown page (docs/quality.md): command, machine, one table per model, the paper's rows,
targets, sample outputs, and the analysis a person wrote (kept between the NOTES markers when the
page is regenerated, as tools.bench does)."""

from __future__ import annotations

import math
import re
import shlex

from tools.bench.report import NOTES_BEGIN, NOTES_END, keep_after_notes, keep_notes

from .summary import Row, Summary
from .targets import Target

PROG = "python -m tools.evaluate"
COLUMNS = ("speedup target", "policy max→min over H steps", "layers/token", "theor.", "BLEU",
           "ROUGE-L", "ΔBLEU", "slot errors", "MRs with an error", "decode ms/step",
           "measured speedup (min–max over rounds)", "prompt pass speedup")
# Del Corro et al. 2023 (arXiv 2307.02628), OPT-1.3B (24 layers) fine-tuned on E2E per policy.
PAPER_ROWS = ((1, 24.0, 65.8, 67.6), (2, 14.7, 66.3, 67.9), (5, 5.8, 64.2, 66.3))
SAMPLES = 3


def _f(x, spec: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec) + suffix


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """An inline code span that survives backticks inside ``text``."""
    text = " ".join(str(text).split())
    if not text:
        return "_(empty)_"
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def command_line(argv: list[str]) -> str:
    return PROG + " " + " ".join(shlex.quote(a) for a in argv)


def speedup_label(speedup: float) -> str:
    return "1x (full depth)" if speedup == 1 else f"{speedup:g}x"


def policy_label(policy: dict | None) -> str:
    if not policy:
        return "–"
    if policy["min_layers"] == policy["num_layers"]:
        return f"{policy['max_layers']}→{policy['min_layers']} (all layers)"
    shape = f", power {policy['exponent']:g}" if policy.get("decay", "linear") != "linear" else ""
    prompt = f", prompt at {policy['max_layers']}" if policy.get("prefill") == "policy" else ""
    return f"{policy['max_layers']}→{policy['min_layers']} over {policy['horizon']}{shape}{prompt}"


def speedup_cell(r: Row) -> str:
    low, high = r.speedup_spread
    spread = f" ({_f(low, '.2f')}–{_f(high, '.2f')})" if len(r.round_speedups) > 1 else ""
    return _f(r.measured_speedup, ".2f", "x") + spread


def table_cells(r: Row) -> list[str]:
    se = r.slot_errors
    return [speedup_label(r.speedup), policy_label(r.policy), _f(r.avg_layers, ".1f"),
            _f(r.theoretical, ".2f", "x"), _f(r.bleu, ".1f"), _f(r.rouge_l, ".1f"),
            _f(r.delta_bleu, "+.1f"), _f(se.rate if se else None, ".1f", "%"),
            _f(se.texts_with_errors_pct if se else None, ".1f", "%"),
            _f(r.ms_per_step, ".2f"), speedup_cell(r), _f(r.prefill_speedup, ".2f", "x")]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def paper_table() -> str:
    lines = ["| speedup target | layers/token | BLEU | ROUGE-L |", "|---|---|---|---|"]
    lines += [f"| {speedup_label(s)} | {layers:.1f} | {bleu:.1f} | {rouge:.1f} |"
              for s, layers, bleu, rouge in PAPER_ROWS]
    return "\n".join(lines)


def targets_block(targets: list[Target]) -> str:
    if not targets:
        return ("No target evaluated: the BLEU targets need speedup 2 or 5 in the run, the "
                "comparison needs a second model.")
    return "\n".join(f"- **{t.status}**: {t.name}. {t.detail}" for t in targets)


def samples_block(data: dict, summary: Summary, count: int = SAMPLES) -> list[str]:
    first = summary.for_model(summary.models[0])
    second = summary.for_model(summary.models[1]) if len(summary.models) > 1 else []
    lines = []
    for i, prompt in enumerate(data["prompts"][:count]):
        refs = data["references"][i]
        lines += [f"**Prompt {i + 1}**: {_code(prompt)}", "",
                  f"- reference (1 of {len(refs)}): {_code(refs[0])}"]
        lines += [f"- {_cell(r.model)}, {speedup_label(r.speedup)}: {_code(r.hypotheses[i])}" for r in first]
        if second:
            r = max(second, key=lambda r: r.speedup)
            lines.append(f"- {_cell(r.model)}, {speedup_label(r.speedup)}: {_code(r.hypotheses[i])}")
        lines.append("")
    return lines


def _rounds(data: dict) -> str:
    if len(data.get("commands") or []) > 1:
        return "as many rounds as each model's section says"
    return f"{data['settings']['timing_rounds']} round(s)"


def _settings_lines(data: dict, summary: Summary) -> list[str]:
    m, s = data["machine"], data["settings"]
    v = m.get("versions", {})
    threads = s.get("threads") or "the backend's default"
    n_refs = sum(len(r) for r in data["references"])
    limit = f" (the first {s['limit']}, --limit)" if s.get("limit") else ""
    return [
        f"- Date: {m.get('date', '?')}; total run time {_duration(data.get('elapsed_s', 0))}.",
        f"- Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{_f(m.get('memory_gib'), '.0f')} GiB memory; Python {m.get('python', '?')}; "
        + ", ".join(f"{k} {x}" for k, x in v.items()) + ".",
        f"- Backend: {s['backend']}, threads: {threads}.",
        f"- Data: `{s['data']}` (prompt column `{s['prompt_column']}`, reference column "
        f"`{s['target_column']}`): {len(data['prompts'])} unique prompts{limit} with {n_refs} "
        f"references in all ({s.get('pairs', n_refs)} rows in the file before --limit).",
        f"- Generation: greedy, until EOS or {s['max_new_tokens']} new tokens, in batches of "
        f"{s['batch_size']} prompts (left padded); how the budget decays and which layers the prompt "
        f"runs: each model's section. Each unique prompt is "
        f"generated once per model and speedup and scored against all of its references; the text is "
        f"stripped of surrounding whitespace.",
        f"- Timing: for each batch the speedups run in turn, in an order shuffled per batch (seed "
        f"{s['seed']}), after one untimed warm-up call; {_rounds(data)} (round 1 also "
        f"gives the text, later rounds rerun the batches for timing only).",
        f"- BLEU: sacrebleu corpus BLEU, all references of a prompt at once (signature "
        f"`{summary.bleu_signature}`). ROUGE-L: rouge_score F1 with Porter stemming, the best "
        f"reference per prompt, averaged over prompts, x100.",
        _slots_line(summary),
    ]


def _shape_text(policy: dict | None) -> str:
    """How the skipping policies of a model's run decay and run the prompt (from one of them)."""
    policy = policy or {}
    decay = (f"the budget decays along a power curve, exponent {policy.get('exponent', 2.0):g}"
             if policy.get("decay") == "power" else "the budget decays linearly")
    prompt = ("the prompt runs at the first step's active set (full depth at 1x)"
              if policy.get("prefill") == "policy" else "the prompt runs at full depth")
    return f"{decay}; {prompt}"


def _slots_line(summary: Summary) -> str:
    ref = summary.reference_slot_errors
    if ref is None:
        return "- Slot errors: not computed (the prompts are not E2E meaning representations)."
    return (f"- Slot errors (`tools/evaluate/slots.py`, whose docstring gives the realisation rule of "
            f"every slot): (values of the MR the text does not realise + values of other MRs it "
            f"asserts: another venue name, cuisine, area or venue type) / slots in the MRs. The human "
            f"references of this data, each scored against its MR by the same rules: "
            f"**{ref.rate:.1f}%** ({ref.missing} missing + {ref.wrong} wrong of {ref.slots} slots; "
            f"{ref.texts_with_errors_pct:.1f}% of the {ref.texts} references have an error).")


COLUMN_NOTES = (
    "Columns: *policy* = the layer budget's decay, first generated step → last, over H decode steps "
    "(1 warm-up layer, then the top layers), as `generate(speedup=s)` chose it; *layers/token* = "
    "mean decoder layers run per decode step (every generated token after the first; the first "
    "comes from the prompt pass); *theor.* = L / layers/token; *ΔBLEU* = BLEU minus "
    "the first model's full-depth BLEU; *slot errors* = the slot error rate of the texts (below); "
    "*MRs with an error* = share of the MRs whose text has at least one slot error; *decode "
    "ms/step* = decode time / decode steps, over all batches and rounds (one step = one token for "
    "every row of a batch); *measured speedup* = the same model's full-depth ms/step / this "
    "ms/step over all rounds, with in brackets the lowest and highest of the same ratio within each "
    "round (the speedups run interleaved per batch in every round); *prompt pass speedup* = the "
    "same model's full-depth prompt-pass (prefill) time / this one's, over all batches and rounds "
    "(1x within noise unless the prompt runs under the policy).")


def _commands_block(data: dict) -> list[str]:
    commands = data.get("commands") or [data["argv"]]
    if len(commands) == 1:
        return ["Produced by this command:", "", "```", command_line(commands[0]), "```", ""]
    lines = [f"Produced by these {len(commands)} commands (run one after the other on the same data), "
             f"then `{PROG} --render` of their JSON files into this page:", "", "```"]
    lines += [f"{command_line(c)}" for c in commands]
    return lines + ["```", ""]


def _skipping_policy(model: dict) -> dict | None:
    return next((r["policy"] for r in model["runs"] if float(r["speedup"]) != 1), None)


def _deep_copies(model: dict) -> str:
    """What deep copies did in the skipping runs (runtime.decoding.copying), if they ran."""
    entry = (model.get("manifest_policy") or {}).get("deep_copies")
    runs = [r for r in model["runs"] if r.get("deep_steps")]
    if entry is None and not runs:
        return ""
    text = (f" Deep copies on: a step whose input lies in a rare string of the prompt also runs the "
            f"warm-up layer and the top {entry['layers'] - 1} layers" if entry else " Deep copies on")
    shares = [f"{r['speedup']:g}x {r['deep_steps'] / max(r['decode_tokens'], 1):.0%} of tokens, "
              f"{r['filled_positions'] / max(r['decode_tokens'], 1):.1f} K/V written per token" for r in runs]
    return text + (f" ({'; '.join(shares)}; counted in layers/token and in the times)." if shares else ".")


def _model_origin(model: dict) -> str:
    if "command" not in model:
        return ""
    return f" From command {model['command']}, {model['timing_rounds']} timing round(s)."


def render(data: dict, summary: Summary, targets: list[Target], previous: str | None = None) -> str:
    lines = [
        "# Text quality under SkipDecode policies",
        "",
        *_commands_block(data),
        *_settings_lines(data, summary),
        "",
        COLUMN_NOTES,
        "",
    ]
    for model in data["models"]:
        rows = summary.for_model(model["name"])
        lines += [f"## {_cell(model['name'])}", "",
                  f"`{model['dir']}`: {model['num_layers']} layers, {model['dtype']}.{_model_origin(model)} "
                  f"Skipping policies: {_shape_text(_skipping_policy(model))}.{_deep_copies(model)}", "",
                  markdown_table(rows), ""]
    lines += [
        "## The paper's rows",
        "",
        "SkipDecode paper, OPT-1.3B (24 layers) fine-tuned on E2E under each policy (Del Corro et "
        "al. 2023, arXiv 2307.02628). Their model, scoring scripts and policies' horizon differ "
        "from ours: a reference point, not a like-for-like comparison.",
        "",
        paper_table(),
        "",
        "## Targets",
        "",
        targets_block(targets),
        "",
        "## Sample outputs",
        "",
        *samples_block(data, summary),
        "## Analysis",
        "",
        NOTES_BEGIN,
        keep_notes(previous),
        NOTES_END,
        "",
    ]
    after = keep_after_notes(previous)  # sections written below the analysis stay
    return "\n".join(lines + ([after, ""] if after else []))


def terminal_summary(summary: Summary, targets: list[Target]) -> str:
    out = []
    for name in summary.models:
        out += [name, markdown_table(summary.for_model(name)), ""]
    out += ["targets:", targets_block(targets)]
    return re.sub(r"\*\*", "", "\n".join(out))
