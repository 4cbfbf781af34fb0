"""``--policy S=MAX:MIN``: a run's own policy for a speedup (tools.finetune trains it, skipdecode.json's
``speedup_policies`` records it, tools.evaluate.perplexity scores it). No torch: parsers import it."""

from __future__ import annotations

import argparse


def own_policy(text: str) -> tuple[float, int, int]:
    """"S=MAX:MIN" -> (S, MAX, MIN): "5=18:3" -> (5.0, 18, 3) (an argparse type)."""
    try:
        speedup, budgets = text.split("=")
        hi, lo = budgets.split(":")
        return float(speedup), int(hi), int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not S=MAX:MIN (e.g. 5=18:3)") from None
