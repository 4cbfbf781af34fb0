"""Text quality under SkipDecode: ``python -m tools.evaluate``.

cli (options, the run, the page), data (unique prompts with all their references), run
(generation per artifact, speedups interleaved per batch, decode timings), metrics (corpus BLEU
with sacrebleu, ROUGE-L with rouge_score; imported lazily, ``pip install -e ".[eval]"``),
summary (rows per model and speedup), targets, report (docs/quality.md).
"""
