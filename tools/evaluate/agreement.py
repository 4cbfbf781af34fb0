"""``python -m tools.evaluate.agreement``: how closely an artifact's next-token predictions follow a
reference artifact's (a quantized export against the float export of the same model).

Prompts are windows of a held text (``--prompts`` of them, 3 to 24 words each at seeded offsets);
each artifact's first-token logits at full depth are compared: top-1 agreement (the share of
prompts whose greedy next token is the same) and the mean KL divergence KL(reference || model) of
the next-token distributions. Prints one Markdown table.

Example (the int4 export of the real SmolLM2-135M-Instruct against its float32 export):

  python -m tools.evaluate.agreement --reference artifacts/smollm2-135m-instruct \\
      --model int4=artifacts/smollm2-int4 --text data/prose/essays.txt --prompts 200
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import numpy as np

from runtime import cli
from runtime.errors import SkipDecodeError


class AgreementError(SkipDecodeError):
    """A text too short for the prompts asked, or artifacts of different vocabularies."""


@dataclass(frozen=True)
class Row:
    name: str
    top1: float  # share of prompts whose argmax equals the reference's
    mean_kl: float  # mean KL(reference || model) in nats


def prompts_of(text: str, count: int, seed: int = 0, shortest: int = 3, longest: int = 24) -> list[str]:
    """``count`` windows of ``text``'s words, each ``shortest``..``longest`` words from a seeded offset."""
    words = text.split()
    if len(words) < longest + 1:
        raise AgreementError(f"the text has {len(words)} words; windows of up to {longest} need more")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        start = rng.randrange(len(words) - n)
        out.append(" ".join(words[start:start + n]))
    return out


def next_logits(gen, prompts: list[str], batch: int = 8) -> np.ndarray:
    """(P, V) float64: each prompt's first generated token's logits at full depth."""
    rows = []
    for s in range(0, len(prompts), batch):
        part = prompts[s:s + batch]
        found = {}
        for event in gen.stream(part, 1, ignore_eos=True):
            found.update({b: event.logits[b] for b, t in enumerate(event.token_ids) if t is not None})
        rows += [np.asarray(found[b], np.float64) for b in range(len(part))]
    return np.stack(rows)


def compare(name: str, reference: np.ndarray, logits: np.ndarray) -> Row:
    if reference.shape != logits.shape:
        raise AgreementError(f"{name}'s logits are {logits.shape[1]} wide, the reference's {reference.shape[1]}: "
                             f"compare exports of the same model")
    log_p = reference - np.logaddexp.reduce(reference, axis=-1, keepdims=True)  # (P, V)
    log_q = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)  # (P,)
    top1 = float((reference.argmax(-1) == logits.argmax(-1)).mean())
    return Row(name, top1, float(kl.mean()))


def table(rows: list[Row], count: int) -> str:
    lines = [f"| model | top-1 agreement ({count} prompts) | mean KL (nats) |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.top1:.3f} | {r.mean_kl:.4f} |" for r in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.evaluate.agreement",
                   "Top-1 agreement and mean KL of artifacts' next-token predictions against a reference "
                   "artifact's (a quantized export against the float one), on windows of a held text.")
    p.add_argument("--reference", required=True, help="the artifact to agree with (e.g. the float32 export)")
    p.add_argument("--model", required=True, nargs="+", metavar="[NAME=]DIR", help="artifacts to compare")
    p.add_argument("--text", required=True, help="a .txt file, or a .csv/.jsonl (.gz) with --column")
    p.add_argument("--column", help="the column of a .csv/.jsonl --text whose unique values make the text")
    p.add_argument("--prompts", type=int, default=200, help="windows of the text to compare on")
    p.add_argument("--seed", type=int, default=0, help="the windows' offsets and lengths")
    p.add_argument("--threads", type=int, help="ONNX Runtime's intra-op threads")
    p.add_argument("--int4-kernel", choices=("auto", "skipdecode", "onnxruntime"), default="auto",
                   help="the int4 kernel of the compared artifacts (auto: this project's where it runs)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import runtime
    from tools.evaluate.perplexity import read_text

    if args.prompts < 1:
        raise AgreementError(f"--prompts {args.prompts}: give a positive number of windows")
    prompts = prompts_of(read_text(args.text, args.column), args.prompts, args.seed)
    options = {"threads": args.threads} if args.threads else {}

    def logits_of(directory: str, **extra) -> np.ndarray:
        gen = runtime.load(directory, **options, **extra)
        try:
            return next_logits(gen, prompts)
        finally:
            gen.close()

    reference = logits_of(args.reference)
    rows = []
    for spec in args.model:
        name, _, directory = spec.rpartition("=")
        rows.append(compare(name or directory, reference, logits_of(directory, int4_kernel=args.int4_kernel)))
        print(f"{rows[-1].name}: top-1 {rows[-1].top1:.3f}, mean KL {rows[-1].mean_kl:.4f}", file=sys.stderr)
    print(table(rows, len(prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
