"""``python -m tools.bench.gap``: how long a running row stalls while a long prompt joins.

    python -m tools.bench.gap [--arch opt-125m] [--rounds 3]
    python -m tools.bench.gap --checkout /work/before . --rounds 2          # before/after, interleaved
    python -m tools.bench.gap --load-option prefill_chunk=64                # a runtime.load option

One request decodes alone (a ``--short-prompt``-token prompt, ``--max-new-tokens`` tokens, greedy, EOS
ignored) on a Generator with ``--max-batch`` slots, ONNX Runtime, ``--threads`` threads. When its
``--join-after``-th token has arrived, a second request with a ``--long-prompt``-token prompt
(``--join-new-tokens`` tokens) is submitted. The first request's stream is read in its own thread,
so each TokenEvent's timestamp is its arrival; the gaps between consecutive ones are the first
row's inter-token times. Reported: their median, the longest, longest / median, at which token the
longest ended, the longest gap while the second request joined (from its submission to its first
token), and the joining request's time to its first token.
A whole-prompt prefill stalls every running row for its duration; a chunked prefill would split
that stall across steps: ``--load-option KEY=VALUE`` (repeatable) forwards any keyword to
``runtime.load``, so such an option can be compared with the default.

Each (checkout, round) is a fresh process (``python -c`` in the checkout, which imports that
checkout's runtime; tools.bench.checkouts) that loads the artifact, warms both prompt shapes up
untimed, then runs the measured pair once. Checkouts alternate within each round (order shuffled,
seeded); figures are medians across rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime import cli

from .checkouts import (CheckoutError, add_common_arguments, describe_checkout, exit_code, header, label, log,
                        parser, prepare, run_child, setup, tokenizer_of)
from .machine import describe
from .prompts import make_prompt
from .runner import schedule
from .stats import median

CHILD = r"""
import json, sys, threading, time
spec = json.loads(sys.argv[1])
import runtime
gen = runtime.load(spec["artifact"], max_batch=spec["max_batch"], threads=spec["threads"], check_hashes=False,
                   **spec["load_options"])
try:
    short, long_ = spec["short_prompt"], spec["long_prompt"]
    counts = [len(gen.tokenizer(p)["input_ids"]) for p in (short, long_)]
    gen.generate(long_, 2, ignore_eos=True)  # warm-up: both shapes, untimed
    gen.generate(short, 4, ignore_eos=True)
    first, second, joined, errors = [], [], threading.Event(), []

    def read(stream, times, signal_at=None):
        try:
            for _ in stream:
                times.append(time.perf_counter())
                if len(times) == signal_at:
                    joined.set()
        except BaseException as exc:
            errors.append(exc)
        joined.set()

    a = gen.stream(short, spec["new_tokens"], ignore_eos=True)
    reader = threading.Thread(target=read, args=(a, first, spec["join_after"]))
    reader.start()
    joined.wait()
    submitted = time.perf_counter()
    b = gen.stream(long_, spec["join_new_tokens"], ignore_eos=True)
    other = threading.Thread(target=read, args=(b, second))
    other.start()
    reader.join()
    other.join()
    if errors:
        raise errors[0]
    print(json.dumps({"prompt_tokens": counts, "times": first, "submitted": submitted,
                      "second_times": second, "second_prefill_s": b.result.stats.prefill_seconds,
                      "runtime": runtime.__file__}))
finally:
    gen.close()
"""


@dataclass
class GapStats:
    median_ms: float  # median gap between consecutive tokens of the first row
    longest_ms: float
    ratio: float  # longest / median
    longest_at: int  # the longest gap ends at this token of the first row (1-based: the first is 1)
    join_gap_ms: float  # the longest gap overlapping the join: from the second request's
    # submission to its first token (its whole prefill, chunked or not)
    ttft_ms: float  # the second request's submission to its first token


def gap_stats(times: list[float], submitted: float | None = None, second_first: float | None = None) -> GapStats:
    """Statistics of one stream's token arrival times (seconds, ascending); ``submitted``: when the
    second request was submitted, ``second_first``: when its first token arrived (same clock). The
    gaps overlapping [submitted, second_first] are the ones the join can have stretched."""
    if len(times) < 2:
        raise ValueError("need at least two token times for a gap")
    gaps = [b - a for a, b in zip(times, times[1:])]
    k = max(range(len(gaps)), key=gaps.__getitem__)
    med = statistics.median(gaps)
    join = float("nan")
    if submitted is not None:
        end = second_first if second_first is not None else submitted
        during = [g for a, b, g in zip(times, times[1:], gaps) if b >= submitted and a <= end]
        join = max(during) if during else float("nan")
    ttft = (second_first - submitted) if submitted is not None and second_first is not None else float("nan")
    return GapStats(1e3 * med, 1e3 * gaps[k], gaps[k] / med if med > 0 else float("nan"), k + 2,
                    1e3 * join, 1e3 * ttft)


def combine(rounds: list[GapStats]) -> GapStats:
    """Medians across rounds, field by field (longest_at: the median token index, rounded)."""
    fields = asdict(rounds[0]).keys()
    m = {f: median(getattr(r, f) for r in rounds) for f in fields}
    m["longest_at"] = round(m["longest_at"])
    return GapStats(**m)


def render(by_checkout: dict[str, GapStats]) -> list[str]:
    lines = ["| checkout | median gap ms | longest gap ms | longest / median | longest gap at token "
             "| longest gap while joining ms | joining request's TTFT ms |",
             "|---|---|---|---|---|---|---|"]
    for name, s in by_checkout.items():
        lines.append(f"| {name} | {s.median_ms:.2f} | {s.longest_ms:.1f} | {s.ratio:.1f}x | {s.longest_at} | "
                     f"{s.join_gap_ms:.1f} | {s.ttft_ms:.1f} |")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser("python -m tools.bench.gap", __doc__)
    p.add_argument("--max-batch", type=int, default=8, help="KV rows of the Generator")
    p.add_argument("--short-prompt", type=int, default=32, help="the running request's prompt, in tokens")
    cli.add_max_new_tokens(p, 200, "the running request's tokens")
    p.add_argument("--join-after", type=int, default=20, help="submit the second request after this many tokens")
    p.add_argument("--long-prompt", type=int, default=512, help="the joining request's prompt, in tokens")
    p.add_argument("--join-new-tokens", type=int, default=16, help="the joining request's tokens")
    add_common_arguments(p, "gap")
    args = p.parse_args(argv)
    if not 1 <= args.join_after < args.max_new_tokens - 1:
        p.error("--join-after must be >= 1 and leave the running request at least two more tokens")
    if args.rounds < 1 or args.max_batch < 2:
        p.error("--rounds must be >= 1 and --max-batch >= 2 (two requests run together)")
    options, checkouts, work = setup(p, args)
    return exit_code(_run, args, argv, options, checkouts, work)


def _run(args, argv, options, checkouts, work) -> int:
    started = time.perf_counter()
    keys, artifacts = prepare(args, checkouts, work)
    tok = tokenizer_of(artifacts[checkouts[0]])
    short, long_ = make_prompt(tok, args.short_prompt), make_prompt(tok, args.long_prompt, row=1)
    per = {c: [] for c in checkouts}
    raw = {"argv": argv, "machine": describe(), "checkouts": {str(c): keys[c] for c in checkouts},
           "artifacts": {str(c): str(a) for c, a in artifacts.items()}, "runs": []}
    raw_path = Path(args.json) if args.json else work / "gap.json"
    runtimes = {}
    for round_, c in schedule(checkouts, args.rounds, args.seed):
        spec = {"artifact": str(artifacts[c]), "max_batch": args.max_batch, "threads": args.threads,
                "short_prompt": short, "long_prompt": long_, "new_tokens": args.max_new_tokens,
                "join_after": args.join_after, "join_new_tokens": args.join_new_tokens, "load_options": options}
        record = run_child(CHILD, spec, c, args.threads, args.timeout)
        if record["prompt_tokens"] != [args.short_prompt, args.long_prompt]:
            raise CheckoutError(f"{c}: prompts of {args.short_prompt} and {args.long_prompt} tokens are "
                                f"{record['prompt_tokens']} tokens to that checkout's tokenizer")
        s = gap_stats(record["times"], record["submitted"], (record["second_times"] or [None])[0])
        per[c].append(s)
        runtimes[c] = record["runtime"]
        raw["runs"].append({"round": round_, "checkout": str(c), **record, "stats": asdict(s)})
        raw["elapsed_s"] = time.perf_counter() - started
        raw_path.write_text(json.dumps(raw))
        log(f"round {round_ + 1} {label(c)}: median gap {s.median_ms:.2f} ms, longest {s.longest_ms:.1f} ms "
            f"({s.ratio:.1f}x) at token {s.longest_at}; joining TTFT {s.ttft_ms:.1f} ms "
            f"(its prefill {1e3 * record['second_prefill_s']:.1f} ms)")
    print(header("python -m tools.bench.gap", argv, started))
    print(f"{args.arch if not args.artifact else args.artifact}, ONNX Runtime, {args.threads} threads, max_batch "
          f"{args.max_batch}, full depth, greedy, EOS ignored: a {args.short_prompt}-token prompt decoding "
          f"{args.max_new_tokens} tokens; after its token {args.join_after}, a {args.long_prompt}-token prompt joins "
          f"({args.join_new_tokens} tokens); medians of {args.rounds} rounds"
          + (f"; runtime.load options {options}" if options else ""))
    for c in checkouts:
        print(f"- {describe_checkout(c, keys[c])}: runtime {runtimes[c]}")
    print()
    print("\n".join(render({label(c): combine(per[c]) for c in checkouts})))
    log(f"raw records: {raw_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
