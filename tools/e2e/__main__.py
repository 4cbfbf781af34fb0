"""``python -m tools.e2e init|distill|consensus|split|rename``: initial model of the E2E demo, distilled
or consensus targets for SkipDecode fine-tuning, a by-MR data split, and copies with invented venue names."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime import cli
from tools.finetune.data import DataError, Example, group_by_prompt, read_pairs, split_by_prompt, write_csv


@dataclass
class DemoArch:
    """The demo model's shape: 12 layers so that 2x-5x budgets are 6 down to ~2.4 layers, narrow
    so that the recipe trains it on the official training split (42k pairs) within its CPU budget
    (measured: 45-70 sequences/s, 10-16 min per epoch on 2 cores) and its fp32 weights stay near 10 MB."""

    layers: int = 12
    hidden: int = 128
    heads: int = 4  # head dim 32
    ffn: int = 512  # 4 x hidden, as OPT
    vocab: int = 1024  # BPE on the training text: the MR attributes and names become single tokens
    max_positions: int = 256  # prompt (<= ~60 tokens) + description (<= ~90 tokens), with room
    dropout: float = 0.1  # ~8.7 references per MR: each MR is seen ~17 times in 2 epochs


def split(args) -> int:
    examples = read_pairs(args.data, args.prompt_column, args.target_column)
    train, val = split_by_prompt(examples, args.val_fraction, args.seed)
    out = Path(args.out)
    write_csv(out / "train.csv", train, args.prompt_column, args.target_column)
    write_csv(out / "val.csv", val, args.prompt_column, args.target_column)
    print(f"train: {len(train)} pairs over {len(group_by_prompt(train))} MRs -> {out / 'train.csv'}")
    print(f"val:   {len(val)} pairs over {len(group_by_prompt(val))} MRs -> {out / 'val.csv'}")
    return 0


def init(args) -> int:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from export.checkpoint import build_tokenizer

    arch = DemoArch()
    examples = read_pairs(args.train, args.prompt_column, args.target_column)
    texts = [ex.prompt for ex in examples] + [" " + ex.target for ex in examples]
    tokenizer = build_tokenizer(arch.vocab, texts)
    config = OPTConfig(
        vocab_size=len(tokenizer), hidden_size=arch.hidden, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, ffn_dim=arch.ffn, word_embed_proj_dim=arch.hidden,
        max_position_embeddings=arch.max_positions, dropout=arch.dropout, attention_dropout=0.0,
        do_layer_norm_before=True, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    torch.manual_seed(args.seed)
    model = OPTForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    lengths = sorted(len(tokenizer(" " + ex.target, add_special_tokens=False)["input_ids"]) + 1
                     for ex in examples)
    n = sum(p.numel() for p in model.parameters())
    print(f"initialised {n / 1e6:.2f}M parameters, vocab {len(tokenizer)} -> {args.out}")
    print(f"target tokens incl. EOS: median {lengths[len(lengths) // 2]}, "
          f"p95 {lengths[int(len(lengths) * 0.95)]}, max {lengths[-1]}")
    return 0


def distill(args) -> int:
    """Sequence-level distillation targets: the full-depth model's greedy description of every MR of
    the training split, kept only where it has no slot error (tools/evaluate/slots.py).

    Why: about 28% of the E2E references drop or misstate a value (slot errors by the same rules),
    and SkipDecode fine-tuning on them taught the shallow policies - and full depth with them - to
    drop values. The full-depth model's greedy texts are the mode of what it learned from all
    ~8.7 references of an MR, and far more faithful (docs/quality.md).
    """
    import runtime
    from runtime.policy import SkipPolicy
    from tools.evaluate.slots import slot_errors

    prompts = list(group_by_prompt(read_pairs(args.train, args.prompt_column, args.target_column)))
    kept, dropped = [], 0
    with runtime.load(args.model, threads=args.threads, max_batch=args.batch_size) as generator:
        full = SkipPolicy.full_depth(generator.num_layers, horizon=args.max_new_tokens)
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            result = generator.generate(batch, args.max_new_tokens, policy=full)
            for mr, text, ids in zip(batch, result.texts, result.token_ids):
                text = text.strip()
                # a text cut at max_new_tokens is unfinished: not a target
                if text and len(ids) < args.max_new_tokens and not slot_errors(mr, text).errors:
                    kept.append(Example(mr, text))
                else:
                    dropped += 1
    if not kept:
        raise DataError(f"{args.model}: none of its {len(prompts)} descriptions is finished and free of "
                        f"slot errors, so there is nothing to fine-tune on; train the full-depth model "
                        f"longer (its descriptions are checked by tools/evaluate/slots.py)")
    write_csv(args.out, kept, args.prompt_column, args.target_column)
    print(f"{len(kept)} of {len(prompts)} MRs kept ({dropped} with a slot error or unfinished) -> {args.out}")
    return 0


def consensus(args) -> int:
    """One target per training MR: the description closest to what the MR's references share.

    The candidates are the MR's references that are faithful (no slot error, tools/evaluate/slots.py)
    and state no value twice (``repeated_values``), and the texts the --candidates files give the MR
    (distill outputs: models' own descriptions), under the same two rules. The chosen one has the
    highest sentence BLEU against the MR's references other than itself. Why: BLEU against ~8.7
    references rewards the phrasing they share; fine-tuning on all references teaches their spread,
    on the model's own descriptions its habits (repeated values), on one consensus per MR the shared
    phrasing; several models' descriptions give it more phrasings to choose from. Only the training
    split is read: nothing is chosen by the development or test references.
    """
    from tools.evaluate.metrics import require, sentence_bleu
    from tools.evaluate.slots import is_mr_list, parse_mr, repeated_values, slot_errors

    require()  # sacrebleu, before reading anything
    groups = group_by_prompt(read_pairs(args.train, args.prompt_column, args.target_column))
    if not is_mr_list(list(groups)):
        raise DataError(f"{args.train}: consensus judges descriptions against E2E meaning representations, "
                        f"but its {args.prompt_column!r} column is not all of the form 'slot[value], ...'")
    extra: dict[str, list[str]] = {}
    for path in args.candidates or []:
        for mr, texts in group_by_prompt(read_pairs(path, args.prompt_column, args.target_column)).items():
            extra.setdefault(mr, []).extend(texts)
    kept, chosen_extra = [], 0
    for mr, refs in groups.items():
        slots = parse_mr(mr)  # once per MR, not twice per candidate
        # (text, index among refs or -1): a reference is not scored against itself
        pool = [(t, i) for i, t in enumerate(refs)] + [(t, -1) for t in extra.get(mr, [])]
        pool = [(t, i) for t, i in pool if not slot_errors(slots, t).errors and not repeated_values(slots, t)]
        if not pool:
            continue
        text, index = max(pool, key=lambda c: sentence_bleu(c[0], [r for j, r in enumerate(refs) if j != c[1]]))
        kept.append(Example(mr, text))
        chosen_extra += index < 0
    if not kept:
        raise DataError(f"{args.train}: no MR has a faithful description without repeated values; "
                        f"nothing to fine-tune on")
    write_csv(args.out, kept, args.prompt_column, args.target_column)
    print(f"{len(kept)} of {len(groups)} MRs kept ({len(groups) - len(kept)} without a faithful candidate; "
          f"{chosen_extra} targets from --candidates) -> {args.out}")
    return 0


def rename(args) -> int:
    """Copies of pairs whose venue names (``name``, ``near``) are invented ones the data never
    contains, the same in the MR and in its descriptions (tools/e2e/names.py).

    Each MR gets --copies renamed copies, each with names of its own (seeded by the MR and the copy),
    and keeps its original pairs with --keep-original. A description in which an old name is left
    (a spelling the slot rules do not know) is dropped: it would teach, or score, the old name.
    """
    import random

    from tools.e2e.names import mapping_for, rename_text
    from tools.evaluate.slots import is_mr_list, parse_mr, slot_errors

    groups = group_by_prompt(read_pairs(args.data, args.prompt_column, args.target_column))
    if not is_mr_list(list(groups)):
        raise DataError(f"{args.data}: rename replaces the name[...] and near[...] of E2E meaning "
                        f"representations, but its {args.prompt_column!r} column is not all of that form")
    out, dropped = [], 0
    for mr, texts in groups.items():
        if args.keep_original:
            out.extend(Example(mr, t) for t in texts)
        slots = parse_mr(mr)
        for copy in range(args.copies):
            mapping = mapping_for(slots, random.Random(f"{args.seed}/{copy}/{mr}"), args.pool)
            new_mr = mr
            for slot in ("name", "near"):
                if slot in slots:
                    new_mr = new_mr.replace(f"{slot}[{slots[slot]}]", f"{slot}[{mapping[slots[slot]]}]")
            for text in texts:
                new = rename_text(text, mapping)
                errors = slot_errors(new_mr, new)
                if any(s in ("name", "near") for s, _ in errors.missing) or any(s == "venue" for s, _ in errors.wrong):
                    dropped += 1
                else:
                    out.append(Example(new_mr, new))
    write_csv(args.out, out, args.prompt_column, args.target_column)
    print(f"{len(out)} pairs over {len(group_by_prompt(out))} MRs ({dropped} renamed descriptions dropped: an "
          f"old name left in them) -> {args.out}")
    return 0


def main(argv=None) -> int:
    p = cli.parser("python -m tools.e2e", __doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", formatter_class=cli.HelpFormatter,
                       help="split E2E pairs by meaning representation into train/val CSVs",
                       description="Split pairs by meaning representation (every reference of an MR on\n"
                                   "one side) into OUT/train.csv and OUT/val.csv.")
    s.add_argument("--data", required=True, help="CSV or JSONL of pairs, gzipped or not (e.g. data/e2e/trainset.csv.gz)")
    s.add_argument("--out", default="data/e2e", help="directory of train.csv and val.csv")
    s.add_argument("--val-fraction", type=float, default=0.1, help="share of the MRs that go to val.csv")
    i = sub.add_parser("init", formatter_class=cli.HelpFormatter,
                       help="train the BPE tokenizer and write a randomly initialised OPT",
                       description="Train the demo's BPE tokenizer on --train and write a randomly\n"
                                   "initialised OPT of the demo's shape (tools/e2e/__main__.py DemoArch).")
    i.add_argument("--train", default="data/e2e/trainset.csv.gz", help="pairs the tokenizer is trained on")
    i.add_argument("--out", required=True, help="Hugging Face checkpoint directory to write")
    d = sub.add_parser("distill", formatter_class=cli.HelpFormatter,
                       help="greedy full-depth descriptions of the training MRs without slot errors, as a "
                            "pairs CSV (the SkipDecode fine-tuning targets)",
                       description=inspect.cleandoc(distill.__doc__).split("\n\n")[0])
    d.add_argument("--model", required=True, help="artifact directory (python -m export build) of the full-depth model")
    d.add_argument("--train", default="data/e2e/trainset.csv.gz", help="pairs whose MRs are described")
    d.add_argument("--out", required=True, help="CSV to write")
    cli.add_max_new_tokens(d, 96, "longest description kept (the longest reference: ~90 tokens)", aliases=())
    d.add_argument("--batch-size", type=int, default=32, help="MRs generated together")
    d.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    c = sub.add_parser("consensus", formatter_class=cli.HelpFormatter,
                       help="one faithful description per training MR, the one closest to its other "
                            "references by sentence BLEU, as a pairs CSV (fine-tuning targets)",
                       description=inspect.cleandoc(consensus.__doc__).split("\n\n")[0])
    c.add_argument("--train", default="data/e2e/trainset.csv.gz", help="pairs: the MRs and their references")
    c.add_argument("--candidates", nargs="+", metavar="CSV",
                   help="pairs CSVs of more candidate descriptions (e.g. `distill`'s outputs of several models)")
    c.add_argument("--out", required=True, help="CSV to write")
    r = sub.add_parser("rename", formatter_class=cli.HelpFormatter,
                       help="copies of pairs with invented venue names, the same in the MR and its "
                            "descriptions (training data, or a renamed development split)",
                       description=inspect.cleandoc(rename.__doc__).split("\n\n")[0])
    r.add_argument("--data", required=True, help="CSV or JSONL of pairs, gzipped or not")
    r.add_argument("--out", required=True, help="CSV to write")
    r.add_argument("--pool", choices=("train", "wide", "dev"), default="train",
                   help="the invented names' pool: train or wide (6,062 words) for fine-tuning data, dev for a "
                        "development split (no word in common with the others: a dev split's names stay unseen)")
    r.add_argument("--copies", type=int, default=1, help="renamed copies of each MR")
    r.add_argument("--keep-original", action="store_true", help="also write the original pairs")
    for q in (s, i, d, c, r):
        q.add_argument("--prompt-column", default="mr", help="the MRs' column")
        q.add_argument("--target-column", default="ref", help="the descriptions' column")
        q.add_argument("--seed", type=int, default=0, help="the split's draw; init's weights")
    args = p.parse_args(argv)
    commands = {"split": split, "init": init, "distill": distill, "consensus": consensus, "rename": rename}
    return cli.run(lambda: commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
