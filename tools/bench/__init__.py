"""Benchmarks: SkipDecode's measured wall-clock speedup against full depth and the peers.

cli (options, the run), rows (shapes, rows, policies), prepare (the shared weights), prompts
(exact-length prompts), worker / optimum_worker / hf_generate (one timed measurement in a fresh
process), runner (subprocesses, interleaved rounds), bandwidth, stats, results, targets, report,
plot, machine, venv (the Optimum peer's own environment); startup (``import runtime`` to the first
token, on its own: ``python -m tools.bench.startup ARTIFACT``).
"""
