"""``python -m tools.bench``: measured wall-clock speedup of SkipDecode, and the peers, side by side.

One interleaved run on the same weights, prompts and thread settings: transformers generate,
this project's torch and ONNX Runtime backends at full depth and under SkipDecode policies,
Optimum's ORTModelForCausalLM, ONNX Runtime GenAI at fp32 and int4 and llama.cpp at F32, Q8_0 and
Q4_0 (each in its own venv).
Writes a Markdown page and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from export.quantize import BLOCK_SIZE, QuantConfig
from runtime import cli
from runtime.errors import SkipDecodeError

from . import bandwidth as bandwidth_mod
from . import machine, prepare, report, results, rows as rows_mod, targets as targets_mod, venv
from .prompts import make_prompts
from .runner import LLAMACPP_WORKER, OPTIMUM_WORKER, ORTGENAI_WORKER, Job, run_all, schedule

ARCHS = ("opt-125m", "opt-1.3b", "tiny-random", "qwen3-0.6b", "smollm2-360m")  # random weights at these shapes
OVERRIDABLE = ("batch", "prompt", "backends", "speedups", "torch_speedups")


class BenchError(SkipDecodeError, ValueError):
    """A --arch or --backends value the benchmark cannot plan."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench", description=__doc__.splitlines()[2].strip() + " " + " ".join(
            line.strip() for line in __doc__.splitlines()[3:] if line.strip()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Backend tokens: NAME runs full depth plus the backend's speedups; NAME@full+2+5 "
               "picks levels. Names: " + ", ".join(rows_mod.BACKENDS) + ".\n"
               "--arch NAME[:key=value...] overrides batch, prompt, backends, speedups or "
               "torch_speedups for that architecture (lists comma-separated), e.g.\n"
               "  --arch opt-125m --arch 'opt-1.3b:batch=1:prompt=32:backends=hf,ort-nospin@full+2+5'")
    cli.add_version(p)
    p.add_argument("--arch", action="append", help="architecture (random weights at its real shapes): "
                   f"{', '.join(ARCHS)}; repeat for several (default opt-125m)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--prompt", type=int, nargs="+", default=[32, 128], help="prompt tokens (default 32 128)")
    cli.add_max_new_tokens(p, 128, "tokens generated per row (default 128)")
    p.add_argument("--backends", nargs="+", default=["hf", "torch", "ort", "optimum"],
                   help="rows to run (default hf torch ort optimum); see below")
    p.add_argument("--speedups", type=float, nargs="+", default=[2, 3, 5],
                   help="horizon speedups for the ONNX Runtime rows (default 2 3 5)")
    p.add_argument("--torch-speedups", type=float, nargs="+", default=[2],
                   help="horizon speedups for the torch backend rows (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads for every row (default 2)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="weights per scale along K of the quantized rows: this project's int4/int8 exports "
                        f"and GenAI's int4 build, so that they compare at the same block (default {BLOCK_SIZE}; "
                        "a power of two >= 16 that divides the model's widths)")
    p.add_argument("--spin", choices=("off", "auto"), default="off",
                   help="this project's ONNX Runtime rows other than ort-spin: off, workers that sleep "
                        "(runtime.load's default); auto, the command lines' default (spinning where no "
                        "other process uses the cores, as in a run of rows one at a time) (default off)")
    p.add_argument("--huge-pages", action="store_true",
                   help="this project's ONNX Runtime rows load with huge_pages=True (the server's default, "
                        "`python -m runtime --huge-pages`): their packed weights on 2 MiB pages")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians across them (default 3)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="untimed warm-up generation per run (default 8)")
    p.add_argument("--seed", type=int, default=0, help="random weights and round order (default 0)")
    # Not docs/ by default: a trial run must not overwrite the tracked page; pass --out docs/benchmarks.md
    p.add_argument("--out", help="Markdown page (default WORK_DIR/benchmarks.md; the published page: "
                                 "--out docs/benchmarks.md --plot docs/benchmark_speedup.png)")
    p.add_argument("--plot", help="PNG plot, '' for none (default WORK_DIR/benchmark_speedup.png)")
    p.add_argument("--work-dir", default=".bench", help="weights, exports, venv, raw results (default .bench)")
    p.add_argument("--optimum-python", help="python of an environment with optimum-onnx (default: "
                                            "create WORK_DIR/optimum-venv)")
    p.add_argument("--no-optimum-venv", action="store_true", help="never create the Optimum venv")
    p.add_argument("--ortgenai-python", help="python of an environment with onnxruntime-genai (default: "
                                             "create WORK_DIR/ortgenai-venv over this environment's packages)")
    p.add_argument("--no-ortgenai-venv", action="store_true", help="never create the ONNX Runtime GenAI venv")
    p.add_argument("--llamacpp-python", help="python of an environment with llama-cpp-python (default: create "
                                             "WORK_DIR/llamacpp-venv over this environment's packages; it "
                                             "compiles llama.cpp, ~25 min on 2 cores)")
    p.add_argument("--no-llamacpp-venv", action="store_true", help="never create the llama.cpp venv")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as failed (default 900)")
    p.add_argument("--render", metavar="RESULTS_JSON",
                   help="re-render the page and plot from a saved run's raw results; measures nothing")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def arch_settings(args) -> list[tuple[str, dict]]:
    """Blocks of (architecture, settings): batch, prompt, backends, speedups, torch_speedups with
    the block's overrides applied. An architecture may appear in several blocks (e.g. a costly row
    at fewer shapes); its runs are pooled and interleaved in the same rounds."""
    out = []
    for spec in args.arch or ["opt-125m"]:
        name, *pairs = spec.split(":")
        if name not in ARCHS:
            raise BenchError(f"--arch {name!r}: choose from {', '.join(ARCHS)}")
        s = {"batch": args.batch, "prompt": args.prompt, "backends": args.backends,
             "speedups": args.speedups, "torch_speedups": args.torch_speedups}
        for pair in pairs:
            key, _, value = pair.partition("=")
            key = key.replace("-", "_")
            if key not in OVERRIDABLE or not value:
                raise BenchError(f"--arch {spec!r}: {pair!r} is not KEY=VALUE with KEY one of {', '.join(OVERRIDABLE)}")
            items = value.split(",")
            try:
                s[key] = items if key == "backends" else [int(x) if key in ("batch", "prompt") else float(x) for x in items]
            except ValueError as exc:
                raise BenchError(f"--arch {spec!r}: {pair!r} has a value that is not a number ({exc})") from exc
        out.append((name, s))
    return out


def plan(args, settings: list[tuple[str, dict]]) -> list[tuple[str, rows_mod.Shape, rows_mod.Row]]:
    planned = []
    for arch, s in settings:
        try:
            arch_rows = rows_mod.rows_for(s["backends"], s["speedups"], s["torch_speedups"])
        except ValueError as exc:
            raise BenchError(f"{arch}: {exc}") from exc
        for batch in s["batch"]:
            for prompt in s["prompt"]:
                for row in arch_rows:
                    run = (arch, rows_mod.Shape(batch, prompt), row)
                    if run not in planned:
                        planned.append(run)
    return planned


def model_info(config: dict) -> dict:
    from .stats import head_bytes, layer_bytes

    size = 2 if config["dtype"] == "float16" else 4
    # OPT's formula unless the model's preparation counted its own (the Llama family's layers)
    return {"layer_bytes": layer_bytes(config["hidden_size"], config["ffn_dim"], size),
            "head_bytes": head_bytes(config["hidden_size"], config["vocab_size"], size), **config}


def measure(args, argv: list[str], log) -> dict:
    started = time.perf_counter()
    QuantConfig(weights="int4", block_size=args.block_size)  # a block size no export takes stops here
    settings = arch_settings(args)
    planned = plan(args, settings)
    if args.dry_run:
        for arch, shape, row in planned:
            print(f"{arch} {shape} {row.name}")
        print(f"{len(planned)} runs x {args.rounds} rounds = {len(planned) * args.rounds} processes")
        raise SystemExit(0)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("*\n")  # weights, exports and the venv stay out of git
    data = {"argv": argv, "machine": machine.describe(), "models": {}, "policies": {}, "jobs": [],
            "outcomes": [], "settings": {"threads": args.threads, "spin": args.spin, "huge_pages": args.huge_pages,
                                         "rounds": args.rounds, "seed": args.seed,
                                         "block_size": args.block_size,
                                         "new_tokens": args.max_new_tokens, "warmup_tokens": args.warmup_tokens}}
    log(f"measuring memory read bandwidth ({args.threads} thread(s))")
    data["bandwidth"] = bandwidth_mod.as_record(bandwidth_mod.measure(args.threads))

    envs = {}  # peer key ("optimum", "ortgenai", "llamacpp") -> its venv.PeerEnv, for the peers the rows need
    for key, peer, python, no_venv in (("optimum", venv.OPTIMUM, args.optimum_python, args.no_optimum_venv),
                                       ("ortgenai", venv.ORTGENAI, args.ortgenai_python, args.no_ortgenai_venv),
                                       ("llamacpp", venv.LLAMACPP, args.llamacpp_python, args.no_llamacpp_venv)):
        if any(rows_mod.VENV_PEERS.get(row.backend) == key for _, _, row in planned):
            env = envs[key] = venv.ensure(work / peer.directory, python, create=not no_venv, log=log, peer=peer)
            data[key] = {"available": env.available, "python": env.python, "versions": env.versions,
                         "reason": env.reason}
            if not env.available:
                log(f"{peer.name} rows unavailable: {env.reason}")

    from transformers import AutoTokenizer

    jobs: list[Job] = []
    archs = list(dict.fromkeys(arch for arch, _ in settings))
    for arch in archs:
        variants = sorted({row.backend for a, _, row in planned if a == arch} & set(rows_mod.QUANTIZED))
        prepared = prepare.prepare_in_subprocess(arch, work, args.seed, variants, args.block_size)
        info = model_info(prepared.config)
        data["models"][arch] = info
        L = info["num_layers"]
        peer_dirs = {}  # backend -> (its peer's export of this checkpoint or None, why not)
        for backend in sorted({row.backend for a, _, row in planned if a == arch} & set(rows_mod.VENV_PEERS)):
            env = envs[rows_mod.VENV_PEERS[backend]]
            if not env.available:
                peer_dirs[backend] = (None, env.reason)
            elif backend == "optimum":
                peer_dirs[backend] = prepare.prepare_optimum(prepared, env.python, OPTIMUM_WORKER, args.seed, log=log)
            elif backend in rows_mod.LLAMACPP:
                peer_dirs[backend] = prepare.prepare_llamacpp(prepared, env.python, LLAMACPP_WORKER,
                                                              rows_mod.LLAMACPP[backend], args.threads, args.seed, log=log)
            else:
                peer_dirs[backend] = prepare.prepare_ortgenai(prepared, env.python, ORTGENAI_WORKER,
                                                              rows_mod.ORTGENAI[backend], args.threads, args.seed, log=log,
                                                              block_size=args.block_size)
        tokenizer = AutoTokenizer.from_pretrained(str(prepared.hf_dir))
        pols = {}
        for a, shape, row in planned:
            if a != arch:
                continue
            policy = rows_mod.policy_for(row, L, args.max_new_tokens)
            theoretical = rows_mod.theoretical_speedup(policy, args.max_new_tokens)
            if not row.is_full:
                pols[f"{row.speedup:g}x"] = {**policy.to_dict(), "theoretical": theoretical}
            artifact = prepared.variants.get(row.backend, prepared.artifact_dir)
            peer_dir, peer_reason = peer_dirs.get(row.backend, (None, ""))
            spec = {"kind": row.backend, "hf_dir": str(prepared.hf_dir), "artifact_dir": str(artifact),
                    "optimum_dir": str(peer_dir) if row.backend == "optimum" and peer_dir else None,
                    "ortgenai_dir": str(peer_dir) if row.backend in rows_mod.ORTGENAI and peer_dir else None,
                    "llamacpp_gguf": str(peer_dir) if row.backend in rows_mod.LLAMACPP and peer_dir else None,
                    "context": shape.prompt + args.warmup_tokens + args.max_new_tokens + 8,
                    "prompts": make_prompts(tokenizer, shape.batch, shape.prompt),
                    "new_tokens": args.max_new_tokens, "warmup_tokens": args.warmup_tokens,
                    "threads": args.threads, "spin": args.spin, "huge_pages": args.huge_pages,
                    "pad_token_id": info["pad_token_id"],
                    "policy": policy.to_dict() if row.backend in rows_mod.RUNTIME else None}
            unavailable = peer_reason if row.backend in peer_dirs and not peer_dir else ""
            if row.backend in rows_mod.LLAMACPP and shape.batch != 1 and not unavailable:
                unavailable = "llama-cpp-python's Llama decodes one sequence: its rows run at batch 1 only"
            env = envs.get(rows_mod.VENV_PEERS.get(row.backend))
            jobs.append(Job(arch, shape, row, spec, env.python if env else None, unavailable))
            data["jobs"].append({"arch": arch, "batch": shape.batch, "prompt": shape.prompt,
                                 "backend": row.backend, "speedup": row.speedup, "theoretical": theoretical,
                                 "policy": spec["policy"], "unavailable": unavailable})
        data["policies"][arch] = dict(sorted(pols.items(), key=lambda kv: float(kv[0][:-1])))

    raw_path = work / "results.json"
    order = []
    for i, arch in enumerate(archs):  # one architecture's rounds after the other's
        order += schedule([j for j in jobs if j.arch == arch], args.rounds, args.seed + i)

    def save(outcome):
        j = outcome.job
        data["outcomes"].append({"key": [j.arch, j.shape.batch, j.shape.prompt, j.row.backend, j.row.speedup],
                                 "round": outcome.round, "record": outcome.record, "error": outcome.error,
                                 "wall_s": round(outcome.wall_s, 2)})
        data["elapsed_s"] = time.perf_counter() - started
        raw_path.write_text(json.dumps(data))

    run_all(order, args.threads, args.timeout, progress=cli.progress(args.quiet), on_outcome=save)
    log("measuring memory read bandwidth again, at the end")
    data["bandwidth"] = bandwidth_mod.with_end(data["bandwidth"], bandwidth_mod.measure(args.threads))
    data["elapsed_s"] = time.perf_counter() - started
    raw_path.write_text(json.dumps(data))
    log(f"raw results: {raw_path}")
    return data


def write_outputs(data: dict, out: str, plot_path: str, log) -> tuple[list, list]:
    rows = results.build_rows(data)
    targets = targets_mod.evaluate(rows)
    plot_name = None
    if plot_path:
        from .plot import plot

        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, data["models"], plot_path)
        plot_name = Path(plot_path).name if Path(plot_path).parent == Path(out).parent else str(plot_path)
        log(f"wrote {plot_path}")
    out_path = Path(out)
    previous = out_path.read_text() if out_path.is_file() else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(report.render(data, rows, targets, plot_name, previous))
    log(f"wrote {out_path}")
    return rows, targets


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return cli.run(lambda: _main(args, argv))


def _main(args, argv: list[str]) -> int:
    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    if args.render:
        if not Path(args.render).is_file():
            raise BenchError(f"--render {args.render}: no such file; pass the JSON a previous run wrote")
        data = json.loads(Path(args.render).read_text())
    else:
        data = measure(args, argv, log)
    work = Path(args.work_dir)
    out = args.out if args.out is not None else str(work / "benchmarks.md")
    plot = args.plot if args.plot is not None else str(work / "benchmark_speedup.png")
    rows, targets = write_outputs(data, out, plot, log)
    print(report.terminal_summary(rows, targets))
    return 0
