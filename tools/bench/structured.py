"""``python -m tools.bench.structured ARTIFACT``: what structured output costs a decode step.

For each batch size, the same prompts decode ``--new-tokens`` tokens free and under a JSON schema
(``runtime.decoding.structured``: llguidance's token mask per row, then its matcher advanced by the token),
in interleaved rounds on one loaded Generator. A step's time is a whole ``generate``'s wall clock
over the decode steps: (time of N tokens - time of 1) / (N - 1), each the faster of two runs, so the
prefill drops out and the mask, the sampling and everything else per step stay in. The schema is a top-level string of at
least ``MIN_LENGTH`` characters: it cannot end inside the run, and inside a string nearly every
token is allowed, the mask's dearest case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from runtime import cli

MIN_LENGTH = 100_000  # characters the schema's string needs: never completed within a run
SCHEMA = {"type": "string", "minLength": MIN_LENGTH}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def step_ms(gen, prompts: list[str], new_tokens: int, **options) -> float:
    def run(n: int) -> float:
        start = time.perf_counter()
        gen.generate(prompts, n, ignore_eos=True, **options)
        return time.perf_counter() - start

    # the faster of two runs each: a single run of a few tokens that the machine slowed could make
    # the difference (and so a step) negative
    return (min(run(new_tokens), run(new_tokens)) - min(run(1), run(1))) / (new_tokens - 1) * 1e3


def measure(artifact: str, batches: list[int], new_tokens: int, rounds: int, threads: int, log=print) -> list[dict]:
    import runtime

    rows = []
    with runtime.load(artifact, max_batch=max(batches), threads=threads) as gen:
        gen.generate([PROMPT], 4, json_schema=SCHEMA)  # warm: llguidance's tokenizer, the sessions
        for batch in batches:
            prompts = [PROMPT] * batch
            free, constrained = [], []
            for r in range(rounds):
                for name, out, options in [("free", free, {}), ("json", constrained, {"json_schema": SCHEMA})][::1 if r % 2 else -1]:
                    out.append(step_ms(gen, prompts, new_tokens, **options))
            row = {"batch": batch, "free_ms": statistics.median(free), "json_ms": statistics.median(constrained)}
            row["overhead"] = row["json_ms"] / row["free_ms"] - 1
            log(f"batch {batch}: free {row['free_ms']:.2f} ms, json {row['json_ms']:.2f} ms, {row['overhead']:+.1%}")
            rows.append(row)
    return rows


def table(rows: list[dict], command: str, vocab: int) -> str:
    lines = [f"Command: `{command}`; vocabulary {vocab}; ms per decode step, median of the rounds.", "",
             "| batch | free ms/step | JSON schema ms/step | cost of the mask |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['free_ms']:.2f} | {r['json_ms']:.2f} | {r['overhead']:+.1%} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.structured", description=__doc__.split("\n\n")[0])
    cli.add_version(p)
    p.add_argument("artifact", help="an exported artifact directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    cli.add_max_new_tokens(p, 48, "decode steps per run (default 48)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (default 2)")
    args = p.parse_args(argv)

    def body() -> int:
        from runtime.artifact.manifest import load_manifest

        rows = measure(args.artifact, args.batch, args.max_new_tokens, args.rounds, args.threads,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
        command = "python -m tools.bench.structured " + " ".join(sys.argv[1:] if argv is None else argv)
        print(table(rows, command, load_manifest(args.artifact).model.vocab_size))
        return 0

    return cli.run(body)


if __name__ == "__main__":
    sys.exit(main())
