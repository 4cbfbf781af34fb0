"""What a step's logits cost on their way to the host: a copy to pageable memory against the torch
backend's ``to_host`` (pinned memory), for the logits of a decode step, and against the greedy rows'
way, their argmax taken on the device and only the ids copied.

    python -m tools.bench.host_copy [--device cuda] [--batch 1 8] [--vocab 49152 128256] [--rounds 50] [--out FILE]

On a GPU a decode step ends with its logits (R, V) float32 copied to the host, where the engine picks
the tokens: 4 MB at batch 8 of Llama 3's 128,256-token vocabulary. ``.cpu()`` copies into pageable
memory, which the driver stages through pinned buffers of its own; ``runtime.backends.torch.to_host``
copies into a pinned block of PyTorch's caching host allocator. Rows whose logits nothing reads
(greedy, no events: ``DecodeStep.argmax``) bring back only their ids, the argmax taken on the device
(one more kernel) and 8 bytes a row copied. Each way waits for its copy. Each row's figure is the
median of ``--rounds`` copies of the same device tensor, the ways in turn; "saved" is what the
pinned copy saves a step against the pageable one, and what the ids save against the pinned logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def time_copies(device: str, batch: int, vocab: int, rounds: int) -> tuple[float, float, float]:
    """(pageable ms, pinned ms, ids ms): medians of ``rounds`` copies of one (batch, vocab) float32
    tensor, the last its argmax (batch,)."""
    import torch

    from runtime.backends.torch import to_host

    logits = torch.randn(batch, vocab, dtype=torch.float32, device=device)
    ways = {"pageable": lambda: logits.cpu().numpy(), "pinned": lambda: to_host(logits),
            "ids": lambda: to_host(logits.argmax(-1))}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds + 2):  # the first two of each: the allocators' first blocks
        for name, copy in ways.items():
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            copy()
            times[name].append(time.perf_counter() - began)
    return tuple(1e3 * statistics.median(t[2:]) for t in times.values())


def table(device: str, batches, vocabs, rounds: int) -> str:
    lines = ["| batch | vocabulary | MB | pageable ms | pinned ms | saved a step ms | ids (argmax on the device) ms | "
             "ids saved against pinned ms |", "|---|---|---|---|---|---|---|---|"]
    for vocab in vocabs:
        for batch in batches:
            pageable, pinned, ids = time_copies(device, batch, vocab, rounds)
            lines.append(f"| {batch} | {vocab} | {batch * vocab * 4 / 1e6:.2f} | {pageable:.3f} | {pinned:.3f} | "
                         f"{pageable - pinned:.3f} | {ids:.3f} | {pinned - ids:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.host_copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="where the logits are (default cuda; cpu: both ways are "
                                                     "one view, a check that the tool runs)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--out", help="also write the table to this Markdown file")
    args = p.parse_args(argv)
    if min(args.batch + args.vocab + [args.rounds]) < 1:
        p.error("--batch, --vocab and --rounds must be >= 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device visible to PyTorch: run it on a GPU, or with --device cpu")
    text = table(args.device, args.batch, args.vocab, args.rounds)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
