"""Text quality: corpus BLEU (sacrebleu) over a ragged set of references, and ROUGE-L F1
(rouge_score), both on a 0-100 scale.

sacrebleu and rouge_score are imported when a metric is computed, not with this module: the
CPU-only install imports the package without them (``pip install -e ".[eval]"`` adds them).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

from runtime.errors import SkipDecodeError

INSTALL_HINT = 'pip install -e ".[eval]"'
PACKAGES = {"sacrebleu": "sacrebleu", "rouge_score": "rouge-score"}  # module -> distribution


class MetricsUnavailableError(SkipDecodeError, ImportError):
    """sacrebleu or rouge_score is not installed."""


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MetricsUnavailableError(
            f"scoring needs the {PACKAGES[module.split('.')[0]]} package, which is not installed ({exc}); "
            f"install the evaluation extra: {INSTALL_HINT}") from exc


def require() -> None:
    """Raise MetricsUnavailableError now, rather than after generating, if a metric package is missing."""
    for module in PACKAGES:
        _import(module)


@dataclass(frozen=True)
class Bleu:
    score: float  # 0-100
    signature: str  # sacrebleu's, e.g. nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0


def _check(hypotheses: list[str], references: list[list[str]]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    empty = [i for i, refs in enumerate(references) if not refs]
    if empty:
        raise ValueError(f"hypotheses {empty[:5]} have no reference")


def reference_streams(references: list[list[str]]) -> list[list[str | None]]:
    """Per-hypothesis reference lists -> sacrebleu's reference streams (stream k holds every
    hypothesis's k-th reference). Hypotheses with fewer references are padded with None, which
    sacrebleu drops per segment (``_cache_references``); '' would count as an empty reference and
    pull the closest reference length, hence the brevity penalty, towards 0."""
    width = max(len(refs) for refs in references)
    return [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]


def corpus_bleu(hypotheses: list[str], references: list[list[str]]) -> Bleu:
    """Corpus BLEU of ``hypotheses[i]`` against all of ``references[i]`` (any count per item),
    sacrebleu's defaults (13a tokenization, exponential smoothing, mixed case)."""
    _check(hypotheses, references)
    sacrebleu = _import("sacrebleu")
    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(list(hypotheses), reference_streams(references))
    return Bleu(float(result.score), str(metric.get_signature()))


def sentence_bleu(hypothesis: str, references: list[str]) -> float:
    """BLEU of one sentence against its references (sacrebleu's sentence BLEU: effective n-gram
    order, so a short text is not zeroed by a missing 4-gram); 0 with no reference."""
    if not references:
        return 0.0
    return float(_sentence_metric().sentence_score(hypothesis, references).score)


@functools.lru_cache(maxsize=1)
def _sentence_metric():
    return _import("sacrebleu").metrics.BLEU(effective_order=True)


def rouge_l(hypotheses: list[str], references: list[list[str]]) -> float:
    """Mean over items of the best ROUGE-L F1 against the item's references, x100 (rouge_score's
    RougeScorer(["rougeL"], use_stemmer=True))."""
    _check(hypotheses, references)
    rouge_scorer = _import("rouge_score.rouge_scorer")
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    best = [max(scorer.score(ref, hyp)["rougeL"].fmeasure for ref in refs)
            for hyp, refs in zip(hypotheses, references)]
    return 100.0 * sum(best) / len(best)
