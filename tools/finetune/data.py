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
    weights: list[float] | None = None  # the loss weight of each target token and EOS (None: all 1)


COPY_CHARS = 4  # a copied token's letters lie in a string of this many characters the prompt holds
COMMON_SHARE = 0.01  # a word in at least this share of the targets is the task's vocabulary, not a copy


def _word(text: str, start: int, end: int) -> str:
    """The whitespace-delimited word of ``text`` around the span, without its closing punctuation."""
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    while end < len(text) and not text[end].isspace():
        end += 1
    return text[start:end].strip().rstrip(".,;:!?")


def common_words(targets: list[str], share: float = COMMON_SHARE) -> set[str]:
    """The words found in at least ``share`` of ``targets``: what every answer of the task says."""
    counts: dict[str, int] = defaultdict(int)
    for t in targets:
        for w in {word.rstrip(".,;:!?") for word in t.split()}:  # as _word reads them
            counts[w] += 1
    return {w for w, c in counts.items() if c >= share * len(targets)}


def copied_tokens(prompt: str, text: str, offsets: list[tuple[int, int]], common: set[str] = frozenset(),
                  min_chars: int = COPY_CHARS) -> list[bool]:
    """For each token of ``text`` (``offsets``: its character spans), whether it copies a rare string
    of the prompt: each of its non-space characters lies inside a string of at least ``min_chars``
    characters that ``prompt`` holds verbatim, and its word is not in ``common``. Characters, not
    tokens, because a name tokenizes differently after the MR's '[' than after a space ("T" "aste"
    against " Taste")."""
    seen = {prompt[i:i + min_chars] for i in range(len(prompt) - min_chars + 1)}
    covered = [False] * len(text)
    for i in range(len(text) - min_chars + 1):
        if text[i:i + min_chars] in seen:
            covered[i:i + min_chars] = [True] * min_chars
    flags = []
    for start, end in offsets:
        letters = [c for c in range(start, end) if not text[c].isspace()]
        flags.append(bool(letters) and all(covered[c] for c in letters)
                     and _word(text, letters[0], letters[-1] + 1) not in common)
    return flags


def encode(tokenizer, example: Example, separator: str = " ", max_len: int | None = None,
           copy_weight: float = 1.0, common: set[str] = frozenset()) -> Encoded:
    """``copy_weight``: the loss weight of the target tokens that copy a rare string of the prompt
    (copied_tokens, ``common`` the words that are not rare), the others and EOS weighing 1."""
    prompt = tokenizer(example.prompt)["input_ids"]  # BOS + prompt, as the runtime encodes it
    text = separator + example.target
    weights = None
    if copy_weight == 1.0:
        target = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as exc:  # a Python ("slow") tokenizer has no character offsets
            raise DataError(f"--copy-weight needs a tokenizer that reports character offsets (a fast, Rust "
                            f"tokenizer); {type(tokenizer).__name__} has none: drop --copy-weight") from exc
        target = enc["input_ids"]
        weights = [copy_weight if c else 1.0 for c in copied_tokens(example.prompt, text, enc["offset_mapping"], common)]
        weights.append(1.0)  # EOS
    ids = prompt + target + [tokenizer.eos_token_id]
    if max_len is not None and len(ids) > max_len:
        raise DataError(
            f"example of {len(ids)} tokens exceeds the model's {max_len} positions: "
            f"{example.prompt[:60]!r}...; drop it or use a model with more positions")
    return Encoded(ids, len(prompt), weights)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) right padded with pad_id
    attention_mask: torch.Tensor  # (B, T) 1 for real tokens
    labels: torch.Tensor  # (B, T) next token at each position, -100 where no loss
    prompt_lens: torch.Tensor  # (B,) prompt tokens per row (BOS included)
    weights: torch.Tensor | None = None  # (B, T) float loss weight where labels has a target, else 0

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.attention_mask, self.labels, self.prompt_lens, self.weights)))


def collate(items: list[Encoded], pad_id: int) -> Batch:
    """Right-pad a list of encoded pairs. labels[b, t] = input_ids[b, t+1] for the positions that
    predict a target token or EOS (t >= prompt_len - 1), else -100."""
    import torch

    T = max(len(e.input_ids) for e in items)
    B = len(items)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    weighted = any(e.weights is not None for e in items)
    weights = torch.zeros((B, T), dtype=torch.float32) if weighted else None
    for b, e in enumerate(items):
        n = len(e.input_ids)
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[b, :n] = ids
        attention_mask[b, :n] = 1
        labels[b, e.prompt_len - 1:n - 1] = ids[e.prompt_len:]
        if weighted:
            weights[b, e.prompt_len - 1:n - 1] = torch.tensor(e.weights) if e.weights else 1.0
    prompt_lens = torch.tensor([e.prompt_len for e in items], dtype=torch.long)
    return Batch(input_ids, attention_mask, labels, prompt_lens, weights)


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


def read_text(path, column: str | None) -> str:
    """A .txt file's text, or a .csv/.jsonl (.gz) column's unique values in file order, one per line."""
    path = Path(path)
    if column is None:
        if not path.is_file():
            raise DataError(f"text file {path} does not exist")
        return path.read_text(encoding="utf-8")
    rows = read_rows(path)
    if column not in rows[0]:
        raise DataError(f"{path} has no column {column!r}; its columns: {', '.join(rows[0])}")
    return "\n".join(dict.fromkeys(str(r[column]).strip() for r in rows if str(r[column]).strip()))


def token_windows(tokenizer, text: str, width: int, count: int, fix: str, error: type = DataError):
    """(N, width) token ids, N = min(count, as many as the text holds): consecutive windows from its
    start; ``error`` where it holds none, its message ending with ``fix`` (how to get one)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = min(count, len(ids) // width)
    if n < 1:
        raise error(f"the text has {len(ids)} tokens, fewer than one window of {width}{fix}")
    return torch.tensor(ids[:n * width]).view(n, width)
