"""``python -m tools.bench.decode``: decode ms/token of artifacts side by side, in one process.

Each artifact (``NAME=DIR``, or ``NAME=DIR:KERNEL`` to run its int4 products on ``KERNEL``:
auto, skipdecode, skipdecode-avx2 (this project's kernel built for AVX2, as on a CPU without
AVX-512) or onnxruntime, any of them with ``+deterministic``: loaded with deterministic=True,
every product at float activations) is loaded once; ``NAME=FILE.gguf:llamacpp`` (or the alias
smollm2-135m-instruct) times llama.cpp on the file, a process of tools/bench/llamacpp_worker.py per
round (its load untimed; llama.cpp's threads spin, this project's sleep unless ``--spin``),
with the python of ``--llamacpp-python`` or .bench/llamacpp-venv. Every round generates
``--tokens`` tokens of one prompt at batch 1 on each, after an untimed warm-up of 8, the artifacts
in turn and in reverse order every other round (machines are noisy: ratios of one run, never of
two). Prints a Markdown table: each round's decode ms/token (decode seconds over the tokens after
the first), the median, and the first artifact's median over this one's; then the prompt's pass (its prefill, ms: a long
``--prompt`` times what a user waits before the first token), median and ratio alike.

Example (the int4 exports of the real SmolLM2-135M-Instruct, docs/quality.md "The GGUF's own blocks"):

  python -m tools.bench.decode before=artifacts/smollm2-int4-before int4=artifacts/smollm2-int4 --rounds 5
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys

from runtime import cli
from runtime.errors import InvalidArgumentError

KERNELS = ("auto", "skipdecode", "skipdecode-avx2", "onnxruntime")
LLAMACPP = "llamacpp"  # NAME=FILE.gguf:llamacpp: llama.cpp on the file (tools/bench/llamacpp_worker.py bench)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WARMUP = 8


DETERMINISTIC = "+deterministic"


def parse_spec(spec: str) -> tuple[str, str, str]:
    """NAME=DIR[:KERNEL[+deterministic]] (or DIR alone) -> (name, directory, kernel)."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = spec, spec
    directory, colon, kernel = rest.rpartition(":") if ":" in rest else (rest, "", "auto")
    if colon and kernel.removesuffix(DETERMINISTIC) not in KERNELS and kernel != LLAMACPP:
        raise InvalidArgumentError(f"{spec}: the int4 kernel after ':' is one of {', '.join(KERNELS)} (each may end "
                                   f"in {DETERMINISTIC}), or {LLAMACPP} for a GGUF file, not {kernel!r}")
    return name, directory, kernel or "auto"


def measure(specs: list[str], tokens: int = 128, rounds: int = 5, threads: int = 2,
            prompt: str = PROMPT, llamacpp_python: str | None = None,
            spin: bool = False) -> dict[str, list[tuple[float, float]]]:
    """{name: (decode ms/token, the prompt's pass ms) of each round}; ``spin``: this project's
    ONNX Runtime threads busy-wait (as llama.cpp's do), else they sleep (runtime.load's default)."""
    import runtime

    if tokens < 2 or rounds < 1:
        raise InvalidArgumentError(f"--tokens {tokens} --rounds {rounds}: decode needs 2 tokens or more and 1 round or more")
    parsed = [parse_spec(s) for s in specs]
    gens, peers = {}, {}
    try:
        for name, directory, kernel in parsed:
            if kernel == LLAMACPP:
                peers[name] = _llamacpp_row(directory, threads, tokens, prompt, llamacpp_python)
            else:
                gens[name] = _load(runtime, directory, threads, kernel, spin)
        times = {name: [] for name, *_ in parsed}
        for r in range(rounds):
            for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
                if name in peers:
                    times[name].append(peers[name]())
                    continue
                gens[name].generate([prompt], WARMUP, ignore_eos=True)
                stats = gens[name].generate([prompt], tokens, ignore_eos=True).stats
                times[name].append((stats.decode_seconds / (stats.new_tokens - 1) * 1000, stats.prefill_seconds * 1000))
        return times
    finally:
        for gen in gens.values():
            gen.close()


def _llamacpp_row(model: str, threads: int, tokens: int, prompt: str, python: str | None):
    """A round of llama.cpp on the GGUF ``model`` (a file or an alias): a process of
    tools/bench/llamacpp_worker.py's ``bench`` (its load untimed, ``WARMUP`` tokens, then ``tokens``),
    -> (decode ms/token, the prompt's pass ms)."""
    import json

    from tools.evaluate.agreement import gguf_file, llamacpp_python, run_llamacpp

    spec = json.dumps({"prompts": [prompt], "threads": threads, "llamacpp_gguf": gguf_file(model),
                       "warmup_tokens": WARMUP, "new_tokens": tokens})
    python = llamacpp_python(python)

    def one_round() -> tuple[float, float]:
        record = json.loads(run_llamacpp(python, f"run {model}", "bench", spec).strip().splitlines()[-1])
        return record["decode_s"] / (record["generated_tokens"] - 1) * 1000, record["prefill_s"] * 1000
    return one_round


def _load(runtime, directory: str, threads: int, kernel: str, spin: bool = False):
    """The artifact loaded with its int4 products on ``kernel`` (skipdecode-avx2: the kernel built
    for AVX2, which the load builds and loads while $SKIPDECODE_KERNEL_ISA says so; +deterministic:
    every product at float activations)."""
    options = {"threads": threads, **({"deterministic": True} if kernel.endswith(DETERMINISTIC) else {}),
               **({"spin": True} if spin else {})}
    kernel = kernel.removesuffix(DETERMINISTIC)
    if kernel != "skipdecode-avx2":
        return runtime.load(directory, int4_kernel=kernel, **options)
    from runtime.platform import kernels

    before = os.environ.get(kernels.ISA_ENV)
    os.environ[kernels.ISA_ENV] = "avx2"
    try:
        return runtime.load(directory, int4_kernel="skipdecode", **options)
    finally:
        if before is None:
            del os.environ[kernels.ISA_ENV]
        else:
            os.environ[kernels.ISA_ENV] = before


def table(times: dict[str, list[tuple[float, float]]], command: str) -> str:
    medians = {name: [statistics.median(v) for v in zip(*rounds)] for name, rounds in times.items()}
    first_decode, first_prompt = next(iter(medians.values()))
    lines = [f"`{command}`", "", "| artifact | decode ms/token, each round | median | first / this | prompt's pass ms, "
             "median | first / this |", "|---|---|---|---|---|---|"]
    for name, rounds in times.items():
        decode, prompt = medians[name]
        lines.append(f"| {name} | {' / '.join(f'{d:.2f}' for d, _ in rounds)} | {decode:.2f} | {first_decode / decode:.2f}x "
                     f"| {prompt:.1f} | {first_prompt / prompt:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("python -m tools.bench.decode",
                   "Decode ms/token of artifacts side by side in one process, batch 1, rounds in turn.")
    p.add_argument("artifacts", nargs="+", metavar="NAME=DIR[:KERNEL]",
                   help="artifacts to time; KERNEL runs the int4 products on auto, skipdecode, skipdecode-avx2 or "
                        "onnxruntime, + deterministic: every product at float activations (auto+deterministic)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per timed call")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians across them")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    p.add_argument("--prompt", default=PROMPT, help="the prompt every call decodes from")
    p.add_argument("--llamacpp-python", help="for FILE.gguf:llamacpp rows: python of an environment with "
                                             "llama-cpp-python (default: .bench/llamacpp-venv's, as python -m "
                                             "tools.bench makes it)")
    p.add_argument("--spin", action="store_true", help="this project's ONNX Runtime threads busy-wait, as "
                                                       "llama.cpp's do (default: they sleep, runtime.load's default)")
    args = p.parse_args(argv)
    command = "python -m tools.bench.decode " + shlex.join(argv if argv is not None else sys.argv[1:])
    return cli.run(lambda: print(table(measure(args.artifacts, args.tokens, args.rounds, args.threads, args.prompt,
                                               args.llamacpp_python, args.spin), command)))


if __name__ == "__main__":
    sys.exit(main())
