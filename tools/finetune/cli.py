"""``python -m tools.finetune``: fine-tune a checkpoint (OPT or the Llama family) under SkipDecode policies."""

from __future__ import annotations

import argparse

from runtime import cli
from runtime.policy import DECAYS, PREFILLS

from .own_policy import own_policy
from .train import TrainConfig, train


def _parser() -> argparse.ArgumentParser:
    p = cli.parser(
        "python -m tools.finetune",
        "Fine-tune a checkpoint (OPT, Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3) with the SkipDecode\n"
        "policy applied as at inference (prompt at full depth, one decaying budget per generated\n"
        "position). Writes a Hugging Face directory that `python -m export build --model DIR` accepts.")
    p.add_argument("--model", required=True,
                   help="what to start from, as `python -m export build --model` takes it: a Hugging Face "
                        "checkpoint directory, a GGUF file, or an alias (smollm2-135m-instruct)")
    p.add_argument("--train", required=True, help="CSV or JSONL of (prompt, target) pairs")
    p.add_argument("--val", help="held-out pairs: validation loss per policy after each epoch")
    p.add_argument("--out", required=True, help="output directory (checkpoint-N/ folders go inside)")
    # the shipped E2E data's names (data/e2e)
    p.add_argument("--prompt-column", default="mr", help="the prompts' column (as data/e2e)")
    p.add_argument("--target-column", default="ref", help="the targets' column (as data/e2e)")
    p.add_argument("--separator", default=" ", help="text between prompt and target (default: %(default)r)")
    p.add_argument("--speedups", type=float, nargs="+", default=[1.0], metavar="S",
                   help="horizon speedups whose policies each row samples from; 1 = full depth "
                        "(1 alone: plain fine-tuning). E.g. --speedups 1 2 3 4 5 serves all five")
    p.add_argument("--horizon", type=int,
                   help="decode steps the budget decay spans (default: the model's skipdecode.json, else 64)")
    p.add_argument("--warmup-layers", type=int, default=1, help="bottom layers every step runs")
    p.add_argument("--decay", choices=DECAYS, default="linear",
                   help="budget curve of the policies over the horizon (linear: the paper's)")
    p.add_argument("--exponent", type=float, default=2.0,
                   help="power decay: budget = min + (max - min) * (1 - t) ** exponent")
    p.add_argument("--policy", action="append", default=[], type=own_policy, metavar="S=MAX:MIN",
                   help="the policy of speedup S (one of --speedups): budgets MAX -> MIN over the horizon "
                        "instead of the one for_speedup picks (its max:min near 2:1), e.g. 5=18:3 with "
                        "--decay power --exponent 4: deep first tokens; recorded as skipdecode.json's "
                        "speedup_policies, which export and --speedup S then use")
    p.add_argument("--prefill", choices=PREFILLS, default="full",
                   help="the prompt's layers under a policy: full depth or the first step's active set")
    p.add_argument("--epochs", type=int, default=10, help="passes over --train")
    p.add_argument("--max-steps", type=int, metavar="N",
                   help="run N optimizer steps instead of --epochs passes (the data repeats as needed; "
                        "the learning-rate schedule spans the N steps)")
    p.add_argument("--batch-size", type=int, default=32, help="pairs per optimizer step")
    p.add_argument("--max-train", type=int, metavar="N",
                   help="train on a seeded random subset of N pairs of --train (default: all)")
    p.add_argument("--faithful-only", action="store_true",
                   help="E2E: train only on the pairs whose target has no slot error against its MR "
                        "(tools/evaluate/slots.py; before --max-train draws its subset)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R on every decoder linear layer instead of full "
                        "fine-tuning (needs peft); the output holds the merged model and adapter/")
    p.add_argument("--deep-copies", type=int, metavar="LAYERS",
                   help="record deep copies in skipdecode.json: a step whose input lies in a rare string of "
                        "the prompt runs LAYERS layers (the warm-up and the top ones; runtime.decoding.copying), "
                        "rare = outside the words of 1%% of the targets (default: the starting model's)")
    p.add_argument("--copy-weight", type=float, default=1.0, metavar="W",
                   help="weigh W times in the loss the target tokens that copy a rare string of the prompt "
                        "(each letter in a string of 4+ characters the prompt holds, a word in under 1%% of "
                        "the targets: a name), the rest 1: what skipping policies get wrong on names they "
                        "never saw (1: no weighting)")
    p.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="with --lora-rank: W of the loss is the KL divergence from the starting model's own "
                        "full-depth predictions at each target token (self-distillation: the policies learn "
                        "what full depth would say, full depth stays close to the model it was), 1 - W the "
                        "cross-entropy on the targets (0: cross-entropy alone)")
    p.add_argument("--skipping-only", action="store_true",
                   help="with --lora-rank: the adapters act only on the tokens that skip layers; the prompt's pass "
                        "and full depth stay the starting model exactly (for export build --draft-adapter: "
                        "the adapted layers become a lossless row's drafts)")
    p.add_argument("--bridges", metavar="FILE",
                   help="linear bridges over the skipped layers (`python -m tools.finetune.bridge`), fixed: the "
                        "tokens that jump over layers go through them in training, as they must where the result "
                        "is scored (tools.evaluate.perplexity --bridges)")
    p.add_argument("--lora-alpha", type=float, help="LoRA's alpha: the adapters are scaled by alpha / R (default: 2 R)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW's peak learning rate (linear warm-up, then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's weight decay")
    p.add_argument("--seed", type=int, default=0, help="batch order, policy draws and dropout")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (and at each epoch's end)")
    p.add_argument("--val-every", type=int,
                   help="steps between validations (default: at each epoch's end; always at the last step)")
    p.add_argument("--no-select-best", dest="select_best", action="store_false",
                   help="keep the last step's weights instead of those with the lowest mean validation "
                        "loss over the policies (selection needs --val)")
    p.add_argument("--resume", nargs="?", const="auto",
                   help="continue from the latest checkpoint in --out, or from the one named: its optimizer "
                        "and learning rate go on (a new --max-steps stretches the schedule; a new --lr is not used)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    cfg = TrainConfig(
        model=args.model, train=args.train, val=args.val, out=args.out,
        prompt_column=args.prompt_column, target_column=args.target_column,
        separator=args.separator, speedups=tuple(args.speedups), horizon=args.horizon,
        warmup_layers=args.warmup_layers, decay=args.decay, exponent=args.exponent, policies=tuple(args.policy),
        prefill=args.prefill, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
        max_train=args.max_train, faithful_only=args.faithful_only, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, copy_weight=args.copy_weight, distill=args.distill,
        deep_copies=args.deep_copies,
        skipping_only=args.skipping_only, bridges=args.bridges,
        lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, device=args.device,
        threads=args.threads, checkpoint_every=args.checkpoint_every, val_every=args.val_every,
        select_best=args.select_best, resume=args.resume,
        progress=cli.progress(args.quiet))
    return cli.run(lambda: print(f"saved {train(cfg)}"))
