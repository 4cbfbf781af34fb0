"""``python -m tools.evaluate.copying``: how well the layers a policy keeps copy a name from the prompt.

Each (prompt, target) pair of a data-to-text file is scored teacher-forced, as tools.finetune
trains: the prompt at full depth, each target token through the layers its decode step runs under
the policy (tools.finetune's masked forward, which equals step-by-step decoding). Printed per
policy: the share of target tokens that are the model's argmax, for the tokens that copy a rare
string of the prompt (a venue's new name: tools.finetune.data.copied_tokens, the rule
``--copy-weight`` weighs) and for the others. Why: on new venue names the 5x policy's slot errors
are names cut short or misspelt (docs/quality.md, "New venue names"), and greedy decoding's errors
follow its argmax.

    python -m tools.evaluate.copying --model .work/tenth --data .work/devset-renamed.csv \\
        --speedups 1 5 --budgets 8 12 16 --mrs 96
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

from runtime import cli
from runtime.errors import SkipDecodeError


class CopyingError(SkipDecodeError):
    """Data without the columns asked for, or without a token that copies the prompt."""


@dataclass(frozen=True)
class Row:
    policy: str  # what was asked ("5x", "budget 12", a JSON policy) and SkipPolicy's description
    copied: float  # argmax accuracy on the tokens that copy a rare string of the prompt
    copied_tokens: int
    other: float  # on the other target tokens (EOS included)
    other_tokens: int


def pairs(path, prompt_column: str, target_column: str) -> list:
    """One pair per distinct prompt (its first target), in file order."""
    from tools.finetune.data import Example, read_rows

    rows = read_rows(path)
    missing = [c for c in (prompt_column, target_column) if c not in rows[0]]
    if missing:
        raise CopyingError(f"{path} has no column {missing[0]!r}; its columns: {', '.join(rows[0])}")
    first = {}
    for r in rows:
        first.setdefault(str(r[prompt_column]), str(r[target_column]))
    return [Example(p, t) for p, t in first.items()]


def encoded(tokenizer, examples: list, mrs: int, seed: int = 0, separator: str = " ") -> list:
    """``mrs`` of the pairs (drawn with ``seed``) as tools.finetune encodes them, a copied token
    weighing 2 and the rest 1; the task's common words counted over all of them (a word in 1% of a
    few dozen targets would be any word)."""
    from tools.finetune.data import common_words, encode

    common = common_words([e.target for e in examples])
    chosen = random.Random(seed).sample(examples, min(mrs, len(examples)))
    return [encode(tokenizer, e, separator, None, 2.0, common) for e in chosen]


def measure(model, items: list, policies: dict, pad_id: int, batch_size: int = 16) -> list[Row]:
    """``policies``: {label: SkipPolicy}; a Row each."""
    import torch

    from tools.finetune.data import collate
    from tools.finetune.skip import layer_mask, skip_forward

    rows = []
    for label, policy in policies.items():
        right, total = [0, 0], [0, 0]  # copied, other
        for start in range(0, len(items), batch_size):
            batch = collate(items[start:start + batch_size], pad_id)
            B, T = batch.input_ids.shape
            with torch.no_grad():
                logits = skip_forward(model, batch.input_ids, batch.attention_mask,
                                      layer_mask([policy] * B, batch.prompt_lens, T))  # (B, T, V)
            hit = logits.argmax(-1) == batch.labels  # (B, T)
            scored = batch.labels != -100
            for k, where in enumerate((scored & (batch.weights > 1), scored & (batch.weights <= 1))):
                right[k] += int(hit[where].sum())
                total[k] += int(where.sum())
        if not total[0]:
            raise CopyingError("no target token copies a rare string of its prompt: nothing to score")
        rows.append(Row(f"{label}: {policy}", right[0] / total[0], total[0], right[1] / max(total[1], 1), total[1]))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| policy | copied tokens: argmax right | other tokens: argmax right |", "|---|---|---|"]
    lines += [f"| {r.policy} | {r.copied:.3f} ({r.copied_tokens}) | {r.other:.3f} ({r.other_tokens}) |" for r in rows]
    return "\n".join(lines)


def _policies(num_layers: int, args) -> dict:
    from runtime.policy import SkipPolicy

    out = {f"{s:g}x": SkipPolicy.for_speedup(num_layers, s, horizon=args.horizon) for s in args.speedups}
    out.update({f"budget {b}": SkipPolicy(num_layers, b, b, horizon=args.horizon) for b in args.budgets})
    for text in args.policy:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CopyingError(f"--policy {text!r} is not JSON ({exc.msg})") from None
        out[text] = SkipPolicy.from_fields(num_layers, fields, args.horizon)
    return out


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.evaluate.copying", __doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--model", required=True, help="as `python -m export build --model` takes it")
    p.add_argument("--data", required=True, help="a .csv/.jsonl (.gz) of prompts and targets")
    p.add_argument("--prompt-column", default="mr", help="(default: mr)")
    p.add_argument("--target-column", default="ref", help="(default: ref)")
    p.add_argument("--speedups", type=float, nargs="*", default=[1.0, 5.0], metavar="S",
                   help="policies as --speedup S picks them (default: 1 5)")
    p.add_argument("--budgets", type=int, nargs="*", default=[], metavar="B",
                   help="constant budgets: the warm-up layer and the top B - 1 at every step")
    p.add_argument("--policy", action="append", default=[], metavar="JSON",
                   help='a policy of its own, e.g. \'{"max_layers": 18, "min_layers": 3, "decay": "power", "exponent": 4}\'')
    p.add_argument("--horizon", type=int, default=64, help="the policies' horizon (default: 64)")
    p.add_argument("--mrs", type=int, default=96, help="distinct prompts scored (default: 96)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar while the model loads")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import torch

    from export import checkpoint
    from runtime.models import skip_model

    examples = pairs(args.data, args.prompt_column, args.target_column)
    hf_model, tokenizer = checkpoint.load(checkpoint.resolve(args.model), dtype=torch.float32,
                                          progress=cli.progress(args.quiet))
    model = skip_model(hf_model).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    items = encoded(tokenizer, examples, args.mrs)
    rows = measure(model, items, _policies(model.num_layers, args), pad)
    print(f"{args.model}: {len(items)} of the {len(examples)} prompts of {args.data}, teacher-forced")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
