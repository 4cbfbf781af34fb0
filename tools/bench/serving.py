"""``python -m tools.bench.serving``: continuous batching against static batches and one at a time.

One stream of requests, the same for every mode: Poisson arrivals, prompts (E2E meaning
representations) and output lengths (the token count of one of their references, EOS ignored so
every mode generates exactly the same tokens) drawn from the E2E data, and a speedup drawn per
request from ``--speedups``. Three ways to serve it on one artifact:

- engine: one Generator; each request is submitted at its arrival, joins the running batch
  after its own prefill and leaves when done (runtime/engine.py);
- static: requests that arrived while a batch ran wait; the next batch takes up to max_batch of
  them and runs until its longest request ends (no joining), as a static batcher does;
- serial: one request at a time (a Generator with max_batch=1).

Modes are interleaved over ``--rounds`` rounds; figures are medians across rounds. Throughput is
generated tokens over the time from the first arrival to the last completion; latency is per
request, completion minus arrival.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODES = ("engine", "static", "serial")


@dataclass
class Arrival:
    at: float  # seconds after the stream's start
    prompt: str
    new_tokens: int
    speedup: float


def make_stream(data: Path, tokenizer, count: int, rate: float, speedups, max_new: int, seed: int) -> list[Arrival]:
    """``count`` requests with exponential inter-arrival times of mean 1/rate."""
    with open(data, newline="") as f:
        rows = [(r["mr"], r["ref"]) for r in csv.DictReader(f)]
    rng = np.random.default_rng(seed)
    at, out = 0.0, []
    for _ in range(count):
        mr, ref = rows[rng.integers(len(rows))]
        new = min(len(tokenizer(ref)["input_ids"]) + 1, max_new)
        out.append(Arrival(at, mr, new, float(rng.choice(speedups))))
        at += rng.exponential(1.0 / rate)
    return out


def _submit(gen, a: Arrival):
    return gen.stream(a.prompt, a.new_tokens, speedup=a.speedup, ignore_eos=True)


def serve_engine(gen, stream: list[Arrival]) -> list[tuple[float, float, int]]:
    """(arrival, completion, tokens) per request, each submitted by its own client thread."""
    out = [None] * len(stream)
    start = time.perf_counter()

    def client(k: int, a: Arrival) -> None:
        time.sleep(max(0.0, start + a.at - time.perf_counter()))
        s = _submit(gen, a)
        tokens = sum(1 for _ in s)
        out[k] = (a.at, time.perf_counter() - start, tokens)

    threads = [threading.Thread(target=client, args=(k, a)) for k, a in enumerate(stream)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve_batches(gen, stream: list[Arrival], batch: int) -> list[tuple[float, float, int]]:
    """A dispatcher that runs whatever arrived, up to ``batch`` requests, to the end of the longest."""
    out, k, start = [], 0, time.perf_counter()
    while k < len(stream):
        now = time.perf_counter() - start
        if stream[k].at > now:
            time.sleep(stream[k].at - now)
            now = stream[k].at
        group = []
        while k < len(stream) and len(group) < batch and stream[k].at <= now:
            group.append(stream[k])
            k += 1
        streams = [_submit(gen, a) for a in group]
        counts = [sum(1 for _ in s) for s in streams]  # the engine runs them together; none joins
        done = time.perf_counter() - start
        out += [(a.at, done, n) for a, n in zip(group, counts)]
    return out


def summarise(records) -> dict:
    latency = sorted(end - at for at, end, _ in records)
    makespan = max(end for _, end, _ in records) - min(at for at, _, _ in records)
    return {"throughput": sum(n for _, _, n in records) / makespan,
            "p50": float(np.percentile(latency, 50)), "p90": float(np.percentile(latency, 90)),
            "makespan": makespan}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.serving", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", default="opt-125m", help="random weights at this architecture's shapes")
    p.add_argument("--artifact", help="an exported artifact instead of --arch (e.g. the demo model)")
    p.add_argument("--data", default="data/e2e/val.csv", help="CSV with mr and ref columns")
    p.add_argument("--requests", type=int, default=48, help="requests in the stream")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 2, 3, 5], help="drawn per request")
    p.add_argument("--max-batch", type=int, default=8, help="slots of the engine and the static batcher")
    p.add_argument("--max-new", type=int, default=64, help="cap on a request's output length")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians across them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=".bench", help="where --arch weights are built")
    args = p.parse_args(argv)

    import runtime

    if args.artifact:
        artifact = Path(args.artifact)
    else:
        from .prepare import prepare_in_subprocess

        artifact = prepare_in_subprocess(args.arch, Path(args.work_dir), args.seed).artifact_dir
    wide = runtime.load(artifact, max_batch=args.max_batch, threads=args.threads, check_hashes=False)
    single = runtime.load(artifact, max_batch=1, threads=args.threads, check_hashes=False)
    stream = make_stream(Path(args.data), wide.tokenizer, args.requests, args.rate, args.speedups,
                         args.max_new, args.seed)
    for gen in (wide, single):  # warm-up: first runs allocate and tune
        gen.generate(stream[0].prompt, 4)
    runs = {
        "engine": lambda: serve_engine(wide, stream),
        "static": lambda: serve_batches(wide, stream, args.max_batch),
        "serial": lambda: serve_batches(single, stream, 1),
    }
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    rng = np.random.default_rng(args.seed)
    for r in range(args.rounds):
        for mode in rng.permutation(MODES):
            results[mode].append(summarise(runs[mode]()))
            print(f"round {r + 1} {mode}: {results[mode][-1]}", flush=True)
    tokens = sum(a.new_tokens for a in stream)
    print(f"\n{len(stream)} requests, {tokens} tokens, Poisson rate {args.rate}/s, speedups "
          f"{args.speedups}, max_batch {args.max_batch}, {args.rounds} rounds (medians)\n")
    print("| mode | throughput tok/s | latency p50 s | latency p90 s | vs static |")
    print("|---|---|---|---|---|")
    med = {m: {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]} for m in MODES}
    for mode in MODES:
        m = med[mode]
        print(f"| {mode} | {m['throughput']:.1f} | {m['p50']:.2f} | {m['p90']:.2f} | "
              f"{m['throughput'] / med['static']['throughput']:.2f}x |")
    wide.close()
    single.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
