"""``python -m tools.evaluate.perplexity``: what a skip policy does to a model's perplexity.

A held text is cut into windows of ``--prompt-tokens`` + ``--tokens`` tokens. The prompt runs at
full depth; each following token is scored as if the model had generated it, through the layers
its decode step runs under the policy (the budget decays over ``--tokens`` steps, as a generation
of that length with ``--speedup``). One dense pass per batch computes it (tools.finetune's masked
forward, which equals step-by-step decoding: tests/tools/test_finetune.py). Prints a Markdown table:
speedup, policy, layers per scored token, perplexity, and its ratio to full depth.

Example (the real SmolLM2-135M-Instruct on the E2E development references):

  python -m tools.evaluate.perplexity --model smollm2-135m-instruct --text data/e2e/devset.csv.gz \\
      --column ref --speedups 1 1.3 2 3
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from runtime import cli
from runtime.errors import SkipDecodeError
from tools.finetune.data import read_text, token_windows
from tools.finetune.own_policy import own_policy


class PerplexityError(SkipDecodeError):
    """A text too short for one window, or a column the data lacks."""


@dataclass(frozen=True)
class Row:
    speedup: float
    policy: str  # SkipPolicy's one-line description
    layers_per_token: float  # mean layers run per scored token (the first from the full-depth prompt)
    perplexity: float


@dataclass
class Settings:
    prompt_tokens: int = 32  # each window's prompt, run at full depth (the paper's prefill)
    tokens: int = 128  # scored tokens per window; the policy decays over them (its horizon)
    windows: int = 32  # windows taken from the start of the text: prompt_tokens + tokens each
    batch_size: int = 8  # windows per forward pass
    warmup_layers: int = 1  # bottom layers every step runs (the paper's setting)


def windows(tokenizer, text: str, settings: Settings):
    """(N, prompt_tokens + tokens) token ids: consecutive windows from the text's start."""
    return token_windows(tokenizer, text, settings.prompt_tokens + settings.tokens, settings.windows,
                         f" (--prompt-tokens {settings.prompt_tokens} + --tokens {settings.tokens}); "
                         f"pass a longer text or smaller windows", PerplexityError)


def policies(num_layers: int, speedups, settings: Settings, own=()) -> dict:
    """{speedup: SkipPolicy}: each over ``settings.tokens`` steps, as a generation of that length
    picks it for ``--speedup``, or the (speedup, max_layers, min_layers) of ``own`` for its speedup
    (``--policy``, as tools.finetune's and skipdecode.json's ``speedup_policies``). An impossible one,
    or one of ``own`` that is not its speedup's, raises PolicyError; one for a speedup that
    ``speedups`` lacks, PerplexityError."""
    from tools.finetune.skip import PolicySampler  # the policies fine-tuning trains under, the same way

    speedups = tuple(speedups)
    missing = [s for s, _, _ in own if s not in speedups]
    if missing:
        raise PerplexityError(f"--policy names speedup {missing[0]:g}, which --speedups does not score; add it there")
    sampler = PolicySampler(num_layers, speedups, settings.tokens, settings.warmup_layers, own=tuple(own))
    if own:
        sampler.speedup_policies()  # each within 0.05 of its speedup over the horizon
    return dict(zip(speedups, sampler.policies()))


def measure(model, ids, policies: dict, settings: Settings, progress: bool = True, drafts=None,
            bridges: dict | None = None) -> list[Row]:
    """Perplexity of ``ids``' scored tokens under each policy of ``policies`` ({speedup: policy}).
    ``drafts``: the peft-injected model under ``model`` whose adapters (a --skipping-only run's)
    then act on the skipping tokens alone, as an artifact built with --draft-adapter drafts.
    ``bridges``: tools.finetune.bridge's maps, applied where a token jumps over skipped layers."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    from tools.finetune import lora
    from tools.finetune.skip import layer_mask, skip_forward
    from tools.finetune.train import skipping_gate

    p, T = settings.prompt_tokens, ids.shape[1]
    rows = []
    bar = tqdm(total=len(policies) * math.ceil(len(ids) / settings.batch_size), desc="perplexity",
               unit="batch", disable=not progress)
    for speedup, policy in policies.items():
        nll, count, layers = 0.0, 0, 0
        for batch in ids.split(settings.batch_size):
            B = batch.shape[0]
            mask = layer_mask([policy] * B, torch.full((B,), p), T)  # (B, T, L)
            gate = None if drafts is None else skipping_gate([policy] * B, torch.full((B,), p), T)
            with torch.no_grad(), lora.gated(drafts, gate):
                logits = skip_forward(model, batch, torch.ones_like(batch), mask, bridges)  # (B, T, V)
            # position t's logits predict token t+1: the prompt's last predicts the first scored token
            scored = logits[:, p - 1:T - 1].float()  # (B, tokens, V)
            nll += float(F.cross_entropy(scored.flatten(0, 1), batch[:, p:].flatten(), reduction="sum"))
            count += scored.shape[0] * scored.shape[1]
            layers += int(mask[:, p - 1:T - 1].sum())
            bar.update()
        rows.append(Row(speedup, str(policy), layers / count, math.exp(nll / count)))
    bar.close()
    return rows


def table(rows: list[Row]) -> str:
    full = next((r.perplexity for r in rows if r.speedup == 1), rows[0].perplexity)
    lines = ["| speedup | policy | layers / token | perplexity | x full depth |", "|---|---|---|---|---|"]
    lines += [f"| {r.speedup:g}x | {r.policy} | {r.layers_per_token:.1f} | {r.perplexity:.2f} | "
              f"{r.perplexity / full:.2f} |" for r in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m tools.evaluate.perplexity",
                                description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True,
                   help="what `python -m export build --model` takes: alias, GGUF file, checkpoint directory")
    p.add_argument("--text", required=True, help="a .txt file, or a .csv/.jsonl (.gz) with --column")
    p.add_argument("--column", help="the column of a .csv/.jsonl whose unique values make the text")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 1.3, 2, 3], metavar="S",
                   help="horizon speedups, 1 = full depth (default 1 1.3 2 3)")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help=f"each window's full-depth prompt (default {d.prompt_tokens})")
    p.add_argument("--tokens", type=int, default=d.tokens,
                   help=f"scored tokens per window, the policy's horizon (default {d.tokens})")
    p.add_argument("--windows", type=int, default=d.windows, help=f"windows scored (default {d.windows})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"windows per pass (default {d.batch_size})")
    p.add_argument("--policy", action="append", default=[], type=own_policy, metavar="S=MAX:MIN",
                   help="score speedup S (one of --speedups) under budgets MAX -> MIN over the horizon instead of "
                        "the policy for_speedup picks (max:min near 2:1), as tools.finetune --policy trains it")
    p.add_argument("--warmup-layers", type=int, default=d.warmup_layers,
                   help=f"bottom layers every skipping step runs (default {d.warmup_layers}, the paper's)")
    p.add_argument("--draft-adapter", metavar="DIR",
                   help="a LoRA adapter over --model trained with tools.finetune --skipping-only: the skipping "
                        "tokens run through it and the prompt and full depth through --model alone, as the "
                        "drafts of an artifact built with export build --draft-adapter")
    p.add_argument("--bridges", metavar="FILE",
                   help="linear bridges over the skipped layers, fitted on another text by "
                        "`python -m tools.finetune.bridge`: the tokens that jump over layers go through them")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import torch

    from export import checkpoint
    from runtime.models import skip_model

    for name in ("prompt_tokens", "tokens", "windows", "batch_size"):
        if getattr(args, name) < 1:
            raise PerplexityError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    settings = Settings(args.prompt_tokens, args.tokens, args.windows, args.batch_size, args.warmup_layers)
    text = read_text(args.text, args.column)
    progress = cli.progress(args.quiet)
    hf_model, tokenizer = checkpoint.load(checkpoint.resolve(args.model), dtype=torch.float32, progress=progress)
    drafts = with_drafts(hf_model, args.draft_adapter) if args.draft_adapter else None
    model = skip_model(hf_model).eval()
    ids = windows(tokenizer, text, settings)
    bridges = None
    if args.bridges:
        from tools.finetune import bridge

        bridges = bridge.load(args.bridges, model)
    rows = measure(model, ids, policies(model.num_layers, args.speedups, settings, args.policy), settings, progress,
                   drafts, bridges)
    print(f"{args.model}{f' with drafts {args.draft_adapter}' if drafts else ''}: {ids.shape[0]} windows of "
          f"{settings.prompt_tokens} prompt + {settings.tokens} scored tokens from {args.text}"
          + (f" ({args.column})" if args.column else "") + (f", bridges {args.bridges}" if bridges else ""))
    print(table(rows))
    return 0


def with_drafts(hf_model, directory: str):
    """``hf_model`` with the LoRA adapter of ``directory`` injected (not merged): gated per token."""
    from pathlib import Path

    from export.adapter import is_adapter, read_config
    from tools.finetune import lora

    if not is_adapter(Path(directory)):
        raise PerplexityError(f"--draft-adapter {directory}: not a LoRA adapter directory (adapter_config.json and "
                              f"adapter_model.safetensors); tools.finetune --lora-rank R --skipping-only writes one")
    config = read_config(directory)
    lora.inject(hf_model, config["r"], config["lora_alpha"])
    lora.load(hf_model, Path(directory))
    return hf_model


if __name__ == "__main__":
    sys.exit(main())
