"""Benchmarks, trtexec profiling, evaluation and fine-tuning tools (added by later issues)."""
