"""``python -m tools.bench.context``: per-token decode time at long context, before and after a change.

Decode step time (embed + layers + head, ONNX Runtime backend, full depth, batch 1, greedy, EOS
ignored) at a short prompt and at a long prompt with many new tokens, for this tree and for another
git revision (``--before``, default the commit before the in-place KV cache), each in fresh worker
processes on its own export of the same random weights, interleaved over ``--rounds`` rounds.

The ratio long / short is what the in-place KV cache is for: a per-step copy of the past grows
with the context; reading the past K/V legitimately costs its bytes over the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from .prompts import make_prompt
from .runner import REPO, child_env

BEFORE = "04aba7d"  # the last commit whose layers concatenated past and new K/V per step


def checkout(rev: str, work: Path) -> Path:
    """A detached worktree of ``rev`` under ``work`` (reused when it is already there)."""
    tree = work / f"tree-{rev}"
    if not (tree / "runtime").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), rev], cwd=REPO, check=True,
                       capture_output=True)
    return tree.resolve()


def prepare(tree: Path, arch: str, work: Path, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "tools.bench.prepare", arch, str(work.resolve()), "0"],
                          stdout=subprocess.PIPE, text=True, cwd=tree, env=_env(tree, threads), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env(tree: Path, threads: int) -> dict:
    env = child_env(threads)
    env["PYTHONPATH"] = str(tree)  # that tree's runtime, not this one's
    return env


def measure(tree: Path, prepared: dict, prompt: str, new_tokens: int, threads: int) -> float:
    """Median decode step time in ms, from that tree's own bench worker."""
    L = prepared["config"]["num_layers"]
    spec = {"kind": "ort", "artifact_dir": prepared["artifact_dir"], "prompts": [prompt],
            "new_tokens": new_tokens, "warmup_tokens": 8, "threads": threads,
            "policy": {"max_layers": L, "min_layers": L, "warmup_layers": 1, "horizon": new_tokens}}
    done = subprocess.run([sys.executable, "-m", "tools.bench.worker", json.dumps(spec)], cwd=tree,
                          capture_output=True, text=True, env=_env(tree, threads))
    if done.returncode:
        raise RuntimeError(f"worker in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return 1e3 * statistics.median(record["compute_step_s"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.context", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", default="opt-125m")
    p.add_argument("--before", default=BEFORE, help="git revision to compare with ('' for none)")
    p.add_argument("--short", type=int, nargs=2, default=[32, 128], metavar=("PROMPT", "NEW"))
    p.add_argument("--long", type=int, nargs=2, default=[512, 512], metavar=("PROMPT", "NEW"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", default=".bench")
    args = p.parse_args(argv)

    work = Path(args.work_dir)
    trees = {"after": REPO}
    if args.before:
        trees["before"] = checkout(args.before, work)
    artifacts = {name: prepare(tree, args.arch, work / f"context-{name}", args.threads)
                 for name, tree in trees.items()}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(artifacts["after"]["hf_dir"])
    shapes = {"short": args.short, "long": args.long}
    prompts = {k: make_prompt(tokenizer, n) for k, (n, _) in shapes.items()}
    times = {(t, s): [] for t in trees for s in shapes}
    for r in range(args.rounds):
        for t, s in sorted(times, key=lambda k: hash((r,) + k)):
            ms = measure(trees[t], artifacts[t], prompts[s], shapes[s][1], args.threads)
            times[(t, s)].append(ms)
            print(f"round {r + 1} {t} {s}: {ms:.2f} ms", flush=True)
    print(f"\n{args.arch} shapes, batch 1, full depth, ONNX Runtime, {args.threads} threads, "
          f"{args.rounds} rounds (medians of per-round medians)\n")
    print(f"| tree | step ms, prompt {args.short[0]} + {args.short[1]} new | step ms, prompt "
          f"{args.long[0]} + {args.long[1]} new | long / short |")
    print("|---|---|---|---|")
    for t in trees:
        short, long_ = (statistics.median(times[(t, s)]) for s in shapes)
        label = f"before ({args.before})" if t == "before" else "after (this tree)"
        print(f"| {label} | {short:.2f} | {long_:.2f} | {long_ / short:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
