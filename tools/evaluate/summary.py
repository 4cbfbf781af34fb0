"""Raw results -> one row per (model, speedup): layers, quality, decode time, measured speedup.

Computed from the hypotheses and timings every time (also by ``--render``), so the page always
matches the raw results it is rendered from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import metrics, slots as slots_mod

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
    slot_errors: slots_mod.SlotSummary | None = None  # E2E MRs only: faithfulness of the hypotheses
    round_speedups: list[float] = field(default_factory=list)  # measured speedup within each round
    prefill_speedup: float = NAN  # full depth's prompt-pass time / this one's, over all rounds

    @property
    def speedup_spread(self) -> tuple[float, float]:
        """(min, max) of the per-round measured speedups (NaN when there is no round)."""
        return (min(self.round_speedups), max(self.round_speedups)) if self.round_speedups else (NAN, NAN)

    @property
    def theoretical(self) -> float:
        """L / avg_layers: the speedup if decode time were proportional to the layers run."""
        return ratio(self.num_layers, self.avg_layers)


@dataclass
class Summary:
    rows: list[Row]
    models: list[str]  # in command-line order; the first is the reference model
    bleu_signature: str
    reference_slot_errors: slots_mod.SlotSummary | None = None  # every reference against its MR

    def for_model(self, name: str) -> list[Row]:
        return [r for r in self.rows if r.model == name]

    def find(self, name: str, speedup: float) -> Row | None:
        return next((r for r in self.rows if r.model == name and r.speedup == speedup), None)


def ratio(a: float, b: float) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return NAN
    return a / b


def _round_ms(timing: dict) -> list[float]:
    return [ratio(s * 1e3, n) for s, n in zip(timing.get("round_decode_seconds", []),
                                              timing.get("round_decode_steps", []))]


def summarize(data: dict) -> Summary:
    references = data["references"]
    prompts = data["prompts"]
    with_slots = slots_mod.is_mr_list(prompts)
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
                avg_layers=ratio(run["layers_run"], run.get("decode_tokens", run.get("decode_steps"))),
                bleu=bleu.score, rouge_l=metrics.rouge_l(run["hypotheses"], references),
                delta_bleu=NAN, ms_per_step=ratio(t["decode_seconds"] * 1e3, t["decode_steps"]),
                measured_speedup=NAN, generated_tokens=run["generated_tokens"],
                hypotheses=run["hypotheses"],
                slot_errors=slots_mod.summarize(prompts, run["hypotheses"]) if with_slots else None))
        full = next((r for r in model_rows if r.speedup == 1), None)
        full_run = next((run for run in model["runs"] if float(run["speedup"]) == 1), None)
        for r, run in zip(model_rows, model["runs"]):
            r.measured_speedup = ratio(full.ms_per_step, r.ms_per_step) if full else NAN
            if full_run:
                r.prefill_speedup = ratio(full_run["timing"].get("prefill_seconds"),
                                          run["timing"].get("prefill_seconds"))
                r.round_speedups = [ratio(f, m) for f, m in zip(_round_ms(full_run["timing"]),
                                                                 _round_ms(run["timing"]))]
        rows += model_rows
    names = [m["name"] for m in data["models"]]
    ref_slots = None
    if with_slots:
        pairs = [(p, ref) for p, refs in zip(prompts, references) for ref in refs]
        ref_slots = slots_mod.summarize([p for p, _ in pairs], [ref for _, ref in pairs])
    summary = Summary(rows, names, signature, ref_slots)
    baseline = summary.find(names[0], 1.0) if names else None
    for r in rows:
        r.delta_bleu = r.bleu - baseline.bleu if baseline else NAN
    return summary
