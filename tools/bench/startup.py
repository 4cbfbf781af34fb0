"""Start-up time: ``import runtime`` to the first generated token, each run in a fresh process.

    python -m tools.bench.startup artifacts/opt-e2e-skipdecode [--runs 10] [--json]
    python -m tools.bench.startup ART --checkout /tmp/main-copy --checkout .   # before/after, interleaved

Each run is a new Python process that times ``import runtime``, ``runtime.load(ARTIFACT)`` and the
first token of one greedy prompt (``generate(prompt, max_new_tokens=1)``: tokenizing, the prompt at
full depth, the head, sampling, detokenizing), and lists which heavy packages it imported. The
CPU time of the same span (all threads) is given too: on a shared machine it moves less with the
other work than the wall clock does. The interpreter's own start is timed from outside (process
spawn to exit) for context.
The page prints the median and the min-max spread of every phase over the runs; ``--warmup`` runs
first warm the page cache and are not counted. With several ``--checkout`` directories (copies of
this repository at different commits), the runs alternate between them, so a before/after
comparison shares the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from runtime import cli
from runtime.errors import SkipDecodeError

from .machine import describe
from .stats import median

REPO = Path(__file__).resolve().parents[2]  # so the child imports this checkout's runtime
DEMO_PROMPT = "name[The Eagle], eatType[coffee shop], food[French], area[riverside]"
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "tokenizers", "numpy")
PHASES = ("import_s", "load_s", "first_token_s", "total_s", "cpu_s", "process_s")

# The measured process. Its clock starts before `import runtime`; sys.modules is read at the end.
CHILD = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import runtime
t1 = time.perf_counter()
options = json.loads(sys.argv[3])
gen = runtime.load(sys.argv[1], **options)
t2 = time.perf_counter()
result = gen.generate(sys.argv[2], max_new_tokens=1)
t3, c3 = time.perf_counter(), time.process_time()
gen.close()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0,
                  "cpu_s": c3 - c0, "text": result.texts[0],
                  "modules": [m for m in sys.argv[4].split(",") if m in sys.modules]}))
"""


class StartupRunError(SkipDecodeError, RuntimeError):
    """The measured process failed (a broken artifact, a bad option): its stderr's tail says why."""


def run_once(artifact: str, prompt: str, options: dict, checkout: Path = REPO, timeout: float = 120) -> dict:
    """One measured process, importing ``runtime`` from ``checkout``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    artifact = str(Path(artifact).resolve())
    done = subprocess.run([sys.executable, "-c", CHILD, artifact, prompt, json.dumps(options), ",".join(HEAVY)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=checkout)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise StartupRunError(f"the measured process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["process_s"] = elapsed
    return record


def summarize(records: list[dict]) -> dict:
    """{phase: (median, min, max)} over the runs."""
    return {p: (median([r[p] for r in records]), min(r[p] for r in records), max(r[p] for r in records))
            for p in PHASES}


def render(by_checkout: dict[str, list[dict]], args) -> str:
    m = describe()
    command = f"python -m tools.bench.startup {args.artifact} --runs {args.runs} --warmup {args.warmup}"
    command += "".join(f" --checkout {c}" for c in args.checkout or ())
    lines = [command + (f" --threads {args.threads}" if args.threads else ""),
             f"{m['date']}; {m['cpu']}, {m['cores']} cores; Python {m['python']}; "
             f"onnxruntime {m['versions']['onnxruntime']}; load average {os.getloadavg()[0]:.1f} at the end"]
    names = {"import_s": "`import runtime`", "load_s": "`runtime.load`", "first_token_s": "first token",
             "total_s": "**import to first token**",
             "cpu_s": "CPU time, import to first token (all threads; less sensitive to other load)",
             "process_s": "whole process (interpreter start and exit too)"}
    for checkout, records in by_checkout.items():
        summary = summarize(records)
        lines += ["", f"{checkout}: imported {', '.join(records[0]['modules'])}; first token {records[0]['text']!r}",
                  "", "| phase | median ms | min ms | max ms |", "|---|---|---|---|"]
        for phase in PHASES:
            med, lo, hi = summary[phase]
            lines.append(f"| {names[phase]} | {med * 1e3:.0f} | {lo * 1e3:.0f} | {hi * 1e3:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.parser("python -m tools.bench.startup", __doc__.split("\n\n")[0])
    p.add_argument("artifact", help="artifact directory written by `python -m export build`")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt of the first token")
    p.add_argument("--runs", type=int, default=10, help="measured runs, each a fresh process")
    p.add_argument("--warmup", type=int, default=1, help="runs before them, not counted (page cache)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: the backend's)")
    p.add_argument("--checkout", action="append", type=Path,
                   help="a copy of this repository whose runtime to time (repeatable: runs alternate); "
                        "default: this one")
    p.add_argument("--json", action="store_true", help="print every run's record as JSON lines instead")
    args = p.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    options = {"threads": args.threads} if args.threads else {}

    checkouts = args.checkout or [REPO]

    def body():
        from runtime.artifact.manifest import load_manifest

        load_manifest(args.artifact, check_hashes=False)  # the argument before the first measured process
        for checkout in checkouts * args.warmup:
            run_once(args.artifact, args.prompt, options, checkout)
        by_checkout = {str(c): [] for c in checkouts}
        for _ in range(args.runs):
            for checkout in checkouts:
                record = run_once(args.artifact, args.prompt, options, checkout)
                by_checkout[str(checkout)].append({**record, "checkout": str(checkout)})
        if args.json:
            for records in by_checkout.values():
                for r in records:
                    print(json.dumps(r))
        else:
            print(render(by_checkout, args))

    return cli.run(body)


if __name__ == "__main__":
    sys.exit(main())
