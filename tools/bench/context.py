"""``python -m tools.bench.context``: decode step time before and after a change, long context included.

Decode step time (embed + layers + head, ONNX Runtime backend, greedy, EOS ignored) for each case
BATCH:PROMPT:NEW:SPEEDUP, for this tree and for another git revision (``--before``, default the
commit before the in-place KV cache), each in fresh worker processes on its own export of the same
random weights, interleaved over ``--rounds`` rounds.

The ratio of the long-context case to the short one is what the in-place KV cache is for: a
per-step copy of the past grows with the context; reading the past K/V legitimately costs its bytes
over the weights' bytes. The other cases check that nothing got slower at batch 1 and 8.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

from runtime import cli

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


def measure(tree: Path, prepared: dict, prompts: list[str], new_tokens: int, speedup: float,
            threads: int) -> float:
    """Median decode step time in ms, from that tree's own bench worker."""
    from runtime.policy import SkipPolicy

    policy = SkipPolicy.for_speedup(prepared["config"]["num_layers"], speedup, horizon=max(new_tokens - 1, 1))
    spec = {"kind": "ort", "artifact_dir": prepared["artifact_dir"], "prompts": prompts,
            "new_tokens": new_tokens, "warmup_tokens": 8, "threads": threads,
            "policy": {k: v for k, v in policy.to_dict().items() if k != "num_layers"}}
    done = subprocess.run([sys.executable, "-m", "tools.bench.worker", json.dumps(spec)], cwd=tree,
                          capture_output=True, text=True, env=_env(tree, threads))
    if done.returncode:
        raise RuntimeError(f"worker in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    return 1e3 * statistics.median(record["compute_step_s"])


def main(argv=None) -> int:
    p = cli.parser("python -m tools.bench.context", __doc__.splitlines()[0])
    p.add_argument("--arch", default="opt-125m", help="random weights at this architecture's shapes")
    p.add_argument("--before", default=BEFORE, help="git revision to compare with ('' for none)")
    p.add_argument("--cases", nargs="+", default=["1:32:128:1", "1:512:512:1", "8:32:128:1", "1:32:128:2",
                                                  "8:32:128:2"], help="BATCH:PROMPT:NEW:SPEEDUP each")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians across them")
    p.add_argument("--work-dir", default=".bench", help="the checked-out revision and the exported weights")
    args = p.parse_args(argv)

    work = Path(args.work_dir)
    trees = {"after": REPO}
    if args.before:
        try:
            trees["before"] = checkout(args.before, work)
        except subprocess.CalledProcessError as exc:
            p.error(f"--before {args.before}: `git worktree add` failed: {exc.stderr.decode().strip()}")
    artifacts = {name: prepare(tree, args.arch, work / f"context-{name}", args.threads)
                 for name, tree in trees.items()}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(artifacts["after"]["hf_dir"])
    cases = [tuple(float(x) if i == 3 else int(x) for i, x in enumerate(c.split(":"))) for c in args.cases]
    prompts = {c: [make_prompt(tokenizer, c[1], row) for row in range(c[0])] for c in cases}
    times = {(t, c): [] for t in trees for c in cases}
    for r in range(args.rounds):
        order = list(times)
        random.Random(r).shuffle(order)  # drift spreads over every case instead of the last ones
        for t, c in order:
            ms = measure(trees[t], artifacts[t], prompts[c], c[2], c[3], args.threads)
            times[(t, c)].append(ms)
            print(f"round {r + 1} {t} {c}: {ms:.2f} ms", flush=True)
    print(f"\n{args.arch} shapes, ONNX Runtime, {args.threads} threads, {args.rounds} rounds "
          f"(medians of per-run median step times), `--before {args.before}`\n")
    print("| batch | prompt | new | speedup | " + " | ".join(f"{t} step ms" for t in trees)
          + (" | after / before |" if "before" in trees else " |"))
    print("|---|---|---|---|" + "---|" * (len(trees) + ("before" in trees)))
    for c in cases:
        med = {t: statistics.median(times[(t, c)]) for t in trees}
        ratio = f" {med['after'] / med['before']:.2f}x |" if "before" in trees else ""
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]:g}x | " + " | ".join(f"{m:.2f}" for m in med.values())
              + " |" + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
