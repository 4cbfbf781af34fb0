"""``python -m tools.bench.decode``: decode ms/token of artifacts side by side, in one process.

Each artifact (``NAME=DIR``, or ``NAME=DIR:KERNEL`` to run its int4 products on ``KERNEL``:
auto, skipdecode, skipdecode-avx2 (this project's kernel built for AVX2, as on a CPU without
AVX-512) or onnxruntime, any of them with ``+deterministic``: loaded with deterministic=True,
every product at float activations) is loaded once; every round generates ``--tokens`` tokens of one
prompt at batch 1 on each, after an untimed warm-up of 8, the artifacts in turn and in reverse
order every other round (machines are noisy: ratios of one run, never of two). Prints a Markdown
table: each round's decode ms/token (decode seconds over the tokens after the first), the median,
and the first artifact's median over this one's; then the prompt's pass (its prefill, ms: a long
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
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WARMUP = 8


DETERMINISTIC = "+deterministic"


def parse_spec(spec: str) -> tuple[str, str, str]:
    """NAME=DIR[:KERNEL[+deterministic]] (or DIR alone) -> (name, directory, kernel)."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = spec, spec
    directory, colon, kernel = rest.rpartition(":") if ":" in rest else (rest, "", "auto")
    if colon and kernel.removesuffix(DETERMINISTIC) not in KERNELS:
        raise InvalidArgumentError(f"{spec}: the int4 kernel after ':' is one of {', '.join(KERNELS)} (each may end "
                                   f"in {DETERMINISTIC}), not {kernel!r}")
    return name, directory, kernel or "auto"


def measure(specs: list[str], tokens: int = 128, rounds: int = 5, threads: int = 2,
            prompt: str = PROMPT) -> dict[str, list[tuple[float, float]]]:
    """{name: (decode ms/token, the prompt's pass ms) of each round}."""
    import runtime

    if tokens < 2 or rounds < 1:
        raise InvalidArgumentError(f"--tokens {tokens} --rounds {rounds}: decode needs 2 tokens or more and 1 round or more")
    parsed = [parse_spec(s) for s in specs]
    gens = {}
    try:
        for name, directory, kernel in parsed:
            gens[name] = _load(runtime, directory, threads, kernel)
        times = {name: [] for name in gens}
        for r in range(rounds):
            for name in (list(gens) if r % 2 == 0 else list(gens)[::-1]):
                gens[name].generate([prompt], WARMUP, ignore_eos=True)
                stats = gens[name].generate([prompt], tokens, ignore_eos=True).stats
                times[name].append((stats.decode_seconds / (stats.new_tokens - 1) * 1000, stats.prefill_seconds * 1000))
        return times
    finally:
        for gen in gens.values():
            gen.close()


def _load(runtime, directory: str, threads: int, kernel: str):
    """The artifact loaded with its int4 products on ``kernel`` (skipdecode-avx2: the kernel built
    for AVX2, which the load builds and loads while $SKIPDECODE_KERNEL_ISA says so; +deterministic:
    every product at float activations)."""
    options = {"threads": threads, **({"deterministic": True} if kernel.endswith(DETERMINISTIC) else {})}
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
    args = p.parse_args(argv)
    command = "python -m tools.bench.decode " + shlex.join(argv if argv is not None else sys.argv[1:])
    return cli.run(lambda: print(table(measure(args.artifacts, args.tokens, args.rounds, args.threads, args.prompt),
                                       command)))


if __name__ == "__main__":
    sys.exit(main())
