"""The quality targets, evaluated on a run's summary: held or missed, with the numbers.

For the first model (the one fine-tuned under SkipDecode), greedy decoding:

1. BLEU at full depth >= 65 (the paper's fine-tuned OPT-1.3B: 65.8 on the E2E test split).
2. BLEU under skipping: at 2x within 0.5 points of full depth, at 5x within 2 (the paper: +0.5, -1.6).
3. Faithfulness (E2E MRs only): slot error rate <= 5% at full depth, <= 8% at 5x.
4. With two or more models: the first model's BLEU beats the second's at every speedup that ran
   (the SkipDecode fine-tune against the same model without it).

Each target is evaluated only when its speedup (and its metric) is in the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .summary import Summary

HELD, MISSED = "held", "missed"
BLEU_FULL_MIN = 65.0
BLEU_DROP = {2.0: 0.5, 5.0: 2.0}  # speedup -> most BLEU points it may lose against full depth
SLOT_ERROR_MAX = {1.0: 5.0, 5.0: 8.0}  # speedup -> highest slot error rate (%) allowed


@dataclass
class Target:
    name: str
    status: str  # held or missed
    detail: str


def _status(ok: bool) -> str:
    return HELD if ok else MISSED


def bleu_full_target(summary: Summary) -> list[Target]:
    first = summary.models[0]
    full = summary.find(first, 1.0)
    if full is None:
        return []
    return [Target(f"{first}: BLEU at full depth >= {BLEU_FULL_MIN:g}", _status(full.bleu >= BLEU_FULL_MIN),
                   f"BLEU {full.bleu:.1f}, ROUGE-L {full.rouge_l:.1f}")]


def bleu_drop_targets(summary: Summary) -> list[Target]:
    first = summary.models[0]
    full = summary.find(first, 1.0)
    out = []
    for speedup, limit in BLEU_DROP.items():
        row = summary.find(first, speedup)
        if row is None or full is None:
            continue
        drop = full.bleu - row.bleu
        out.append(Target(
            f"{first}: BLEU at {speedup:g}x within {limit:g} point(s) of full depth",
            _status(drop <= limit),
            f"BLEU {row.bleu:.1f} at {speedup:g}x vs {full.bleu:.1f} at full depth: "
            f"{-drop:+.1f} points (allowed -{limit:g}); ROUGE-L {row.rouge_l:.1f} vs {full.rouge_l:.1f}"))
    return out


def slot_error_targets(summary: Summary) -> list[Target]:
    first = summary.models[0]
    out = []
    for speedup, limit in SLOT_ERROR_MAX.items():
        row = summary.find(first, speedup)
        if row is None or row.slot_errors is None:
            continue
        se = row.slot_errors
        out.append(Target(
            f"{first}: slot error rate at {speedup:g}x <= {limit:g}%", _status(se.rate <= limit),
            f"{se.rate:.1f}% ({se.missing} missing + {se.wrong} wrong of {se.slots} slots; "
            f"{se.texts_with_errors} of {se.texts} MRs with an error)"))
    return out


def beats_second_targets(summary: Summary) -> list[Target]:
    if len(summary.models) < 2:
        return []
    first, second = summary.models[:2]
    out = []
    for row in summary.for_model(first):
        other = summary.find(second, row.speedup)
        if other is None:
            continue
        out.append(Target(
            f"{first} beats {second} at {row.speedup:g}x (BLEU)",
            _status(row.bleu > other.bleu),
            f"BLEU {row.bleu:.1f} vs {other.bleu:.1f} ({row.bleu - other.bleu:+.1f}); "
            f"ROUGE-L {row.rouge_l:.1f} vs {other.rouge_l:.1f}"))
    return out


def evaluate(summary: Summary) -> list[Target]:
    return (bleu_full_target(summary) + bleu_drop_targets(summary) + slot_error_targets(summary)
            + beats_second_targets(summary))
