"""(prompt, target) pairs from CSV or JSONL, tokenized and batched for training.

A pair becomes ``BOS prompt`` (what the runtime feeds the model for that prompt) followed by
``separator + target EOS``. The loss covers the target tokens and EOS only.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import SkipDecodeError

if TYPE_CHECKING:  # torch is imported where batches are built: reading data needs no torch
    import torch


class DataError(SkipDecodeError):
    """A training or evaluation data file is missing, unreadable or lacks its columns."""


@dataclass(frozen=True)
class Example:
    prompt: str
    target: str


def _open_text(path: Path):
    """A text stream of ``path``; a ``.gz`` file is decompressed on the fly."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def read_rows(path) -> list[dict]:
    """The rows of a .csv (header row) or .jsonl (one object per line), either optionally
    gzip-compressed (.csv.gz, .jsonl.gz), as dicts; raises DataError on a missing, empty or
    unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    suffix = Path(path.stem).suffix.lower() if path.suffix.lower() == ".gz" else path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}:{n} is not a JSON object: {exc}") from exc
    elif suffix == ".csv":
        with _open_text(path) as f:
            rows = list(csv.DictReader(f))
    else:
        raise DataError(f"{path}: expected a .csv or .jsonl file (optionally .gz), "
                        f"got {''.join(path.suffixes) or 'no suffix'!r}")
    if not rows:
        raise DataError(f"{path} holds no rows")
    return rows


def read_pairs(path, prompt_column: str = "prompt", target_column: str = "target") -> list[Example]:
    """Read (prompt, target) pairs from a .csv or .jsonl, optionally gzip-compressed (read_rows)."""
    rows = read_rows(path)
    missing = [c for c in (prompt_column, target_column) if c not in rows[0]]
    if missing:
        raise DataError(
            f"{path} lacks the column(s) {', '.join(map(repr, missing))}; its columns are "
            f"{', '.join(map(repr, rows[0]))}. Name them with --prompt-column / --target-column")
    return [Example(str(r[prompt_column]), str(r[target_column])) for r in rows]


def group_by_prompt(examples: list[Example]) -> dict[str, list[str]]:
    """prompt -> its targets (references), in file order."""
    groups: dict[str, list[str]] = defaultdict(list)
    for ex in examples:
        groups[ex.prompt].append(ex.target)
    return dict(groups)


def split_by_prompt(examples: list[Example], val_fraction: float, seed: int = 0):
    """Split into (train, val) so that no prompt has targets in both: a shuffled set of whole
    prompts (with all their targets) goes to validation."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    prompts = sorted(group_by_prompt(examples))
    random.Random(seed).shuffle(prompts)
    n_val = max(1, round(len(prompts) * val_fraction))
    val_prompts = set(prompts[:n_val])
    train = [ex for ex in examples if ex.prompt not in val_prompts]
    val = [ex for ex in examples if ex.prompt in val_prompts]
    return train, val


def write_csv(path, examples: list[Example], prompt_column="prompt", target_column="target") -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow([prompt_column, target_column])
        w.writerows((ex.prompt, ex.target) for ex in examples)


@dataclass
class Encoded:
    input_ids: list[int]  # BOS prompt separator+target EOS
    prompt_len: int  # tokens the runtime would see as the prompt (BOS included)


def encode(tokenizer, example: Example, separator: str = " ", max_len: int | None = None) -> Encoded:
    prompt = tokenizer(example.prompt)["input_ids"]  # BOS + prompt, as the runtime encodes it
    target = tokenizer(separator + example.target, add_special_tokens=False)["input_ids"]
    ids = prompt + target + [tokenizer.eos_token_id]
    if max_len is not None and len(ids) > max_len:
        raise DataError(
            f"example of {len(ids)} tokens exceeds the model's {max_len} positions: "
            f"{example.prompt[:60]!r}...; drop it or use a model with more positions")
    return Encoded(ids, len(prompt))


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) right padded with pad_id
    attention_mask: torch.Tensor  # (B, T) 1 for real tokens
    labels: torch.Tensor  # (B, T) next token at each position, -100 where no loss
    prompt_lens: torch.Tensor  # (B,) prompt tokens per row (BOS included)

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.labels,
                                              self.prompt_lens)))


def collate(items: list[Encoded], pad_id: int) -> Batch:
    """Right-pad a list of encoded pairs. labels[b, t] = input_ids[b, t+1] for the positions that
    predict a target token or EOS (t >= prompt_len - 1), else -100."""
    import torch

    T = max(len(e.input_ids) for e in items)
    B = len(items)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, e in enumerate(items):
        n = len(e.input_ids)
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[b, :n] = ids
        attention_mask[b, :n] = 1
        labels[b, e.prompt_len - 1:n - 1] = ids[e.prompt_len:]
    prompt_lens = torch.tensor([e.prompt_len for e in items], dtype=torch.long)
    return Batch(input_ids, attention_mask, labels, prompt_lens)


def batches(items: list[Encoded], batch_size: int, pad_id: int, shuffle: bool, rng: random.Random):
    """Yield Batches; shuffled ones group similar lengths (sorted within chunks of 50 batches) to
    waste little compute on padding."""
    order = list(range(len(items)))
    if shuffle:
        rng.shuffle(order)
        chunk = batch_size * 50
        order = [i for s in range(0, len(order), chunk)
                 for i in sorted(order[s:s + chunk], key=lambda i: len(items[i].input_ids))]
        groups = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
        rng.shuffle(groups)
    else:
        groups = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    for g in groups:
        yield collate([items[i] for i in g], pad_id)
