"""``python -m tools.trtexec ARTIFACT_DIR (--graph layer_03 | --all) --batch 4 --past 256 [--run]``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime import cli
from runtime.artifact.manifest import GraphSpec, Manifest, load_manifest

from .command import OutputPaths, RunSettings, build_command, format_command, parse_size_mib
from .errors import UnknownGraphError
from .flags import precision_flags
from .parse_check import check_graphs
from .polygraphy import build_polygraphy_command, tolerance_note
from .report import GraphResult, markdown_report, read_profile, read_times
from .run import find_trtexec, require_trtexec, run_trtexec
from .shapes import PHASES, Limits, Profile, resolve_profile
from .version import detect_version

OUT_SUBDIR = "trtexec"  # default --out: ARTIFACT_DIR/trtexec (the manifest ignores files it does not name)


@dataclass(frozen=True)
class Job:
    graph: GraphSpec  # the manifest's entry for the graph
    cmd: list  # the trtexec argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.trtexec",
        description="Print, and with --run execute, the trtexec command that builds and times one graph "
                    "of an exported artifact (or all of them), then tabulate trtexec's exported times.")
    cli.add_version(p)
    p.add_argument("artifact_dir", help="artifact directory written by `python -m export build`")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--graph", help="graph to profile: embed, layer_NN or head")
    which.add_argument("--all", action="store_true", help="every graph of the artifact, into one table")
    lim = p.add_argument_group("shapes (one optimization profile per command)")
    lim.add_argument("--batch", type=int, default=1, help="batch of the timed run and the profile's opt (default 1)")
    lim.add_argument("--seq", type=int, default=1, help="tokens per step: 1 decodes, more is a prompt (default 1)")
    lim.add_argument("--past", type=int, default=0, help="cached positions of the timed decode step (default 0)")
    lim.add_argument("--max-batch", type=int, help="profile's max batch (default: --batch)")
    lim.add_argument("--max-seq", type=int, help="max past + sequence (default: max_position_embeddings)")
    lim.add_argument("--max-prompt", type=int, help="prefill profile's max sequence (default: --max-seq)")
    lim.add_argument("--phase", choices=PHASES, help="decode (seq 1, past 0..max-seq-1) or prefill (seq "
                                                     "1..max-prompt, past 0); default: decode if --seq is 1")
    b = p.add_argument_group("build and run")
    b.add_argument("--fp16", action="store_true", help="fp16 kernels for an fp32 artifact (implied for fp16)")
    b.add_argument("--trt-version", help="TensorRT version the flags are for (default: trtexec's banner, "
                                         "else the tensorrt module, else 10.3 = JetPack 6)")
    b.add_argument("--trtexec", help="trtexec binary (default: on PATH, else /usr/src/tensorrt/bin/trtexec)")
    b.add_argument("--run", action="store_true", help="execute trtexec and print the latency table")
    b.add_argument("--out", help=f"exported JSON, logs and the shared timing cache "
                                 f"(default: ARTIFACT_DIR/{OUT_SUBDIR})")
    b.add_argument("--engine-dir", help="save each engine as DIR/<graph>.plan (default: not saved)")
    b.add_argument("--workspace", default="2GiB", help="builder workspace, e.g. 2GiB, 512MiB (default 2GiB)")
    b.add_argument("--warmup-ms", type=int, default=RunSettings.warmup_ms, help="trtexec --warmUp (ms)")
    b.add_argument("--duration-s", type=int, default=RunSettings.duration_s, help="trtexec --duration (s)")
    b.add_argument("--iterations", type=int, default=RunSettings.iterations, help="trtexec --iterations")
    b.add_argument("--cuda-graph", action="store_true", help="trtexec --useCudaGraph")
    b.add_argument("--data-transfers", choices=("auto", "on", "off"), default="auto",
                   help="time H2D/D2H copies: auto = only embed and head, whose I/O is on the host")
    b.add_argument("--top", type=int, default=5, help="slowest TensorRT layers listed per graph (0: none)")
    c = p.add_argument_group("accuracy on the device (Polygraphy)")
    c.add_argument("--polygraphy", action="store_true",
                   help="after each trtexec command, print the `polygraphy run --onnxrt --trt` comparison of "
                        "the same graph, shapes and precision with ONNX Runtime")
    c.add_argument("--layerwise", action="store_true",
                   help="with --polygraphy: compare every intermediate tensor (mark all outputs in both "
                        "runners), to find the first TensorRT layer that differs")
    return p


def select_graphs(manifest: Manifest, name: str | None, artifact_dir) -> list[GraphSpec]:
    if name is None:
        return list(manifest.graphs)
    for g in manifest.graphs:
        if g.name == name:
            return [g]
    raise UnknownGraphError(
        f"{artifact_dir} has no graph {name!r}; available: {', '.join(g.name for g in manifest.graphs)}")


def _limits(args) -> Limits:
    return Limits(batch=args.batch, sequence=args.seq, past=args.past, max_batch=args.max_batch,
                  max_seq=args.max_seq, max_prompt=args.max_prompt, phase=args.phase)


def _settings(args) -> RunSettings:
    transfers = {"auto": None, "on": True, "off": False}[args.data_transfers]
    return RunSettings(warmup_ms=args.warmup_ms, duration_s=args.duration_s, iterations=args.iterations,
                       workspace_mib=parse_size_mib(args.workspace), cuda_graph=args.cuda_graph,
                       data_transfers=transfers)


def _describe(profile: Profile) -> str:
    lo, opt, hi = profile.min, profile.opt, profile.max
    return (f"{profile.phase} profile: batch {lo['batch']}..{hi['batch']} (run {opt['batch']}), sequence "
            f"{lo['sequence']}..{hi['sequence']} (run {opt['sequence']}), past {lo['past']}.."
            f"{hi['past']} (run {opt['past']}), bound past width {lo['past_sequence']}.."
            f"{hi['past_sequence']} in pages of {opt['page_size']} (run {opt['past_sequence']})")


def _result(job: Job, profile: Profile, paths: OutputPaths, settings: RunSettings) -> GraphResult:
    name = job.graph.name
    iterations, layers = read_profile(paths.profile(name))
    run = profile.run
    return GraphResult(name, profile.phase, run["batch"], run["sequence"], run["past"],
                       read_times(paths.times(name), settings.warmup_ms), layers, iterations)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _main(args))


def _main(args) -> int:
    artifact_dir = Path(args.artifact_dir)
    manifest = load_manifest(artifact_dir, check_hashes=False)  # sizes are checked; hashing GBs is not needed
    graphs = select_graphs(manifest, args.graph, artifact_dir)
    profile = resolve_profile(_limits(args), manifest.model.max_position_embeddings, manifest.page_size)
    settings = _settings(args)
    trtexec = require_trtexec(args.trtexec) if args.run else find_trtexec(args.trtexec)
    detected = detect_version(args.trt_version, trtexec)
    warnings = check_graphs(artifact_dir, graphs, detected.version)  # before anything is printed or run
    precision = precision_flags(detected.version, manifest.dtype, args.fp16)
    out_dir = Path(args.out) if args.out else artifact_dir / OUT_SUBDIR
    paths = OutputPaths(out_dir, Path(args.engine_dir) if args.engine_dir else None)
    jobs = [Job(g, build_command(trtexec or "trtexec", artifact_dir, g, profile, detected.version, precision,
                                 paths, settings)) for g in graphs]
    print(f"# TensorRT {detected.version} ({detected.source})", file=sys.stderr)
    print(f"# {manifest.dtype} ONNX: {precision.reason}", file=sys.stderr)
    print(f"# {_describe(profile)}", file=sys.stderr)
    for line in warnings:
        print(f"# {line}", file=sys.stderr)
    checks = {}
    if args.polygraphy or args.layerwise:
        print(f"# {tolerance_note(precision, manifest.dtype)}", file=sys.stderr)
        checks = {job.graph.name: build_polygraphy_command(
            artifact_dir, job.graph, profile, precision, manifest.dtype, manifest.model.vocab_size,
            settings.workspace_mib, layerwise=args.layerwise) for job in jobs}
    if not args.run:
        for job in jobs:
            print(format_command(job.cmd))
            if job.graph.name in checks:
                print(format_command(checks[job.graph.name]))
        return 0
    for cmd in checks.values():  # printed, not run: Polygraphy builds its own engine, minutes per graph
        print(f"# accuracy: {format_command(cmd)}", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    if paths.engine_dir is not None:
        paths.engine_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for job in jobs:
        print(f"$ {format_command(job.cmd)}", file=sys.stderr)
        run_trtexec(job.cmd, paths.log(job.graph.name))
        results.append(_result(job, profile, paths, settings))
    print(markdown_report(results, top=args.top), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
