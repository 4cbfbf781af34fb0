"""The quality targets, evaluated on a run's summary: held or missed, with the numbers.

1. The first model (the one fine-tuned under SkipDecode) keeps its BLEU under skipping: at 2x
   within 1 point of its full depth, at 5x within 3 points (each only when that speedup ran).
2. With two or more models: the first model's BLEU beats the second's under every policy > 1x
   (the SkipDecode fine-tune against a model trained at full depth only), per speedup.
"""

from __future__ import annotations

from dataclasses import dataclass

from .summary import Summary

HELD, MISSED = "held", "missed"
BLEU_DROP = {2.0: 1.0, 5.0: 3.0}  # speedup -> most BLEU points it may lose against full depth


@dataclass
class Target:
    name: str
    status: str  # held or missed
    detail: str


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
            HELD if drop <= limit else MISSED,
            f"BLEU {row.bleu:.1f} at {speedup:g}x vs {full.bleu:.1f} at full depth: "
            f"{-drop:+.1f} points (allowed -{limit:g}); ROUGE-L {row.rouge_l:.1f} vs {full.rouge_l:.1f}"))
    return out


def beats_second_targets(summary: Summary) -> list[Target]:
    if len(summary.models) < 2:
        return []
    first, second = summary.models[:2]
    out = []
    for row in summary.for_model(first):
        other = summary.find(second, row.speedup)
        if row.speedup <= 1 or other is None:
            continue
        out.append(Target(
            f"{first} beats {second} at {row.speedup:g}x (BLEU)",
            HELD if row.bleu > other.bleu else MISSED,
            f"BLEU {row.bleu:.1f} vs {other.bleu:.1f} ({row.bleu - other.bleu:+.1f}); "
            f"ROUGE-L {row.rouge_l:.1f} vs {other.rouge_l:.1f}"))
    return out


def evaluate(summary: Summary) -> list[Target]:
    return bleu_drop_targets(summary) + beats_second_targets(summary)
