"""``python -m tools.bench.chains ARTIFACT``: a step's layers as chains (``chains=True``) against
one session run per layer (the default), side by side.

Each round runs two fresh processes, one per load, in an order that alternates between rounds.
Each loads the artifact with spinning workers (``--spin``, what the command lines do on free
cores), warms up, then streams one prompt (``--prompt`` token ids from 100 up) for
``--max-new-tokens`` tokens, greedy with EOS ignored, at batch 1: at full depth and at each
``--speedups`` S. A row's time is the median gap between its streamed tokens, then the median
over the rounds; "same tokens" says whether both loads gave the same tokens in every round. Also
per load: seconds to load, and the process's peak and final resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from runtime import cli
from runtime.errors import InvalidArgumentError, SkipDecodeError

LOADS = ("per layer", "chains")


def run_once(artifact: str, chains: bool, speedups: list[float], prompt: int, new_tokens: int,
             threads: int) -> dict:
    """One process's measurement (``--worker``): load seconds; per policy, ms per token and tokens."""
    import runtime

    began = time.perf_counter()
    gen = runtime.load(artifact, threads=threads, max_batch=1, spin=True, chains=chains, check_hashes=False)
    out = {"load_s": time.perf_counter() - began, "rows": {}}
    ids = list(range(100, 100 + prompt))
    gen.generate([ids], 8, ignore_eos=True)  # warm up
    for speedup in [None, *speedups]:
        stamps, tokens = [], []
        options = {} if speedup is None else {"speedup": speedup}
        for event in gen.stream([ids], new_tokens, ignore_eos=True, **options):
            stamps.append(time.perf_counter())
            tokens.append(event.token_ids[0])
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        out["rows"][row_name(speedup)] = {"ms": statistics.median(gaps) * 1e3, "tokens": tokens}
    out.update(memory())
    gen.close()
    return out


def memory() -> dict:
    """This process's peak and current resident memory, MB (Linux's /proc; empty elsewhere)."""
    try:
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    except OSError:
        return {}
    mb = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731 - "1234 kB"
    return {"peak_mb": mb("VmHWM"), "rss_mb": mb("VmRSS")}


def row_name(speedup: float | None) -> str:
    return "full depth" if speedup is None else f"{speedup:g}x"


def measure(artifact: str, speedups: list[float], prompt: int, new_tokens: int, rounds: int, threads: int,
            log=print) -> list[dict]:
    runs = {load: [] for load in LOADS}
    for r in range(rounds):
        for load in (LOADS if r % 2 == 0 else LOADS[::-1]):
            argv = [sys.executable, "-m", "tools.bench.chains", artifact, "--worker", "--prompt", str(prompt),
                    "--max-new-tokens", str(new_tokens), "--threads", str(threads),
                    "--speedups", *map(str, speedups), *(["--chains"] if load == "chains" else [])]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:  # its own one-line error, or a traceback's last line
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise SkipDecodeError(f"the {load} load's process failed: {last}")
            runs[load].append(json.loads(done.stdout.strip().splitlines()[-1]))
            log(f"round {r + 1}/{rounds}, {load}: " + ", ".join(
                f"{name} {row['ms']:.2f} ms" for name, row in runs[load][-1]["rows"].items()))
    table = []
    for name in [row_name(s) for s in [None, *speedups]]:
        ms = {load: statistics.median(run["rows"][name]["ms"] for run in runs[load]) for load in LOADS}
        same = all(a["rows"][name]["tokens"] == b["rows"][name]["tokens"] for a, b in zip(*runs.values()))
        table.append({"row": name, **{load: ms[load] for load in LOADS}, "gain": ms["per layer"] / ms["chains"],
                      "same": same})
    for key, name in (("load_s", "load (s)"), ("peak_mb", "peak RSS (MB)"), ("rss_mb", "RSS after (MB)")):
        if all(key in run for load in LOADS for run in runs[load]):
            table.append({"row": name, **{load: statistics.median(run[key] for run in runs[load]) for load in LOADS},
                          "gain": None, "same": None})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| row | per layer (ms/token) | chains (ms/token) | chains vs per layer | same tokens |",
             "|---|---|---|---|---|"]
    for t in table:
        if t["gain"] is None:
            lines.append(f"| {t['row']} | {t['per layer']:.{0 if 'MB' in t['row'] else 2}f} | "
                         f"{t['chains']:.{0 if 'MB' in t['row'] else 2}f} | - | - |")
        else:
            lines.append(f"| {t['row']} | {t['per layer']:.2f} | {t['chains']:.2f} | {t['gain']:.2f}x | "
                         f"{'yes' if t['same'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.parser("python -m tools.bench.chains", description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="an artifact directory with fused layer graphs (python -m export build)")
    p.add_argument("--speedups", type=float, nargs="*", default=[2, 5], help="policies besides full depth")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    cli.add_max_new_tokens(p, 128, "tokens per generation (EOS ignored)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, both loads once each")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    p.add_argument("--out", help="also write the table to this Markdown file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--chains", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    for name, value, least in (("--prompt", args.prompt, 1), ("--max-new-tokens", args.max_new_tokens, 2),
                               ("--rounds", args.rounds, 1), ("--threads", args.threads, 1)):
        if value < least:
            raise InvalidArgumentError(f"{name} must be >= {least}, got {value}")
    if args.worker:
        print(json.dumps(run_once(args.artifact, args.chains, args.speedups, args.prompt, args.max_new_tokens,
                                  args.threads)))
        return 0
    table = measure(args.artifact, args.speedups, args.prompt, args.max_new_tokens, args.rounds, args.threads,
                    log=lambda m: print(m, file=sys.stderr))
    text = markdown(table)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
