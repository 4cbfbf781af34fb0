"""``python -m tools.bench.lossless ARTIFACT``: lossless SkipDecode against full depth, and the lossy policy.

The same prompts (by default the first ``--count`` meaning representations of the E2E development
split, the demo model's task; ``--prompts FILE`` one per line; ``--chat`` renders each as a user
turn of the artifact's chat template), greedy, at batch 1 (each prompt alone) and at batch B (all
of them together: mixed lengths), on one Generator. Each round runs every row once, in an order
that alternates between rounds: full depth, the plain (lossy) policy at each ``--speedups`` S, and
lossless at each S (the policy's layers draft, full depth verifies: runtime.engine). A row's time
is its decode seconds (the steps and verify passes after each prompt's first token); its speed is
the tokens those gave per second, the median over the rounds; its ratio to full depth's comes
with the lowest and highest of the same ratio within each round (rows of one round run back to
back, so a slow drift of the machine cancels there). "same" says whether a row's tokens are full
depth's, for every prompt: lossless rows must say yes. The last two columns are what the engine
weighed a lossless row's drafting with (runtime.lossless): a step of drafts and a verify pass, in
full-depth steps, as measured (smoothed) at the end of the row's last run; where no number of
drafts beats full depth at the rows' acceptance, they pause at full depth. The whole call columns
are what a user waits: a ``generate`` call's wall time, prompt in to last token out (the median
round's, per call), and full depth's over it (the same tokens for lossless rows; a plain policy's
text may end sooner or later).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from runtime import cli
from runtime.errors import InvalidArgumentError


def load_prompts(path: str | None, column: str, count: int) -> list[str]:
    from tools.finetune.data import read_text

    if path is None:
        path = "data/e2e/devset.csv.gz"
    text = read_text(path, column if path.endswith((".csv", ".csv.gz", ".jsonl", ".jsonl.gz")) else None)
    prompts = [line for line in text.splitlines() if line.strip()][:count]
    if not prompts:
        raise InvalidArgumentError(f"{path} holds no prompt")
    return prompts


def rows(speedups: list[float]) -> list[tuple[str, dict]]:
    out = [("full depth", {})]
    out += [(f"plain {s:g}x", {"speedup": s}) for s in speedups]
    out += [(f"lossless {s:g}x", {"speedup": s, "lossless": True}) for s in speedups]
    return out


def measure(gen, prompts: list[str], batch: int, speedups: list[float], new_tokens: int, rounds: int,
            log=print, warmup_rounds: int = 0) -> list[dict]:
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    table = rows(speedups)
    seconds = {name: [] for name, _ in table}
    calls = {name: [] for name, _ in table}  # each round's whole calls, prompt in to last token out
    tokens, drafted, accepted, verified, outputs, costs = {}, {}, {}, {}, {}, {}
    gen.generate(prompts[:1], 4)  # warm up
    for _ in range(warmup_rounds):  # every row's shapes once, untimed (a GPU's graph captures for each)
        for _, options in table:
            for group in groups:
                gen.generate(group, new_tokens, **options)
    for r in range(rounds):
        order = table if r % 2 == 0 else table[::-1]
        for name, options in order:
            spent = made = d = a = v = wall = 0
            out = []
            for group in groups:
                result = gen.generate(group, new_tokens, **options)
                s = result.stats
                spent, made, wall = spent + s.decode_seconds, made + s.decode_tokens, wall + s.seconds
                d, a, v = d + s.drafted_tokens, a + s.accepted_tokens, v + s.verified_rows
                out += result.token_ids
            seconds[name].append(spent)
            calls[name].append(wall)
            tokens[name], drafted[name], accepted[name], verified[name], outputs[name] = made, d, a, v, out
            if options.get("lossless"):
                costs[name] = engine_costs(gen)
        log(f"batch {batch} round {r + 1}/{rounds}: " + ", ".join(
            f"{name} {tokens[name] / seconds[name][-1]:.1f} tok/s" for name, _ in table))
    full = statistics.median(seconds["full depth"]) / tokens["full depth"]
    results = []
    for name, _ in table:
        per = statistics.median(seconds[name]) / tokens[name]
        # the same ratio within each round: its rows ran minutes apart at most, so this machine's drift
        # cancels; its spread is what one round's noise is worth
        paired = [f / tokens["full depth"] / (t / tokens[name]) for f, t in zip(seconds["full depth"], seconds[name])]
        results.append({"batch": batch, "row": name, "ms_per_token": per * 1e3, "vs_full": full / per,
                        "vs_full_rounds": (min(paired), max(paired)),
                        "acceptance": accepted[name] / drafted[name] if drafted[name] else None,
                        "tokens_per_verify": (accepted[name] + verified[name]) / verified[name] if verified[name] else None,
                        "same": outputs[name] == outputs["full depth"], "tokens": tokens[name],
                        "costs": costs.get(name), "call_ms": statistics.median(calls[name]) / len(groups) * 1e3,
                        "call_vs_full": statistics.median(calls["full depth"]) / statistics.median(calls[name])})
    return results


def engine_costs(gen) -> tuple[float | None, float | None] | None:
    """What the engine weighed drafting with (runtime.lossless): a step of drafts' and a verify
    pass's time in full-depth steps, as smoothed at the end of a row's last run."""
    t = gen.engine.timings
    if not t.full:
        return None
    return tuple(None if x is None else x / t.full for x in (t.draft, t.verify))


def render(results: list[dict], header: str) -> str:
    lines = [header, "",
             "| batch | row | decode ms/token | vs full depth (lowest-highest round) | drafts kept | tokens per verify pass "
             "| same tokens as full depth | a draft step, in full steps | a verify pass, in full steps "
             "| whole call ms | whole call vs full depth |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance'] * 100:.0f}%"
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        lo, hi = r["vs_full_rounds"]
        vs = f"{r['vs_full']:.2f}x" + ("" if r["row"] == "full depth" or lo == hi else f" ({lo:.2f}x-{hi:.2f}x)")
        draft, verify = r["costs"] or (None, None)
        lines.append(f"| {r['batch']} | {r['row']} | {r['ms_per_token']:.2f} | {vs} | {acc} | "
                     f"{tpv} | {'yes' if r['same'] else 'no'} | {_ratio(draft)} | {_ratio(verify)} | "
                     f"{r['call_ms']:.1f} | {r['call_vs_full']:.2f}x |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    p = cli.parser("python -m tools.bench.lossless", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="an artifact directory (python -m export build)")
    p.add_argument("--prompts", help="a .txt file (one prompt per line) or a .csv/.jsonl(.gz) with --column "
                                     "(default: data/e2e/devset.csv.gz)")
    p.add_argument("--column", default="mr", help="the prompts' column of a .csv/.jsonl (default mr)")
    p.add_argument("--count", type=int, default=8, help="prompts (default 8)")
    p.add_argument("--chat", action="store_true", help="each prompt as a user turn of the chat template")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--speedups", type=float, nargs="+", default=[2, 3, 5], help="policies (default 2 3 5)")
    cli.add_max_new_tokens(p, 64, "tokens per prompt (EOS ends a row earlier)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every row once each (default 3)")
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="untimed rounds first, every row once each (default 0; on a GPU 1: the rows' CUDA "
                        "graphs are captured in their first run, which a timed round would count)")
    p.add_argument("--backend", choices=["onnxruntime", "torch"], default="onnxruntime",
                   help="what runs the graphs (default onnxruntime; torch: --device cuda replays CUDA graphs)")
    p.add_argument("--device", help="the torch backend's device, cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime's (torch's: intra-op) threads (default 2)")
    p.add_argument("--spin", action="store_true",
                   help="ONNX Runtime's worker threads busy-wait (runtime.load's spin=True: one process-wide "
                        "pool, for cores no other process uses); default: they sleep, as a library load's do")
    cli.add_fused(p)
    p.add_argument("--out", help="also write the table to this Markdown file")
    return p.parse_args(argv)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    args = parse(argv)
    return cli.run(lambda: _run(args, sys.argv[1:] if argv is None else argv))


def _run(args, argv: list[str]) -> int:
    import runtime

    if args.warmup_rounds < 0:
        raise InvalidArgumentError(f"--warmup-rounds must be >= 0, got {args.warmup_rounds}")
    prompts = load_prompts(args.prompts, args.column, args.count)
    if args.backend == "torch":
        if args.spin or not args.fused:
            raise InvalidArgumentError("--spin and --no-fused apply to --backend onnxruntime, not torch")
        gen = runtime.load(args.artifact, backend="torch", device=args.device or "cpu", threads=args.threads,
                           max_batch=max(args.batch))
        graphs = gen.backend.graphs is not None
        load = f"torch on {gen.backend.device}" + (", CUDA graphs" if graphs else "")
    else:
        if args.device:
            raise InvalidArgumentError("--device applies to --backend torch (onnxruntime runs on this CPU here)")
        gen = runtime.load(args.artifact, threads=args.threads, max_batch=max(args.batch), spin=args.spin,
                           fused=None if args.fused else False)  # None: the fused graphs where the artifact has them
        # what the table measured, as the backend loaded it: the pool's waits, the layer graphs it runs
        load = ("spinning" if gen.backend.spin else "sleeping") + " workers" + (
            "" if gen.backend.fused else ", plain layer graphs")
    try:
        if args.chat:
            from pathlib import Path

            from runtime.serve.chat import ChatTemplate

            template = ChatTemplate.from_dir(Path(gen.directory) / gen.manifest.tokenizer_dir)
            if template is None:
                raise InvalidArgumentError("--chat needs a chat template, and this artifact has none")
            prompts = [template.render([{"role": "user", "content": q}]) for q in prompts]
        results = []
        for batch in args.batch:
            results += measure(gen, prompts, batch, args.speedups, args.max_new_tokens, args.rounds,
                               log=lambda m: print(m, file=sys.stderr), warmup_rounds=args.warmup_rounds)
    finally:
        gen.close()
    command = "python -m tools.bench.lossless " + " ".join(argv)
    header = (f"{args.artifact}, {len(prompts)} prompts, greedy, up to {args.max_new_tokens} new tokens, "
              f"{args.threads} threads ({load}), median of {args.rounds} rounds"
              + (f" after {args.warmup_rounds} untimed" if args.warmup_rounds else "")
              + f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
              f"\nCommand: `{command.strip()}`")
    table = render(results, header)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
