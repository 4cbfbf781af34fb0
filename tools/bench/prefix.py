"""``python -m tools.bench.prefix ARTIFACT``: time to first token with and without prompt reuse.

A chat's system prompt of about ``--system-tokens`` tokens, then ``--questions`` different user
questions, each its own request, one after another, as an app's users would send them: on a
Generator with the prefix cache (``prefix_cache_mb``, runtime.prefix_cache) and on one without,
the two alternating question by question. Time to first token is from the call to its first
streamed token (tokenizing, the prompt's prefill, the head); the first question of the cached run
pays the whole prompt and leaves its pages, the later ones take them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from runtime import cli

SYSTEM = ("You are the front-desk assistant of a small seaside hotel. Guests ask about rooms, meals, "
          "parking, late check-out, the spa and the town. Answer in one or two friendly sentences, and "
          "say when something costs extra. ")
QUESTIONS = ["What time is breakfast served?", "Is there parking for a car?", "Can I check out at noon?",
             "Do you have a spa?", "How far is the beach?", "Are pets allowed?", "Is there a gym?",
             "Can I get a taxi to the airport?"]


def system_prompt(tokenizer, tokens: int) -> str:
    """SYSTEM's words, repeated, up to about ``tokens`` tokens (one word over at most)."""
    words, text = SYSTEM.split(), ""
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += words[len(text.split()) % len(words)] + " "
    return text


def first_token_ms(gen, prompt: str, new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    with gen.stream([prompt], new_tokens) as stream:
        first = None
        for _ in stream:
            first = first or time.perf_counter()
    return (first - start) * 1e3, stream.result.stats.cached_tokens


def measure(artifact: str, system_tokens: int, questions: int, new_tokens: int, threads: int, mb: float,
            log=print) -> list[dict]:
    import runtime

    gens = {"reuse": runtime.load(artifact, threads=threads, prefix_cache_mb=mb),
            "none": runtime.load(artifact, threads=threads)}
    try:
        system = system_prompt(gens["none"].tokenizer, system_tokens)
        gens["none"].generate(["warm up"], 2)
        gens["reuse"].generate(["warm up"], 2)
        rows = []
        for i, question in enumerate((QUESTIONS * (questions // len(QUESTIONS) + 1))[:questions]):
            row = {"question": i + 1, "prompt_tokens": len(gens["none"].tokenizer(system + question)["input_ids"])}
            for name in ("reuse", "none")[:: 1 if i % 2 else -1]:
                row[f"{name}_ms"], cached = first_token_ms(gens[name], system + question, new_tokens)
                if name == "reuse":
                    row["cached"] = cached
            log(f"question {i + 1}: {row['prompt_tokens']} tokens, reuse {row['reuse_ms']:.0f} ms "
                f"({row['cached']} cached), none {row['none_ms']:.0f} ms")
            rows.append(row)
        return rows
    finally:
        for gen in gens.values():
            gen.close()


def table(rows: list[dict], command: str) -> str:
    first = rows[0]["reuse_ms"]
    lines = [f"Command: `{command}`", "",
             "| question | prompt tokens | cached tokens | TTFT with reuse ms | x the first's | TTFT without ms |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['question']} | {r['prompt_tokens']} | {r['cached']} | {r['reuse_ms']:.1f} | "
              f"{r['reuse_ms'] / first:.2f}x | {r['none_ms']:.1f} |" for r in rows]
    later = [r["reuse_ms"] / r["none_ms"] for r in rows[1:]]
    if later:
        lines += ["", f"Later questions with reuse against without, same question: median "
                      f"{statistics.median(later):.2f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.prefix", description=__doc__.split("\n\n")[0])
    cli.add_version(p)
    p.add_argument("artifact", help="an exported artifact directory")
    p.add_argument("--system-tokens", type=int, default=400, help="the system prompt's length (default 400)")
    p.add_argument("--questions", type=int, default=6, help="requests after it, one at a time (default 6)")
    cli.add_max_new_tokens(p, 4, "tokens per answer (default 4: the first token is what is timed)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (default 2)")
    p.add_argument("--prefix-cache-mb", type=float, default=256, help="the cached run's cache (default 256)")
    args = p.parse_args(argv)

    def body() -> int:
        rows = measure(args.artifact, args.system_tokens, args.questions, args.max_new_tokens, args.threads,
                       args.prefix_cache_mb, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(table(rows, "python -m tools.bench.prefix " + " ".join(sys.argv[1:] if argv is None else argv)))
        return 0

    return cli.run(body)


if __name__ == "__main__":
    sys.exit(main())
