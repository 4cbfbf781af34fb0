"""``python -m tools.bench.serving``: continuous batching against static batches and one at a time.

One stream of requests, the same for every mode: Poisson arrivals, prompts (E2E meaning
representations, by default from the shipped development split ``data/e2e/devset.csv.gz``) and
output lengths drawn from the E2E data, and a speedup drawn per request from ``--speedups``. EOS is
ignored, so every mode generates exactly the same tokens. Output lengths (``--lengths``):

- e2e: the token count of one of the MR's references (+1, EOS), capped at ``--max-new-tokens`` (64):
  a narrow spread, most 20-40 tokens;
- wide: log-uniform in [16, 256] (seeded; the same arrivals, prompts and speedups as e2e), where
  a static batch's longest request is far above its mean.

Three ways to serve it on one artifact:

- engine: one Generator; each request is submitted at its arrival, joins the running batch
  after its own prefill and leaves when done (runtime/engine/);
- static: requests that arrived while a batch ran wait; the next batch takes up to max_batch of
  them and runs until its longest request ends (no joining), as a static batcher does;
- serial: one request at a time (a Generator with max_batch=1).

Modes (and length streams, when ``--lengths`` names both) are interleaved over ``--rounds`` rounds;
figures are medians across rounds. Throughput is generated tokens over the time from the first
arrival to the last completion; latency is per request, completion minus arrival. The
Generators hold ``--max-length`` positions per slot: by default the stream's longest prompt plus
its longest output.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime import cli

MODES = ("engine", "static", "serial")
LENGTHS = ("e2e", "wide")
WIDE_RANGE = (16, 256)  # output lengths of the wide stream, log-uniform
REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = "data/e2e/devset.csv.gz"  # relative to the repository (or the working directory)


@dataclass
class Arrival:
    at: float  # seconds after the stream's start
    prompt: str
    new_tokens: int
    speedup: float


def data_path(data: str | None) -> Path:
    """``--data``, or the shipped E2E development split: found from the working directory or,
    failing that, from the repository this module is in."""
    path = Path(data or DEFAULT_DATA)
    if not path.is_absolute() and not path.exists() and (REPO / path).exists():
        return REPO / path
    return path


def read_e2e(data) -> list[tuple[str, str]]:
    """(mr, ref) rows of an E2E CSV, plain or gzip-compressed (.csv / .csv.gz)."""
    from tools.finetune.data import read_pairs

    return [(ex.prompt, ex.target) for ex in read_pairs(data, "mr", "ref")]


def wide_lengths(count: int, seed: int, low: int = WIDE_RANGE[0], high: int = WIDE_RANGE[1]) -> list[int]:
    """``count`` output lengths drawn log-uniformly in [low, high] (integers, both ends included),
    from their own seeded generator: the wide stream keeps the e2e stream's other draws."""
    rng = np.random.default_rng([seed, 1])
    u = rng.uniform(math.log(low), math.log(high + 1), size=count)  # floor(exp(u)) spans [low, high]
    return [min(int(math.exp(x)), high) for x in u]


def make_stream(data, tokenizer, count: int, rate: float, speedups, max_new: int, seed: int,
                lengths: str = "e2e") -> list[Arrival]:
    """``count`` requests with exponential inter-arrival times of mean 1/rate; output lengths per
    ``lengths`` (e2e: a reference's token count; wide: log-uniform in WIDE_RANGE), capped at max_new."""
    if lengths not in LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTHS}, got {lengths!r}")
    rows = read_e2e(data)
    rng = np.random.default_rng(seed)
    wide = wide_lengths(count, seed) if lengths == "wide" else None
    at, out = 0.0, []
    for k in range(count):
        mr, ref = rows[rng.integers(len(rows))]
        drawn = wide[k] if wide else len(tokenizer(ref)["input_ids"]) + 1
        out.append(Arrival(at, mr, min(drawn, max_new), float(rng.choice(speedups))))
        at += rng.exponential(1.0 / rate)
    return out


def needed_length(tokenizer, stream: list[Arrival]) -> int:
    """Positions a slot must hold for every request of the stream: longest prompt + longest output."""
    return max(len(tokenizer(a.prompt)["input_ids"]) for a in stream) + max(a.new_tokens for a in stream)


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


def render(med: dict[str, dict]) -> list[str]:
    """The table of one stream from its per-mode medians (throughput, p50, p90)."""
    lines = ["| mode | throughput tok/s | latency p50 s | latency p90 s | vs static | vs serial |",
             "|---|---|---|---|---|---|"]
    for mode in MODES:
        if mode not in med:
            continue
        m = med[mode]
        vs = [f"{m['throughput'] / med[base]['throughput']:.2f}x" if base in med else "–"
              for base in ("static", "serial")]
        lines.append(f"| {mode} | {m['throughput']:.1f} | {m['p50']:.2f} | {m['p90']:.2f} | {vs[0]} | {vs[1]} |")
    return lines


def main(argv=None) -> int:
    p = cli.parser("python -m tools.bench.serving", __doc__.splitlines()[0])
    p.add_argument("--arch", default="opt-125m", help="random weights at this architecture's shapes")
    p.add_argument("--artifact", help="an exported artifact instead of --arch (e.g. the demo model)")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="CSV (.csv or gzip .csv.gz) with mr and ref columns; the default is the shipped "
                        "E2E development split")
    p.add_argument("--requests", type=int, default=48, help="requests in the stream")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--lengths", nargs="+", choices=LENGTHS, default=["e2e"],
                   help="output lengths: e2e (a reference's token count) or wide (log-uniform in "
                        f"[{WIDE_RANGE[0]}, {WIDE_RANGE[1]}]); both: two streams, interleaved")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 2, 3, 5], help="drawn per request")
    p.add_argument("--max-batch", type=int, default=8, help="slots of the engine and the static batcher")
    cli.add_max_new_tokens(p, None, f"cap on a request's output length (default: 64 for e2e, "
                                    f"{WIDE_RANGE[1]} for wide)", aliases=("--max-new",))
    p.add_argument("--max-length", type=int, default=None,
                   help="positions per slot (runtime.load's max_length); None: the streams' longest "
                        "prompt + longest output")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians across them")
    p.add_argument("--seed", type=int, default=0, help="the request stream's draws")
    p.add_argument("--work-dir", default=".bench", help="where --arch weights are built")
    args = p.parse_args(argv)
    data = data_path(args.data)
    if not data.is_file():
        p.error(f"--data {data}: no such file")
    if args.artifact and not (Path(args.artifact) / "manifest.json").is_file():
        p.error(f"--artifact {args.artifact}: no manifest.json there; pass a directory written by "
                f"`python -m export build`")

    import runtime
    from runtime.tokenizer import load_tokenizer
    from runtime.artifact.manifest import load_manifest

    if args.artifact:
        artifact = Path(args.artifact)
    else:
        from .prepare import prepare_in_subprocess

        artifact = prepare_in_subprocess(args.arch, Path(args.work_dir), args.seed).artifact_dir
    manifest = load_manifest(artifact, check_hashes=False)
    tokenizer = load_tokenizer(artifact / manifest.tokenizer_dir, manifest.model.pad_token_id)
    streams = {}
    for lengths in args.lengths:
        cap = args.max_new_tokens if args.max_new_tokens is not None else (WIDE_RANGE[1] if lengths == "wide" else 64)
        streams[lengths] = make_stream(data, tokenizer, args.requests, args.rate, args.speedups, cap,
                                       args.seed, lengths)
    max_length = args.max_length or max(needed_length(tokenizer, s) for s in streams.values())
    wide = runtime.load(artifact, max_batch=args.max_batch, max_length=max_length, threads=args.threads,
                        check_hashes=False)
    single = runtime.load(artifact, max_batch=1, max_length=max_length, threads=args.threads,
                          check_hashes=False)
    first = next(iter(streams.values()))[0]
    for gen in (wide, single):  # warm-up: first runs allocate and tune
        gen.generate(first.prompt, 4)

    def runs(stream):
        return {"engine": lambda: serve_engine(wide, stream),
                "static": lambda: serve_batches(wide, stream, args.max_batch),
                "serial": lambda: serve_batches(single, stream, 1)}

    jobs = [(lengths, mode) for lengths in streams for mode in MODES]
    results: dict[tuple[str, str], list[dict]] = {job: [] for job in jobs}
    rng = np.random.default_rng(args.seed)
    for r in range(args.rounds):
        for i in rng.permutation(len(jobs)):
            lengths, mode = jobs[i]
            results[(lengths, mode)].append(summarise(runs(streams[lengths])[mode]()))
            label = f"{lengths} {mode}" if len(streams) > 1 else mode
            print(f"round {r + 1} {label}: {results[(lengths, mode)][-1]}", flush=True)
    for lengths, stream in streams.items():
        news = sorted(a.new_tokens for a in stream)
        tokens = sum(news)
        print(f"\n{lengths} lengths: {len(stream)} requests, {tokens} tokens (per request min {news[0]}, "
              f"median {statistics.median(news):g}, max {news[-1]}), Poisson rate {args.rate}/s, speedups "
              f"{args.speedups}, max_batch {args.max_batch}, max_length {max_length}, {args.rounds} rounds "
              f"(medians)\n")
        med = {m: {k: statistics.median(x[k] for x in results[(lengths, m)]) for k in results[(lengths, m)][0]}
               for m in MODES}
        print("\n".join(render(med)))
    wide.close()
    single.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
