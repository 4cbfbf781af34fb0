"""Command line: ``python -m runtime DIR "prompt" ... [--speedup 2] [--stream] [--json]``, and
``python -m runtime serve DIR [--port 8000] ...`` (an OpenAI-compatible server: runtime/serve/cli.py).

It mirrors ``runtime.load`` + ``Generator.generate``: every option is the API argument of the same
name. User errors (bad arguments, a broken artifact) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import cli
from .backends import BACKENDS
from .errors import InvalidArgumentError
from .generation_config import GenerationConfig
from .generator import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, load
from .policy import DECAYS, PREFILLS

SAMPLING = ("temperature", "top_k", "top_p")  # the options that only apply with --do-sample
MAX_NEW_TOKENS, CHAT_MAX_NEW_TOKENS = 32, 256  # a chat's answers run to EOS: a paragraph fits


def _parser():
    p = cli.parser("python -m runtime", "Generate text from an exported artifact with SkipDecode.",
                   epilog="python -m runtime serve DIR ...: an OpenAI-compatible server (see its --help)")
    p.add_argument("directory", help="artifact directory written by `python -m export build`")
    p.add_argument("prompts", nargs="*", help="one or more prompts, run as one batch (none, with --chat: "
                                              "an interactive chat)")
    chat = p.add_argument_group("chat (an instruct model: each prompt becomes a user turn)")
    chat.add_argument("--chat", action="store_true",
                      help="render each prompt as one user message through the model's chat template "
                           "(as the server's /v1/chat/completions and transformers' apply_chat_template)")
    chat.add_argument("--system", metavar="TEXT", help="a system message before each user turn (with --chat)")
    cli.add_max_new_tokens(p, None, f"tokens to generate per prompt: {MAX_NEW_TOKENS} unless given, an interactive "
                                    f"chat's answers {CHAT_MAX_NEW_TOKENS}",
                           aliases=("--new-tokens", "--max-new", "--max-tokens"))
    pol = p.add_argument_group("skip policy (default: the artifact's, full depth unless set at export)")
    pol.add_argument("--speedup", type=float,
                     help="horizon speedup target (layers / mean budget over the policy's horizon); "
                          "picks min/max layers")
    pol.add_argument("--max-layers", type=int, help="layer budget of the first generated token")
    pol.add_argument("--min-layers", type=int, help="budget once the decay reaches the horizon")
    pol.add_argument("--warmup-layers", type=int, help="bottom layers every step runs (default: the artifact's)")
    pol.add_argument("--decay", choices=DECAYS,
                     help="budget curve over the horizon (default: the artifact's, else linear)")
    pol.add_argument("--exponent", type=float,
                     help="power decay: budget = min + (max - min) * (1 - t) ** exponent (default 2)")
    pol.add_argument("--prefill", choices=PREFILLS,
                     help="the prompt's layers: full depth, or the first step's active set (default: full)")
    pol.add_argument("--lossless", action="store_true",
                     help="the policy's layers only draft tokens; a full-depth pass verifies them, so the "
                          "output is full depth's, token for token (self-speculative decoding)")
    pol.add_argument("--deep-copies", action=argparse.BooleanOptionalAction,
                     help="tokens that copy a rare string of the prompt (a name) run deeper; default: the "
                          "artifact's (on where its manifest names deep_copies)")
    be = p.add_argument_group("backend")
    be.add_argument("--backend", default="onnxruntime", choices=BACKENDS, help="what runs the graphs")
    be.add_argument("--device", help="cpu, cuda or cuda:N (onnxruntime: cuda keeps the KV cache and "
                                     "hidden states on the GPU through IOBinding); default: the "
                                     "backend's (onnxruntime: cuda where onnxruntime-gpu offers it)")
    be.add_argument("--threads", type=int, help="intra-op threads (default: the backend's)")
    cli.add_spin(be)
    cli.add_huge_pages(be)
    cli.add_fused(be)
    cli.add_compile_steps(be)
    cli.add_int4_kernel(be)
    be.add_argument("--max-batch", type=int,
                    help="rows decoded together (default: the number of prompts, at most 8); more "
                         "prompts than rows run as rows free up")
    cli.add_prefill_chunk(be, DEFAULT_PREFILL_CHUNK)
    cli.add_batch_invariant(be)
    be.add_argument("--engine-dir", help="TensorRT engines (tensorrt backend; default: DIR/engines)")
    be.add_argument("--no-check-hashes", action="store_true",
                    help="skip the sha256 of files changed since they were last verified (sizes are still checked)")
    d = GenerationConfig()  # the defaults, from their one place
    s = p.add_argument_group("sampling (greedy unless --do-sample; the other options apply only with it)")
    s.add_argument("--do-sample", action="store_true", help="sample each token instead of taking the most likely")
    # None in the parser: a value the user gave is told apart from the default (a warning without --do-sample)
    s.add_argument("--temperature", type=float, help=f"divides the logits; < 1 sharpens (default: {d.temperature:g})")
    s.add_argument("--top-k", type=int, help=f"keep the k most likely tokens; 0 disables it (default: {d.top_k})")
    s.add_argument("--top-p", type=float, help=f"keep the smallest set of tokens whose probability reaches p; "
                                               f"1 disables it (default: {d.top_p:g})")
    s.add_argument("--seed", type=int, help="seed of the sampling RNG (default: drawn from the OS)")
    e = p.add_argument_group("when a row ends")
    e.add_argument("--stop", action="append", metavar="TEXT", help="stop string, kept in the output; repeatable")
    e.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens tokens even after EOS")
    e.add_argument("--json-schema", metavar="SCHEMA",
                   help="the text must be JSON matching this JSON schema: inline JSON, or a file holding it; "
                        "'{\"type\": \"object\"}' for any JSON object (needs llguidance: the [json] extra)")
    out = p.add_argument_group("output (stdout: the texts; stderr: the policy and the run's figures)")
    mode = out.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true",
                      help="print the text as it comes (one prompt, as transformers' TextStreamer)")
    mode.add_argument("--json", action="store_true",
                      help="one JSON object per prompt and line: prompt, text, token_ids, stats, policy")
    out.add_argument("--compare", action="store_true",
                     help="also run the prompts at full depth first (after a short warm-up) and print the run "
                          "speedup: the wall-clock ratio of decode ms/token and of the whole call")
    return p


def _sampling(args) -> dict:
    """The sampling options, defaults filled in; those given without --do-sample are warned about
    (they change nothing then), as transformers' generate does."""
    given = {name: getattr(args, name) for name in SAMPLING if getattr(args, name) is not None}
    if given and not args.do_sample:
        flags = ", ".join(f"--{name.replace('_', '-')} {value:g}" for name, value in given.items())
        print(f"warning: {flags} only apply with --do-sample; decoding greedily (pass --do-sample, "
              f"or leave them out)", file=sys.stderr)
    return {"do_sample": args.do_sample, "seed": args.seed, **given}


def _chat_prompts(gen, prompts: list[str], system: str | None) -> list[str]:
    """Each prompt as one user turn (after ``system``), rendered by the artifact's chat template
    with the assistant's turn opened, as the server renders ``messages``."""
    template = _chat_template(gen)
    head = [{"role": "system", "content": system}] if system is not None else []
    return [template.render(head + [{"role": "user", "content": p}]) for p in prompts]


def _chat_template(gen):
    """The artifact's chat template, or an error that says why there is none."""
    try:
        from .serve.chat import ChatTemplate

        template = ChatTemplate.from_dir(Path(gen.directory) / gen.manifest.tokenizer_dir)
    except ImportError as exc:
        raise InvalidArgumentError(f"--chat renders the chat template with jinja2, which is not installed "
                                   f"({exc}); pip install 'skipdecode-edge[serve]'") from None
    if template is None:
        raise InvalidArgumentError("--chat needs a chat template, and this artifact's tokenizer has none (its "
                                   "checkpoint is not a chat model); leave out --chat")
    return template


def _print_text(event) -> None:
    print(event.texts[0], end="", flush=True)  # the one prompt's new text, as it comes


def _run(args) -> int:
    policy = cli.policy_fields(args.speedup, args.max_layers, args.min_layers, args.warmup_layers)
    speedup = None
    if args.speedup is not None and args.warmup_layers is None:  # the route a server request's speedup takes
        speedup, policy = args.speedup, None
    if not args.prompts and not args.chat:
        raise InvalidArgumentError("give one or more prompts, or --chat alone for an interactive chat")
    if not args.prompts and (args.json or args.compare):
        raise InvalidArgumentError(f"--{'json' if args.json else 'compare'} needs prompts; an interactive chat "
                                   f"(--chat without prompts) streams its answers")
    if args.stream and len(args.prompts) > 1:
        raise InvalidArgumentError(f"--stream prints one prompt's text as it comes, got {len(args.prompts)} "
                                   f"prompts; pass one, or leave out --stream (or use --json) for several")
    if args.system is not None and not args.chat:
        raise InvalidArgumentError("--system goes with --chat (a system message of a chat); add --chat")
    sampling = _sampling(args)
    # None: the prompts' number; 0 or less goes to load, which refuses it as the API does
    max_batch = min(max(len(args.prompts), 1), DEFAULT_MAX_BATCH) if args.max_batch is None else args.max_batch
    gen = load(args.directory, backend=args.backend, check_hashes=not args.no_check_hashes,
               max_batch=max_batch, prefill_chunk=args.prefill_chunk, batch_invariant=args.batch_invariant,
               **cli.backend_options(args))
    try:
        limit = args.max_new_tokens
        if limit is None:  # a chat's history needs room beside its answers
            limit = MAX_NEW_TOKENS if args.prompts else min(CHAT_MAX_NEW_TOKENS, gen.max_length // 2)
        config = GenerationConfig(limit, policy=policy, speedup=speedup, decay=args.decay,
                                  exponent=args.exponent, prefill=args.prefill, lossless=args.lossless, ignore_eos=args.ignore_eos,
                                  deep_copies=args.deep_copies,
                                  stop_strings=args.stop, json_schema=_json_schema(args.json_schema), **sampling)
        if not args.prompts:  # --chat alone
            from .chat_session import ChatSession, run

            return run(ChatSession(gen, _chat_template(gen), config, args.system))
        texts = _chat_prompts(gen, args.prompts, args.system) if args.chat else args.prompts
        full = _full_depth(gen, texts, config) if args.compare else None
        result = gen.generate(texts, config=config, streamer=_print_text if args.stream else None, logits=False)
    finally:
        gen.close()
    if args.json:
        _print_json(args.prompts, result, gen.manifest.weights_label)
        return 0
    if args.stream:
        print()  # the text itself came as it was generated
    else:
        for prompt, text in zip(args.prompts, result.texts):
            print(f"{prompt!r} -> {text!r}")
    s = result.stats
    # The figures go to stderr: stdout holds the texts alone (`| head -1`, a file, another tool)
    kernel, note = getattr(gen.backend, "int4_kernel", None), getattr(gen.backend, "int4_kernel_note", "")
    bits = "int4" if "int4" in gen.manifest.weights.values() else "int8"
    print(f"weights: {gen.manifest.weights_label}" + (f"; {bits} products on {_kernel_label(kernel)}" if kernel else "")
          + (f" ({note})" if kernel and note else ""), file=sys.stderr)
    if isinstance(getattr(gen.backend, "spin", None), bool):  # onnxruntime: what its workers do
        print(f"workers: {_workers(gen.backend.spin, args.spin)}", file=sys.stderr)
    if getattr(gen.backend, "fused_note", None):  # the artifact's fused layer graphs could not run here
        print(f"layers: the plain graphs, not the fused ones ({gen.backend.fused_note})", file=sys.stderr)
    if args.huge_pages:
        print(f"huge pages: {gen.backend.huge_page_bytes / 2**20:.0f} MiB of packed weights on 2 MiB pages "
              f"(--huge-pages; 0 where Linux's transparent huge pages or MADV_COLLAPSE are unavailable)",
              file=sys.stderr)
    print(f"policy: {result.policy}", file=sys.stderr)
    print(f"layers per step: {s.layers_per_step}", file=sys.stderr)
    print(f"layers: {s.layer_reduction:.2f}x fewer than full depth by the budget over the {len(s.steps)} steps "
          f"decoded (the horizon's figure spans the policy's {result.policy.horizon}), {s.achieved_layer_ratio:.2f}x "
          f"fewer run; a count of layers, not of time", file=sys.stderr)
    print(f"time: {_times(s)}", file=sys.stderr)
    if full is not None:
        print(_run_speedup(full.stats, s), file=sys.stderr)
    if s.deep_steps:
        print(f"deep copies: {s.deep_steps} tokens ran deep, {s.filled_positions} K/V positions written "
              f"for them", file=sys.stderr)
    if s.verify_passes:
        print(f"lossless: {s.accepted_tokens} of {s.drafted_tokens} drafts kept "
              f"({(s.acceptance_rate or 0) * 100:.0f}%), {s.tokens_per_verify:.2f} tokens per verify pass "
              f"and row, {s.verify_passes} passes", file=sys.stderr)
    return 0


def _times(s) -> str:
    """What the call waited: the prompt pass, the first token, each token after it, the whole call."""
    per_request = 1e3 / s.decode_ms_per_token if s.decode_ms_per_token else 0.0
    batch = (f"; the batch of {s.batch_size}: {s.decode_tokens_per_second:.1f} tokens/s in all"
             if s.batch_size > 1 else "")
    return (f"prompt {s.prefill_seconds * 1e3:.1f} ms, first token after {s.first_token_seconds * 1e3:.1f} ms, "
            f"decode {s.decode_ms_per_token:.2f} ms/token ({per_request:.1f} tokens/s per request{batch}), "
            f"{s.seconds * 1e3:.1f} ms end to end")


def _full_depth(gen, texts: list[str], config: GenerationConfig):
    """--compare: the same call at full depth, after a short untimed warm-up (the first call pays
    for cold caches and allocations)."""
    from dataclasses import replace

    full = replace(config, policy=None, speedup=1.0, lossless=False)
    gen.generate(texts, config=replace(full, max_new_tokens=min(config.max_new_tokens, 4)))
    return gen.generate(texts, config=full)


def _run_speedup(full, s) -> str:
    """The wall-clock ratio of this run against full depth, one after the other in this process."""
    ratio = full.decode_ms_per_token / s.decode_ms_per_token if s.decode_ms_per_token else float("nan")
    return (f"run speedup {ratio:.2f}x decode ({full.decode_ms_per_token:.2f} -> {s.decode_ms_per_token:.2f} "
            f"ms/token), {full.seconds / s.seconds:.2f}x end to end ({full.seconds * 1e3:.1f} -> {s.seconds * 1e3:.1f} "
            f"ms, {full.new_tokens} -> {s.new_tokens} tokens): wall clock against full depth, one run each "
            f"in this process (--compare)")


def _workers(spinning: bool, asked) -> str:
    """What the ONNX Runtime backend's worker threads do while they wait, and why."""
    if asked != "auto":
        return "spinning (--spin)" if spinning else "sleeping (--no-spin)"
    if spinning:
        return "spinning (no other process used the cores at start; --no-spin to sleep)"
    return "sleeping (other processes used the cores at start, or /proc/stat could not tell; --spin to spin anyway)"


def _json_schema(value: str | None):
    """--json-schema: inline JSON, else the path of a file holding it."""
    if value is None or value.lstrip().startswith("{"):
        return value  # the runtime parses it and says what is wrong
    path = Path(value)
    if not path.is_file():
        raise InvalidArgumentError(f"--json-schema {value!r} is neither a JSON object nor a file; pass the schema "
                                   f"inline ('{{\"type\": \"object\"}}') or the path of a .json file")
    return path.read_text(encoding="utf-8")


def _print_json(prompts, result, weights: str) -> None:
    """One object per prompt; the stats and policy are the batch's, repeated on every line so that
    each line stands alone (``jq`` over the output needs no context)."""
    from dataclasses import asdict

    for prompt, text, ids in zip(prompts, result.texts, result.token_ids):
        print(json.dumps({"prompt": prompt, "text": text, "token_ids": [int(i) for i in ids],
                          "stats": result.stats.to_dict(), "policy": asdict(result.policy),
                          "weights": weights}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # an artifact directory named "serve": pass it as ./serve
        from .serve.cli import main as serve

        return serve(argv[1:])
    # intermixed: the prompts may follow options (DIR --chat "a" "b"), which a "*" positional
    # would otherwise have taken as empty at the first option
    args = _parser().parse_intermixed_args(argv)
    return cli.run(lambda: _run(args))


def _kernel_label(kernel: str) -> str:
    """Which kernel ran an artifact's int4/int8 products, as the time line names it."""
    if kernel == "onnxruntime":
        return "ONNX Runtime's MatMulNBits"
    if kernel == "tinygemm":
        return "PyTorch's int4 product (tinygemm)"
    from .platform import kernels

    return f"{kernels.label()} of runtime/platform/kernels"


if __name__ == "__main__":
    sys.exit(main())

