"""The evaluation set: unique prompts in file order, each with all of its references."""

from __future__ import annotations

from dataclasses import dataclass

from tools.finetune.data import DataError, group_by_prompt, read_pairs


@dataclass
class EvalSet:
    prompts: list[str]
    references: list[list[str]]  # references[i]: every target of prompts[i], in file order
    pairs: int  # (prompt, target) rows read, before --limit


def load(path, prompt_column: str = "prompt", target_column: str = "target",
         limit: int | None = None) -> EvalSet:
    """Read a CSV or JSONL of (prompt, target) pairs; ``limit`` keeps the first N unique prompts."""
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1, got {limit}")
    examples = read_pairs(path, prompt_column, target_column)
    groups = list(group_by_prompt(examples).items())[:limit]
    return EvalSet([p for p, _ in groups], [refs for _, refs in groups], len(examples))
