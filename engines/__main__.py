"""Command line: ``python -m engines build ARTIFACT_DIR --max-batch 8 --max-seq 1024 --workspace 2GiB``
and ``python -m engines verify ARTIFACT_DIR`` (engines.verify).

Exit codes: 0 built (or already up to date); 2 a user error, one line on stderr that says how to fix
it (TensorRT or a CUDA GPU missing here, bad arguments, a broken artifact); anything else is a bug.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime import cli
from runtime.artifact.manifest import load_manifest

from .config import EngineBuildConfig, parse_size
from .manifest import DEFAULT_ENGINE_DIR


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engines",
                                description="Build TensorRT engines from an exported artifact.")
    cli.add_version(p)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or finish) one engine per graph of an artifact",
                       description="Run on the device that will run the engines: a plan is "
                                   "specific to its TensorRT version and GPU.")
    b.add_argument("artifact_dir", help="directory written by `python -m export build`")
    b.add_argument("--max-batch", type=int, default=8, help="largest batch (default: 8)")
    b.add_argument("--max-seq", type=int, default=None,
                   help=f"largest prompt + new tokens; sizes the KV buffers (default: "
                        f"{EngineBuildConfig.max_seq}, or the model's max_position_embeddings when smaller)")
    b.add_argument("--max-prompt", type=int, default=None,
                   help="longest padded prompt of the prefill profile (default: --max-seq)")
    b.add_argument("--workspace", default="2GiB",
                   help="builder memory-pool limit, e.g. 2GiB, 512MiB (default: 2GiB; pass 1GiB on 8 GB boards)")
    b.add_argument("--fp16", action="store_true",
                   help="fp16 engines from an fp32 export (an fp16 export always builds fp16)")
    b.add_argument("--engine-dir", default=None,
                   help=f"where plans go (default: ARTIFACT_DIR/{DEFAULT_ENGINE_DIR})")
    b.add_argument("--timing-cache", default=None,
                   help="shared timing cache file (default: ENGINE_DIR/timing.cache)")
    b.add_argument("--force", action="store_true", help="rebuild every engine, even up-to-date ones")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="compare each built engine with ONNX Runtime through Polygraphy",
                       description="Run every engine (each optimization profile at its opt shapes) and "
                                   "the ONNX graph it was built from on the same inputs through "
                                   "Polygraphy's TensorRT and ONNX Runtime runners, and compare them "
                                   "(exit 1 when one differs beyond the tolerance).")
    v.add_argument("artifact_dir", help="directory written by `python -m export build`")
    v.add_argument("--engine-dir", default=None,
                   help=f"where the plans are (default: ARTIFACT_DIR/{DEFAULT_ENGINE_DIR})")
    v.add_argument("--graph", action="append", help="only this graph (repeatable; default: every engine)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _verify(args) if args.command == "verify" else _build(args))


def _verify(args) -> int:
    from runtime.compare import polygraphy_version

    from .verify import TOLERANCE, trt_runner, verify_engines

    checks = verify_engines(args.artifact_dir, args.engine_dir, args.graph, trt_runner,
                            progress=not args.quiet)
    print(f"verify engines of {args.artifact_dir} against ONNX Runtime through Polygraphy "
          f"{polygraphy_version()} (TrtRunner vs OnnxrtRunner, compare_accuracy, atol {TOLERANCE[0]:g} "
          f"rtol {TOLERANCE[1]:g})")
    for c in checks:
        print("  " + c.line())
    failed = [f"{c.graph} {c.profile}" for c in checks if not c.passed]
    print(f"FAILED: {', '.join(failed)}" if failed else "PASSED")
    return 1 if failed else 0


def _build(args) -> int:
    workspace = parse_size(args.workspace)  # the arguments' own errors before the artifact's
    model = load_manifest(args.artifact_dir, check_hashes=False).model  # sizes only: build_engines hashes
    max_seq = EngineBuildConfig.default_max_seq(model.max_position_embeddings) if args.max_seq is None \
        else args.max_seq  # an explicit one past the model's positions is refused by validate
    config = EngineBuildConfig(max_batch=args.max_batch, max_seq=max_seq,
                               max_prompt=args.max_prompt, workspace=workspace,
                               precision="fp16" if args.fp16 else "fp32",
                               timing_cache=args.timing_cache)
    # The arguments first (the artifact, the limits against its model), then the toolchain:
    # a typo is reported as a typo, not as TensorRT missing.
    config.validate(model)
    from .build import build_engines

    report = build_engines(args.artifact_dir, config, engine_dir=args.engine_dir,
                           force=args.force, progress=cli.progress(args.quiet))
    print(f"{report.engine_dir}: built {len(report.built)}, up to date {len(report.skipped)}")
    engine_dir = "" if args.engine_dir is None else f", engine_dir={str(Path(args.engine_dir))!r}"
    print(f"next: runtime.generate({args.artifact_dir!r}, prompts, backend='tensorrt'{engine_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
