"""Command line: ``python -m runtime DIR "prompt" ... [--speedup 2] [--stream]``, and
``python -m runtime serve DIR [--port 8000] ...`` (runtime/serve/cli.py)."""

from __future__ import annotations

import argparse
import sys

from .errors import SkipDecodeError
from .generator import load


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # an artifact directory named "serve": pass it as ./serve
        from .serve.cli import main as serve

        return serve(argv[1:])
    p = argparse.ArgumentParser(prog="python -m runtime",
                                description="Generate text from an exported artifact with SkipDecode.",
                                epilog="python -m runtime serve DIR ...: an OpenAI-compatible server (see its --help)")
    p.add_argument("directory", help="artifact directory written by `python -m export build`")
    p.add_argument("prompts", nargs="+", help="one or more prompts, run as one batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--speedup", type=float, help="theoretical speedup target (default: the artifact's policy)")
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--threads", type=int, help="intra-op threads (default: ONNX Runtime's)")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stream", action="store_true", help="print the first prompt's tokens as they come")
    args = p.parse_args(argv)
    try:
        gen = load(args.directory, backend=args.backend, threads=args.threads)
        streamer = None
        if args.stream:
            def streamer(event):
                print(event.texts[0], end="", flush=True)
        result = gen.generate(args.prompts, args.max_new_tokens, speedup=args.speedup,
                              do_sample=args.do_sample, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, streamer=streamer)
    except SkipDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stream:
        print()
    for prompt, text in zip(args.prompts, result.texts):
        print(f"{prompt!r} -> {text!r}")
    s = result.stats
    print(f"policy: {result.policy}")
    print(f"layers per step: {s.layers_per_step}")
    print(f"theoretical speedup {s.theoretical_speedup:.2f}x, achieved layer ratio "
          f"{s.achieved_layer_ratio:.2f}x, prefill {s.prefill_seconds * 1e3:.1f} ms, decode "
          f"{s.decode_tokens_per_second:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
