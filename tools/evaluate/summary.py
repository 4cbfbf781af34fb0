"""Raw results -> one row per (model, speedup): layers, quality, decode time, measured speedup.

Computed from the hypotheses and timings every time (also by ``--render``), so the page always
matches the raw results it is rendered from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import metrics

NAN = float("nan")


@dataclass
class Row:
    model: str
    speedup: float  # the target; 1 = full depth
    policy: dict | None  # SkipPolicy.to_dict() of the policy generate chose
    num_layers: int
    avg_layers: float  # mean decoder layers run per decode step (= per generated token after the first)
    bleu: float
    rouge_l: float
    delta_bleu: float  # BLEU - the first model's full-depth BLEU
    ms_per_step: float  # decode time per step (one token for every row of the batch), all rounds
    measured_speedup: float  # the same model's full-depth ms_per_step / ms_per_step
    generated_tokens: int
    hypotheses: list[str]

    @property
    def theoretical(self) -> float:
        """L / avg_layers: the speedup if decode time were proportional to the layers run."""
        return ratio(self.num_layers, self.avg_layers)


@dataclass
class Summary:
    rows: list[Row]
    models: list[str]  # in command-line order; the first is the reference model
    bleu_signature: str

    def for_model(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.model == name]

    def find(self, name: str, speedup: float) -> Row | None:
        return next((r for r in self.rows if r.model == name and r.speedup == speedup), None)


def ratio(a: float, b: float) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return NAN
    return a / b


def summarize(data: dict) -> Summary:
    references = data["references"]
    rows, signature = [], ""
    for model in data["models"]:
        model_rows = []
        for run in model["runs"]:
            bleu = metrics.corpus_bleu(run["hypotheses"], references)
            signature = bleu.signature
            t = run["timing"]
            model_rows.append(Row(
                model=model["name"], speedup=float(run["speedup"]), policy=run["policy"],
                num_layers=model["num_layers"],
                avg_layers=ratio(run["layers_run"], run["decode_steps"]),
                bleu=bleu.score, rouge_l=metrics.rouge_l(run["hypotheses"], references),
                delta_bleu=NAN, ms_per_step=ratio(t["decode_seconds"] * 1e3, t["decode_steps"]),
                measured_speedup=NAN, generated_tokens=run["generated_tokens"],
                hypotheses=run["hypotheses"]))
        full = next((r for r in model_rows if r.speedup == 1), None)
        for r in model_rows:
            r.measured_speedup = ratio(full.ms_per_step, r.ms_per_step) if full else NAN
        rows += model_rows
    names = [m["name"] for m in data["models"]]
    summary = Summary(rows, names, signature)
    baseline = summary.find(names[0], 1.0) if names else None
    for r in rows:
        r.delta_bleu = r.bleu - baseline.bleu if baseline else NAN
    return summary
