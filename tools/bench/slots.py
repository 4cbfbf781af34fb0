"""``python -m tools.bench.slots``: what a lone request's decode costs against the Generator's slots.

    python -m tools.bench.slots [--arch opt-125m] [--max-batch 1 8 32] [--prompts 32 500] [--rounds 3]
    python -m tools.bench.slots --checkout /work/before . --rounds 2   # before/after, interleaved

One request alone (greedy, EOS ignored, ``--max-new-tokens`` tokens, full depth) on a Generator loaded
with ``max_batch`` KV slots, ONNX Runtime backend with ``--threads`` threads, for each max_batch and
each prompt length (exact token counts, from repeated text: tools.bench.prompts). The figure is the
per-token decode time, ``stats.decode_seconds / len(stats.steps)`` of the GenerationResult (the
prefill is not in it), median over ``--rounds`` interleaved rounds. Idle slots should cost a lone
request nothing; the ratio against max_batch=1 shows what they do cost, and the long/short column
how the per-token time grows with the context.

Each (checkout, max_batch, prompt) is a fresh process (``python -c``, in the checkout: it imports
that checkout's runtime; tools.bench.checkouts), which loads the artifact, generates
``--warmup-tokens`` on the same prompt untimed, then the timed request. Every round runs every
configuration once in a shuffled order (seeded per round), checkouts interleaved. Each checkout runs
its own export of the same random weights (``--arch``; built once per checkout and reused), or
every checkout runs ``--artifact``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runtime import cli

from .checkouts import (CheckoutError, add_common_arguments, describe_checkout, exit_code, header, label, log,
                        parser, prepare, run_child, setup, tokenizer_of)
from .machine import describe
from .prompts import make_prompt
from .runner import schedule
from .stats import median

CHILD = r"""
import json, resource, sys
spec = json.loads(sys.argv[1])
import runtime
gen = runtime.load(spec["artifact"], max_batch=spec["max_batch"], threads=spec["threads"], check_hashes=False,
                   **spec["load_options"])
try:
    prompt = spec["prompt"]
    tokens = len(gen.tokenizer(prompt)["input_ids"])
    if spec["warmup_tokens"]:
        gen.generate(prompt, spec["warmup_tokens"], ignore_eos=True)
    stats = gen.generate(prompt, spec["new_tokens"], ignore_eos=True).stats
    steps = len(stats.steps)
    print(json.dumps({"prompt_tokens": tokens, "decode_s": stats.decode_seconds, "steps": steps,
                      "token_ms": 1e3 * stats.decode_seconds / steps if steps else None,
                      "prefill_s": stats.prefill_seconds, "step_s": [s.seconds for s in stats.steps],
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "runtime": runtime.__file__}))
finally:
    gen.close()
"""


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def render_table(ms: dict[tuple[int, int], float], max_batches, prompts) -> list[str]:
    """Rows max_batch, columns prompt lengths; each cell ``ms (x vs max_batch=SMALLEST)``, then the
    longest prompt's time over the shortest's per max_batch. ``ms``: {(max_batch, prompt): ms}."""
    base = min(max_batches)
    short, long_ = min(prompts), max(prompts)
    lines = ["| max_batch | " + " | ".join(f"prompt {p}: ms/token (vs max_batch={base})" for p in prompts)
             + f" | long/short ({long_}/{short}) |",
             "|---|" + "---|" * len(prompts) + "---|"]
    for mb in max_batches:
        cells = []
        for p in prompts:
            v = ms.get((mb, p))
            cells.append("–" if v is None else f"{v:.2f} ({_ratio(v, ms.get((base, p)))})")
        lines.append(f"| {mb} | " + " | ".join(cells) + f" | {_ratio(ms.get((mb, long_)), ms.get((mb, short)))} |")
    return lines


def render_comparison(ms: dict[str, dict], names: list[str], max_batches, prompts) -> list[str]:
    """Each checkout's ms/token over the first checkout's, per (max_batch, prompt)."""
    first = names[0]
    lines = ["| max_batch | prompt | " + " | ".join(f"{n} ms" for n in names) + " | "
             + " | ".join(f"{n} / {first}" for n in names[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for mb in max_batches:
        for p in prompts:
            vals = [ms[n].get((mb, p)) for n in names]
            lines.append(f"| {mb} | {p} | " + " | ".join("–" if v is None else f"{v:.2f}" for v in vals) + " | "
                         + " | ".join(_ratio(v, vals[0]) for v in vals[1:]) + " |")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser("python -m tools.bench.slots", __doc__)
    p.add_argument("--max-batch", type=int, nargs="+", default=[1, 8, 32], help="KV rows of the Generator")
    p.add_argument("--prompts", type=int, nargs="+", default=[32, 500], help="prompt lengths in tokens (BOS included)")
    cli.add_max_new_tokens(p, 64, "tokens of the timed request")
    p.add_argument("--warmup-tokens", type=int, default=8, help="untimed generation first, same prompt")
    p.add_argument("--max-length", type=int, help="runtime.load's max_length (default: the runtime's)")
    add_common_arguments(p, "slots")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.max_batch) < 1 or min(args.prompts) < 2 or args.max_new_tokens < 2:
        p.error("--rounds and --max-batch must be >= 1, --prompts and --max-new-tokens >= 2")
    options, checkouts, work = setup(p, args)
    if args.max_length:
        options["max_length"] = args.max_length
    return exit_code(_run, args, argv, options, checkouts, work)


def _run(args, argv, options, checkouts, work) -> int:
    started = time.perf_counter()
    keys, artifacts = prepare(args, checkouts, work)
    tok = tokenizer_of(artifacts[checkouts[0]])
    prompts = {n: make_prompt(tok, n) for n in args.prompts}
    configs = [(c, mb, n) for c in checkouts for mb in args.max_batch for n in args.prompts]
    records = {cfg: [] for cfg in configs}
    raw = {"argv": argv, "machine": describe(), "checkouts": {str(c): keys[c] for c in checkouts},
           "artifacts": {str(c): str(a) for c, a in artifacts.items()}, "runs": []}
    raw_path = Path(args.json) if args.json else work / "slots.json"
    for round_, (c, mb, n) in schedule(configs, args.rounds, args.seed):
        spec = {"artifact": str(artifacts[c]), "max_batch": mb, "threads": args.threads, "prompt": prompts[n],
                "new_tokens": args.max_new_tokens, "warmup_tokens": args.warmup_tokens, "load_options": options}
        record = run_child(CHILD, spec, c, args.threads, args.timeout)
        if record["prompt_tokens"] != n:
            raise CheckoutError(f"{c}: the prompt of {n} tokens is {record['prompt_tokens']} tokens to that "
                                f"checkout's tokenizer")
        records[(c, mb, n)].append(record)
        raw["runs"].append({"round": round_, "checkout": str(c), "max_batch": mb, "prompt": n, **record})
        raw["elapsed_s"] = time.perf_counter() - started
        raw_path.write_text(json.dumps(raw))
        log(f"round {round_ + 1} {label(c)} max_batch {mb} prompt {n}: {record['token_ms']:.2f} ms/token "
            f"(prefill {1e3 * record['prefill_s']:.0f} ms, {record['steps']} steps, "
            f"peak RSS {record['peak_rss_mib']:.0f} MiB)")
    print(header("python -m tools.bench.slots", argv, started))
    print(f"{args.arch if not args.artifact else args.artifact}, ONNX Runtime, {args.threads} threads, one request "
          f"alone, full depth, {args.max_new_tokens} new tokens, greedy, EOS ignored; decode ms/token = "
          f"decode_seconds / decode steps (prefill excluded), median of {args.rounds} rounds"
          + (f"; runtime.load options {options}" if options else ""))
    ms = {}
    for c in checkouts:
        ms[label(c)] = {(mb, n): median(r["token_ms"] for r in records[(c, mb, n)])
                        for mb in args.max_batch for n in args.prompts}
        rss = max(r["peak_rss_mib"] for cfg in configs if cfg[0] == c for r in records[cfg])
        where = records[(c, args.max_batch[0], args.prompts[0])][0]["runtime"]
        print(f"\n{describe_checkout(c, keys[c])}: runtime {where}; largest peak RSS {rss:.0f} MiB\n")
        print("\n".join(render_table(ms[label(c)], args.max_batch, args.prompts)))
    if len(checkouts) > 1:
        print(f"\nms/token against {label(checkouts[0])}\n")
        print("\n".join(render_comparison(ms, [label(c) for c in checkouts], args.max_batch, args.prompts)))
    log(f"raw records: {raw_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
