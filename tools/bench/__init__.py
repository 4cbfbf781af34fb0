"""Benchmarks: SkipDecode's measured wall-clock speedup against full depth and the peers.

cli (options, the run), rows (shapes, rows, policies), prepare (the shared weights), prompts
(exact-length prompts), worker / optimum_worker / ortgenai_worker / hf_generate (one timed
measurement in a fresh process), runner (subprocesses, interleaved rounds), bandwidth, stats,
results, targets, report, plot, machine, venv (the peers' own environments); startup (``import runtime`` to the first
token, on its own: ``python -m tools.bench.startup ARTIFACT``); serving (continuous batching against
static batches and one at a time); slots (a lone request's decode time against the Generator's
max_batch) and gap (a running row's longest inter-token gap while a long prompt joins), which
measure other copies of the repository side by side with ``--checkout`` (checkouts).
"""
