"""``python -m tools.evaluate``: generated-text quality at full depth and under SkipDecode policies.

For one or more exported artifacts, generate every unique prompt of an evaluation set at each
speedup, score BLEU and ROUGE-L against all of its references, measure the decode time beside
it, and write a Markdown page (docs/quality.md) with the targets and sample outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from runtime import cli
from runtime.backends import BACKENDS
from runtime.errors import ArtifactError, SkipDecodeError
from runtime.policy import DECAYS, PREFILLS

from . import metrics, report, targets as targets_mod
from .run import ModelSpec, RunSettings, run_model
from .summary import summarize


class EvaluateError(SkipDecodeError):
    """Command-line input that cannot be evaluated (a bad --model, --speedups, --render file)."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=report.PROG, description="\n".join(__doc__.strip().splitlines()[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example:\n  python -m tools.evaluate --data data/e2e/devset.csv.gz --prompt-column mr "
               "--target-column ref \\\n      --model 'fine-tuned under SkipDecode=artifacts/e2e' "
               "--model 'full-depth only=artifacts/e2e-base' \\\n      --speedups 1 2 3 4 5 "
               "--out docs/quality.md --json .work/quality.json")
    cli.add_version(p)
    p.add_argument("--data", help="CSV (header row) or JSONL of (prompt, target) pairs; a prompt's "
                                  "rows are its references")
    # the shipped E2E data's names (data/e2e); the column names say which a file has
    p.add_argument("--prompt-column", default="mr", help="(default mr, as data/e2e)")
    p.add_argument("--target-column", default="ref", help="(default ref, as data/e2e)")
    p.add_argument("--limit", type=_positive, help="evaluate only the first N unique prompts")
    p.add_argument("--model", action="append", metavar="[NAME=]DIR",
                   help="artifact directory from `python -m export build`, optionally named (default "
                        "name: the directory's basename); repeat for several. The first is the "
                        "reference: ΔBLEU is against its full depth and the targets are about it")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 2, 3, 4, 5], metavar="S",
                   help="horizon speedup targets, 1 = full depth (default 1 2 3 4 5; full depth "
                        "is always run: it is the baseline)")
    p.add_argument("--decay", choices=DECAYS,
                   help="budget curve of the skipping policies (default: the artifact's, else linear)")
    p.add_argument("--exponent", type=float, help="of the power decay (default 2)")
    p.add_argument("--prefill", choices=PREFILLS,
                   help="the prompt's layers under a skipping policy: full depth or the first step's "
                        "active set (default: the artifact's, else full)")
    p.add_argument("--deep-copies", action=argparse.BooleanOptionalAction,
                   help="the skipping policies' tokens that copy a rare string of the prompt run deeper "
                        "(runtime.decoding.copying; default: each artifact's)")
    cli.add_max_new_tokens(p, 64, "(default 64)", type=_positive)
    p.add_argument("--batch-size", type=_positive, default=16, help="prompts per batch (default 16)")
    p.add_argument("--backend", choices=BACKENDS, default="onnxruntime", help="what runs the graphs (default onnxruntime)")
    p.add_argument("--threads", type=_positive, help="intra-op threads (default: the backend's)")
    p.add_argument("--timing-rounds", type=_positive, default=1,
                   help="generation rounds for the timings; rounds after the first only time (default 1)")
    p.add_argument("--seed", type=int, default=0, help="order of the speedups within a batch (default 0)")
    # not docs/ by default: a trial run must not overwrite the tracked page
    p.add_argument("--out", default=".work/quality.md",
                   help="Markdown page (default .work/quality.md; the published page: --out docs/quality.md)")
    p.add_argument("--json", metavar="PATH", help="write the raw results (every hypothesis, every timing) here")
    p.add_argument("--render", metavar="RESULTS_JSON", nargs="+",
                   help="re-render the page from --json file(s); generates nothing. Several files of runs "
                        "on the same prompts make one page, their models in the order given (e.g. a "
                        "comparison model run with fewer timing rounds)"),
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def parse_model(spec: str) -> ModelSpec:
    """NAME=DIR, or DIR alone (named by its basename). A DIR that exists is never split at '='."""
    name, sep, directory = spec.partition("=")
    if not sep or Path(spec).is_dir():
        name, directory = Path(spec).name or spec, spec
    if not name.strip() or not directory:
        raise EvaluateError(f"--model {spec!r}: expected NAME=DIR or DIR")
    return ModelSpec(name.strip(), directory)


def check_models(specs: list[ModelSpec]) -> None:
    """Fail before generating anything: duplicate names, missing or incomplete artifacts."""
    from runtime.artifact.manifest import load_manifest

    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise EvaluateError(f"--model names must differ; {', '.join(map(repr, duplicates))} given twice: "
                            f"name them with NAME=DIR")
    for spec in specs:
        try:
            load_manifest(spec.directory, check_hashes=False)  # hashes are checked when it loads
        except ArtifactError as exc:
            raise ArtifactError(f"--model {spec.name}={spec.directory}: {exc}") from exc


def speedup_list(speedups: list[float]) -> list[float]:
    bad = [s for s in speedups if not s >= 1]
    if bad:
        raise EvaluateError(f"--speedups must be >= 1 (1 = full depth), got {', '.join(f'{s:g}' for s in bad)}")
    return sorted({1.0, *map(float, speedups)})


def machine_info() -> dict:
    from tools.bench.machine import describe

    info = describe()
    for dist in ("sacrebleu", "rouge-score"):
        try:
            info["versions"][dist] = version(dist)
        except PackageNotFoundError:
            info["versions"][dist] = "not installed"
    return info


def measure(args, argv: list[str], log) -> dict:
    from . import data as data_mod

    started = time.perf_counter()
    if not args.data or not args.model:
        raise EvaluateError("--data and at least one --model are needed (or --render RESULTS_JSON)")
    if args.threads is not None and args.backend == "tensorrt":
        raise EvaluateError("--threads applies to the onnxruntime and torch backends, not tensorrt")
    specs = [parse_model(s) for s in args.model]
    speedups = speedup_list(args.speedups)
    evalset = data_mod.load(args.data, args.prompt_column, args.target_column, args.limit)
    check_models(specs)
    log(f"{len(evalset.prompts)} prompts, {sum(map(len, evalset.references))} references; "
        f"{len(specs)} model(s) x speedups {', '.join(f'{s:g}' for s in speedups)}")
    settings = RunSettings(speedups=speedups, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size, backend=args.backend, threads=args.threads,
                           timing_rounds=args.timing_rounds, seed=args.seed, progress=cli.progress(args.quiet),
                           policy_options={k: v for k, v in (("decay", args.decay), ("exponent", args.exponent),
                                                             ("prefill", args.prefill),
                                                             ("deep_copies", args.deep_copies)) if v is not None})
    data = {"tool": "tools.evaluate", "argv": argv, "machine": machine_info(),
            "settings": {"data": args.data, "prompt_column": args.prompt_column,
                         "target_column": args.target_column, "limit": args.limit,
                         "pairs": evalset.pairs, "max_new_tokens": args.max_new_tokens,
                         "batch_size": args.batch_size, "speedups": speedups, "backend": args.backend,
                         "threads": args.threads, "timing_rounds": args.timing_rounds, "seed": args.seed,
                         "policy_options": settings.policy_options},
            "prompts": evalset.prompts, "references": evalset.references, "models": []}
    for spec in specs:
        data["models"].append(run_model(spec, evalset.prompts, settings))
        data["elapsed_s"] = time.perf_counter() - started
        if args.json:
            write_json(data, args.json)  # after every model: a later failure keeps the finished ones
    if args.json:
        log(f"raw results: {args.json}")
    return data


def write_json(data: dict, path: str) -> None:
    from engines.atomic import write_text_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, ensure_ascii=False, indent=1))


def read_json(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EvaluateError(f"--render {path}: cannot read the raw results ({exc})") from exc
    if not isinstance(data, dict) or data.get("tool") != "tools.evaluate" or not data.get("models"):
        raise EvaluateError(f"--render {path}: not a results file of `python -m tools.evaluate --json`")
    return data


def merge(parts: list[dict], paths: list[str]) -> dict:
    """One results dict from several runs on the same prompts: the models in order, each model
    remembering the command and settings that produced it."""
    data = dict(parts[0])
    data["commands"], data["models"] = [], []
    for part, path in zip(parts, paths):
        if part["prompts"] != parts[0]["prompts"] or part["references"] != parts[0]["references"]:
            raise EvaluateError(f"--render {path}: other prompts or references than {paths[0]}; "
                                f"only runs on the same data make one page")
        data["commands"].append(part["argv"])
        for model in part["models"]:
            data["models"].append({**model, "command": len(data["commands"]),
                                   "timing_rounds": part["settings"]["timing_rounds"]})
    data["elapsed_s"] = sum(p.get("elapsed_s", 0) for p in parts)
    return data


def read_results(paths: list[str]) -> dict:
    parts = [read_json(p) for p in paths]
    return parts[0] if len(parts) == 1 else merge(parts, paths)


def write_page(data: dict, out: str, log):
    summary = summarize(data)
    targets = targets_mod.evaluate(summary)
    out_path = Path(out)
    previous = out_path.read_text(encoding="utf-8") if out_path.is_file() else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(report.render(data, summary, targets, previous), encoding="utf-8")
    log(f"wrote {out_path}")
    return summary, targets


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)

    return cli.run(lambda: _main(args, argv))


def _main(args, argv: list[str]) -> int:
    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    metrics.require()  # before an hour of generation, not after (cli.run turns errors into exit 2)
    data = read_results(args.render) if args.render else measure(args, argv, log)
    summary, targets = write_page(data, args.out, log)
    print(report.terminal_summary(summary, targets))
    return 0
