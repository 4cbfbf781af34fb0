"""``python -m tools.bench.staggered``: requests arriving a few milliseconds apart, together against
one after another, on one Generator.

    python -m tools.bench.staggered --artifact artifacts/opt-e2e-skipdecode [--rounds 5]

Eight requests (the shipped E2E meaning representations as prompts, ``--new-tokens`` tokens each,
EOS ignored) are started ``--stagger-ms`` apart from their own threads, and the same eight run one
after another; with ``--speedups`` one per request (cycled; default mixed 1, 2, 3, 5), or all at
full depth (``--speedups 1``). Printed: the best of ``--rounds`` (the machine's noise only ever
slows a round) for each, and their ratio: how much continuous batching gains over running alone;
beside it the decode steps' layer calls each way (a layer counts once a step, for all the rows that
run it) and their ratio, the gain's bound where a call's rows cost nothing: a step runs the union of
its rows' layers, so rows at other speedups share fewer calls than rows at full depth.
``--load-option KEY=VALUE`` forwards a ``runtime.load`` keyword (e.g. ``prefill_chunk=null``). To
compare two revisions, run it from each (``PYTHONPATH=CHECKOUT``) on the same artifact.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from runtime import cli
from runtime.errors import SkipDecodeError

from .checkouts import parse_options

PROMPTS = ("name[The Eagle], eatType[coffee shop], food[French], area[riverside]",
           "name[Loch Fyne], food[Japanese], priceRange[cheap], near[The Rice Boat]",
           "name[Alimentum], eatType[restaurant], area[city centre], familyFriendly[yes]",
           "name[The Mill], eatType[pub], food[Italian]")


@dataclass
class Result:
    sequential_s: float  # best round, one request after another
    together_s: float  # best round, started stagger apart from their own threads
    sequential_calls: int = 0  # the decode steps' layer calls, one after another
    together_calls: int = 0  # and together (in the best round: arrivals move the unions a little)

    @property
    def ratio(self) -> float:
        return self.sequential_s / self.together_s


def measure(generator, requests: list[tuple[str, int, float]], stagger_s: float, rounds: int) -> Result:
    def one(prompt, new_tokens, speedup):
        generator.generate(prompt, new_tokens, speedup=speedup, ignore_eos=True)

    for r in requests[:2]:  # warm up both prompt lengths' graphs
        one(*r)
    best = Result(float("inf"), float("inf"))
    with _counting(generator.engine.runner.backend) as calls:
        for _ in range(rounds):  # interleaved, so that the machine's state weighs on both alike
            calls[0], began = 0, time.perf_counter()
            for r in requests:
                one(*r)
            seconds = time.perf_counter() - began
            if seconds < best.sequential_s:
                best.sequential_s, best.sequential_calls = seconds, calls[0]
            threads = [threading.Thread(target=one, args=r) for r in requests]
            calls[0], began = 0, time.perf_counter()
            for t in threads:
                t.start()
                time.sleep(stagger_s)
            for t in threads:
                t.join()
            seconds = time.perf_counter() - began
            if seconds < best.together_s:
                best.together_s, best.together_calls = seconds, calls[0]
    return best


@contextlib.contextmanager
def _counting(backend):
    """The layer calls of ``backend``'s decode steps, counted in the yielded list's one item: a layer
    of a step counts when any row runs it (runtime.backends.base.DecodeStep.updates)."""
    calls, decode = [0], backend.decode

    def counted(step, cache):
        calls[0] += int(np.asarray(step.updates, dtype=bool).any(axis=1).sum())
        return decode(step, cache)

    backend.decode = counted
    try:
        yield calls
    finally:
        del backend.decode


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.bench.staggered", __doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--artifact", required=True, help="an exported artifact (e.g. the demo model's)")
    p.add_argument("--requests", type=int, default=8, help="requests, as many as --max-batch rows (default 8)")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[16, 48, 32, 64, 24, 40, 56, 20],
                   help="tokens per request, cycled (default 16 48 32 64 24 40 56 20)")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 2, 3, 5, 2, 1, 3, 5],
                   help="speedup per request, cycled (default mixed: 1 2 3 5 2 1 3 5; 1: full depth)")
    p.add_argument("--stagger-ms", type=float, default=4.0, help="between two starts (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the best of each is kept (default 5)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads (default 1)")
    p.add_argument("--load-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a runtime.load keyword, the value as JSON where it parses (prefill_chunk=null)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import runtime

    requests = [(PROMPTS[k % len(PROMPTS)], args.new_tokens[k % len(args.new_tokens)],
                 args.speedups[k % len(args.speedups)]) for k in range(args.requests)]
    try:
        options = parse_options(args.load_option)
    except ValueError as exc:
        raise SkipDecodeError(f"--load-option: {exc}") from None
    with runtime.load(args.artifact, max_batch=args.requests, threads=args.threads, **options) as gen:
        result = measure(gen, requests, args.stagger_ms / 1e3, args.rounds)
    speedups = ", ".join(f"{s:g}x" for s in sorted({s for *_, s in requests}))
    print(f"{args.requests} requests, speedups {speedups}, started {args.stagger_ms:g} ms "
          f"apart, best of {args.rounds} rounds{', ' + str(options) if options else ''}")
    print("| one after another ms | together ms | gain (one after another / together) "
          "| decode layer calls: one after another / together (bound) |")
    print("|---|---|---|---|")
    bound = result.sequential_calls / max(result.together_calls, 1)
    print(f"| {result.sequential_s * 1e3:.0f} | {result.together_s * 1e3:.0f} | {result.ratio:.2f}x "
          f"| {result.sequential_calls} / {result.together_calls} ({bound:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
