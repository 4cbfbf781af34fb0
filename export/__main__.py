"""Command line: ``python -m export build`` and ``python -m export verify``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime import cli
from runtime.errors import PolicyError, SkipDecodeError

from .checkpoint import ALIASES, DEMO_MODEL, TINY_RANDOM
from .quantize import FORMATS, WEIGHTS

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export",
                                description="Export OPT checkpoints to per-layer ONNX for SkipDecode.")
    cli.add_version(p)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="export a checkpoint into an artifact directory")
    b.add_argument("--model", default=DEMO_MODEL,
                   help=f"hub id (facebook/opt-1.3b), alias ({', '.join(ALIASES)}), local checkpoint "
                        f"directory, {TINY_RANDOM} (a random 8-layer OPT built offline, for smoke tests) or "
                        f"{DEMO_MODEL} (default: the trained demo model in models/)")
    b.add_argument("--out", help="artifact directory (default: artifacts/<model name>)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="fp16 keeps softmax and layer norm in fp32 (default: fp32)")
    b.add_argument("--opset", type=int, choices=range(14, 18), default=17, metavar="{14..17}",
                   help="ONNX opset (default 17); 16 writes layer norm without LayerNormalization, "
                        "for TensorRT 8.5 (JetPack 5)")
    b.add_argument("--random-weights", action="store_true",
                   help="build the alias's architecture with random weights instead of downloading")
    b.add_argument("--seed", type=int, default=0, help="seed of random weights (default: 0)")
    b.add_argument("--external-data", choices=("auto", "always", "never"), default="auto",
                   help="store weights beside each graph: auto = graphs over 2 GB (default)")
    b.add_argument("--page-size", type=int, default=32,
                   help="KV positions per page of the runtime's cache (default 32): a decode step "
                        "reads the past in whole pages")
    b.add_argument("--engine", choices=("none", "trt"), default="none",
                   help="trt: then build TensorRT engines here with `python -m engines build`'s "
                        "defaults (on a Jetson, build them on the device instead)")
    b.add_argument("--no-check", action="store_true", help="skip the check of each graph against PyTorch")
    q = b.add_argument_group("weight-only quantization (ONNX Runtime's block-wise quantizer; export.quantize)")
    q.add_argument("--weights", choices=WEIGHTS, default="float",
                   help="the layers' and head's MatMul weights (default: float, the --dtype)")
    q.add_argument("--head-weights", choices=WEIGHTS,
                   help="the head's alone, e.g. --head-weights int4 with float layers (default: --weights)")
    q.add_argument("--block-size", type=int, default=32,
                   help="weights per scale along each weight's input dimension (default 32)")
    q.add_argument("--weights-format", choices=FORMATS, default="matmulnbits",
                   help="matmulnbits: ONNX Runtime's MatMulNBits (default); qdq: int4 as opset 21 "
                        "blocked DequantizeLinear + MatMul, which TensorRT 10+ parses")
    pol = b.add_argument_group("default skip policy recorded in the manifest (default: full depth)")
    pol.add_argument("--speedup", type=float, help="pick min/max layers for this theoretical speedup")
    pol.add_argument("--max-layers", type=int)
    pol.add_argument("--min-layers", type=int)
    pol.add_argument("--warmup-layers", type=int, default=1)
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    v = sub.add_parser("verify", help="recheck an artifact against PyTorch and transformers")
    v.add_argument("directory")
    v.add_argument("--model", help="checkpoint to compare with (default: the one the manifest names)")
    v.add_argument("--max-new-tokens", type=int, default=16)
    v.add_argument("--speedup", type=float, default=2.0, help="skip policy to check (default: 2)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def _policy_fields(args) -> dict | None:
    if args.speedup is not None:
        if args.max_layers is not None or args.min_layers is not None:
            raise PolicyError("pass --speedup or --max-layers/--min-layers, not both")
        return {"speedup": args.speedup, "warmup_layers": args.warmup_layers}
    if args.max_layers is None and args.min_layers is None:
        return None
    if args.max_layers is None or args.min_layers is None:
        raise PolicyError("--max-layers and --min-layers go together")
    return {"max_layers": args.max_layers, "min_layers": args.min_layers,
            "warmup_layers": args.warmup_layers}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            from .build import BuildOptions, build

            out = args.out or str(Path("artifacts") / Path(args.model.rstrip("/")).name)
            manifest = build(BuildOptions(
                model=args.model, out=out, dtype=DTYPES[args.dtype], opset=args.opset,
                random_weights=args.random_weights, seed=args.seed, external_data=args.external_data,
                page_size=args.page_size, weights=args.weights, head_weights=args.head_weights,
                block_size=args.block_size, weights_format=args.weights_format,
                check=not args.no_check, policy=_policy_fields(args), progress=not args.quiet))
            if args.engine == "trt":
                from engines.__main__ import main as engines_main

                max_seq = min(1024, manifest.model.max_position_embeddings)
                argv = ["build", out, "--max-seq", str(max_seq)] + (["-q"] if args.quiet else [])
                print(f"building TensorRT engines: python -m engines {' '.join(argv)}")
                return engines_main(argv)
            print(f"next: python -m export verify {out}")
            return 0
        from .verify import verify

        report = verify(args.directory, model=args.model, max_new_tokens=args.max_new_tokens,
                        speedup=args.speedup, progress=not args.quiet)
        print(f"verify {args.directory}")
        for line in report.lines:
            print("  " + line)
        print("PASSED" if report.passed else f"FAILED: {', '.join(report.failures)}")
        return 0 if report.passed else 1
    except SkipDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
