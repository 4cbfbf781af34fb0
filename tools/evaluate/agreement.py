"""``python -m tools.evaluate.agreement``: how closely an artifact's next-token predictions follow a
reference artifact's (a quantized export against the float export of the same model).

Prompts are windows of a held text (``--prompts`` of them, 3 to 24 words each at seeded offsets);
each artifact's first-token logits at full depth are compared: top-1 agreement (the share of
prompts whose greedy next token is the same) and the mean KL divergence KL(reference || model) of
the next-token distributions. Prints one Markdown table.

Example (the int4 export of the real SmolLM2-135M-Instruct against its float32 export):

  python -m tools.evaluate.agreement --reference artifacts/smollm2-135m-instruct \\
      --model int4=artifacts/smollm2-int4 --text data/prose/essays.txt --prompts 200

``--backend torch --device cuda`` loads the compared artifacts on the torch backend there (the
reference stays on ONNX Runtime): the GPU's int4 kernel against the CPU's on the same artifact
(tools/gpu_session.sh):

  python -m tools.evaluate.agreement --reference D --model cuda=D --backend torch --device cuda \
      --text data/e2e/devset.csv.gz --column mr --prompts 100

(``--torch-int4-kernel tinygemm``: the torch backend's int4 products on PyTorch's own int4 product.)

``--llamacpp NAME=FILE.gguf`` (or a GGUF alias: smollm2-135m-instruct) adds llama.cpp as a row: its
logits on the same token ids (the reference's tokenizer), computed by tools/bench/llamacpp_worker.py
with the python of a venv that has llama-cpp-python (``--llamacpp-python``; by default
.bench/llamacpp-venv, which ``python -m tools.bench`` creates; never created here: it compiles
llama.cpp, ~25 minutes).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import numpy as np

from runtime import cli
from runtime.errors import SkipDecodeError


class AgreementError(SkipDecodeError):
    """A text too short for the prompts asked, or artifacts of different vocabularies."""


@dataclass(frozen=True)
class Row:
    name: str
    top1: float  # share of prompts whose argmax equals the reference's
    mean_kl: float  # mean KL(reference || model) in nats


def prompts_of(text: str, count: int, seed: int = 0, shortest: int = 3, longest: int = 24) -> list[str]:
    """``count`` windows of ``text``'s words, each ``shortest``..``longest`` words from a seeded offset."""
    words = text.split()
    if len(words) < longest + 1:
        raise AgreementError(f"the text has {len(words)} words; windows of up to {longest} need more")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        start = rng.randrange(len(words) - n)
        out.append(" ".join(words[start:start + n]))
    return out


def next_logits(gen, prompts: list[str], batch: int = 8) -> np.ndarray:
    """(P, V) float64: each prompt's first generated token's logits at full depth."""
    rows = []
    for s in range(0, len(prompts), batch):
        part = prompts[s:s + batch]
        found = {}
        for event in gen.stream(part, 1, ignore_eos=True):
            found.update({b: event.logits[b] for b, t in enumerate(event.token_ids) if t is not None})
        rows += [np.asarray(found[b], np.float64) for b in range(len(part))]
    return np.stack(rows)


def compare(name: str, reference: np.ndarray, logits: np.ndarray) -> Row:
    if reference.shape != logits.shape:
        raise AgreementError(f"{name}'s logits are {logits.shape[1]} wide, the reference's {reference.shape[1]}: "
                             f"compare exports of the same model")
    log_p = reference - np.logaddexp.reduce(reference, axis=-1, keepdims=True)  # (P, V)
    log_q = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)  # (P,)
    top1 = float((reference.argmax(-1) == logits.argmax(-1)).mean())
    return Row(name, top1, float(kl.mean()))


def table(rows: list[Row], count: int) -> str:
    lines = [f"| model | top-1 agreement ({count} prompts) | mean KL (nats) |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.top1:.3f} | {r.mean_kl:.4f} |" for r in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.evaluate.agreement",
                   "Top-1 agreement and mean KL of artifacts' next-token predictions against a reference "
                   "artifact's (a quantized export against the float one), on windows of a held text.")
    p.add_argument("--reference", required=True, help="the artifact to agree with (e.g. the float32 export)")
    p.add_argument("--model", nargs="+", default=[], metavar="[NAME=]DIR", help="artifacts to compare")
    p.add_argument("--text", required=True, help="a .txt file, or a .csv/.jsonl (.gz) with --column")
    p.add_argument("--column", help="the column of a .csv/.jsonl --text whose unique values make the text")
    p.add_argument("--prompts", type=int, default=200, help="windows of the text to compare on")
    p.add_argument("--seed", type=int, default=0, help="the windows' offsets and lengths")
    p.add_argument("--threads", type=int, help="ONNX Runtime's intra-op threads")
    p.add_argument("--int4-kernel", choices=("auto", "skipdecode", "onnxruntime"), default="auto",
                   help="the int4 kernel of the compared artifacts (auto: this project's where it runs)")
    p.add_argument("--deterministic", action="store_true",
                   help="ONNX Runtime's loads (the reference's too) with every int4/int8 product at float "
                        "activations (with --int4-kernel onnxruntime: float32, what the torch backend computes)")
    p.add_argument("--backend", choices=("onnxruntime", "torch"), default="onnxruntime",
                   help="the compared artifacts' backend (the reference's is ONNX Runtime's)")
    p.add_argument("--device", help="the torch backend's device (cpu or cuda; default cpu)")
    p.add_argument("--torch-int4-kernel", choices=("auto", "tinygemm"), default="auto",
                   help="the torch backend's int4 kernel: auto (Triton on a GPU) or tinygemm (PyTorch's own "
                        "int4 product); with --backend torch")
    p.add_argument("--llamacpp", nargs="+", default=[], metavar="[NAME=]FILE.gguf",
                   help="GGUF files whose llama.cpp logits are compared too (llama-cpp-python: --llamacpp-python)")
    p.add_argument("--llamacpp-python", help=f"python of an environment with llama-cpp-python (default: "
                                             f"{LLAMACPP_VENV}/bin/python, as python -m tools.bench creates it)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    import runtime
    from tools.finetune.data import read_text

    if args.prompts < 1:
        raise AgreementError(f"--prompts {args.prompts}: give a positive number of windows")
    if not args.model and not args.llamacpp:
        raise AgreementError("nothing to compare: give --model DIR (an artifact) or --llamacpp FILE.gguf")
    if args.device and args.backend != "torch":
        raise AgreementError("--device applies to --backend torch (ONNX Runtime runs on this CPU here)")
    if args.torch_int4_kernel != "auto" and args.backend != "torch":
        raise AgreementError("--torch-int4-kernel applies to --backend torch (--int4-kernel is ONNX Runtime's)")
    prompts = prompts_of(read_text(args.text, args.column), args.prompts, args.seed)
    options = {"threads": args.threads} if args.threads else {}
    ort = dict(int4_kernel=args.int4_kernel, deterministic=args.deterministic)
    compared = (dict(backend="torch", int4_kernel=args.torch_int4_kernel, **({"device": args.device} if args.device
                                                                              else {}))
                if args.backend == "torch" else ort)

    def logits_of(directory: str, **extra):  # (its logits (P, V), its tokenizer)
        gen = runtime.load(directory, **options, **extra)
        try:
            return next_logits(gen, prompts), gen.tokenizer
        finally:
            gen.close()

    reference, tokenizer = logits_of(args.reference, **ort)
    ids = [[int(i) for i in tokenizer(p)["input_ids"]] for p in prompts]  # what llama.cpp is given
    python = llamacpp_python(args.llamacpp_python) if args.llamacpp else None
    found = [(spec, logits_of(spec.rpartition("=")[2], **compared)[0]) for spec in args.model]
    found += [(spec, llamacpp_logits(python, gguf_file(spec.rpartition("=")[2]), ids, args.threads or 2))
              for spec in args.llamacpp]
    rows = []
    for spec, logits in found:
        name, _, path = spec.rpartition("=")
        rows.append(compare(name or path, reference, logits))
        print(f"{rows[-1].name}: top-1 {rows[-1].top1:.3f}, mean KL {rows[-1].mean_kl:.4f}", file=sys.stderr)
    print(table(rows, len(prompts)))
    return 0


LLAMACPP_VENV = ".bench/llamacpp-venv"


def llamacpp_python(python: str | None) -> str:
    """The python that runs llama.cpp's worker: ``python``, else the venv python -m tools.bench makes;
    AgreementError (with how to make one) where neither imports llama_cpp."""
    from pathlib import Path

    from tools.bench import venv

    env = venv.ensure(Path(LLAMACPP_VENV), python, create=False, peer=venv.LLAMACPP)
    if not env.available:
        raise AgreementError(f"--llamacpp needs llama-cpp-python: {env.reason}; pass --llamacpp-python PY, or "
                             f"make {LLAMACPP_VENV} (python -m venv --system-site-packages {LLAMACPP_VENV} && "
                             f"{LLAMACPP_VENV}/bin/pip install llama-cpp-python: it compiles llama.cpp, ~25 min)")
    return env.python


def gguf_file(model: str) -> str:
    """A GGUF file's path, or the file an alias names (smollm2-135m-instruct: the installed one)."""
    from export import checkpoint

    source = checkpoint.resolve(model)
    if source.kind != "gguf":
        raise AgreementError(f"--llamacpp {model}: llama.cpp reads GGUF files, and this is {source.describe()}")
    return str(source.location)


def run_llamacpp(python: str, what: str, *args: str) -> str:
    """tools/bench/llamacpp_worker.py ``args`` run by ``python``: its stdout, or AgreementError
    ("llama.cpp could not ``what``: " and its last line)."""
    import subprocess

    from tools.bench.runner import LLAMACPP_WORKER
    from tools.bench.venv import last_line

    done = subprocess.run([python, str(LLAMACPP_WORKER), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AgreementError(f"llama.cpp could not {what}: {last_line(done.stderr or done.stdout)}")
    return done.stdout


def llamacpp_logits(python: str, gguf: str, ids: list[list[int]], threads: int) -> np.ndarray:
    """(P, V) llama.cpp's next-token logits of ``gguf`` after each prompt's ``ids``
    (tools/bench/llamacpp_worker.py logits, run by ``python``)."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(ids))
        run_llamacpp(python, f"score {gguf}", "logits", gguf, str(Path(tmp) / "ids.json"),
                     str(Path(tmp) / "logits.npy"), "--threads", str(threads))
        return np.load(Path(tmp) / "logits.npy").astype(np.float64)


if __name__ == "__main__":
    sys.exit(main())
