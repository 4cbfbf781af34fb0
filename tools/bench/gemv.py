"""The kernel ceiling at batch 1: how fast each CPU kernel reads an artifact's weight matrices.

    python -m tools.bench.gemv ARTIFACT [--threads 2] [--rounds 30] [--repeats 2] [--spin]

At batch 1 every weight of a decode step is a matrix-vector product (GEMV): one read of the
matrix, two flops per weight, so it can go no faster than the memory's read bandwidth. This times
each distinct weight shape of the artifact (from its first layer and its head graph, float
weights only) with:

- ``ort``: ONNX Runtime ``MatMul`` on the (in, out) weight, an initializer that MLAS pre-packs at
  session start: what the export's layers run, with the backend's own session options;
- ``ort-noprepack``: the same with ``session.disable_prepacking`` (MLAS's M=1 kernel on the
  weight as stored);
- ``ort-gemm``: ``Gemm(transB=1)`` on the (out, in) weight: what the export's tied head runs;
- ``numpy``: ``x @ W`` on the (in, out) weight, numpy's BLAS (OpenBLAS in numpy's wheels) at its
  own thread count (``OPENBLAS_NUM_THREADS``; every core unless set);
- ``torch``: ``torch.nn.functional.linear`` on the (out, in) weight, transformers' path, and
  ``torch-matmul``: ``x @ W`` on the (in, out) weight (both skipped where torch is not installed).

Each shape gets enough distinct random copies that together they exceed ``--evict-mib`` (more
than the last-level cache); a round multiplies by every copy once, back to back, as a step
multiplies by each layer's weights once (ONNX Runtime's kernels as the nodes of one session, so
one ``session.run`` a round, as a layer's products share one). Each kernel runs in a process of
its own, as each library's threads spin on after a call and would slow the next library's; the
kernels' processes take turns ``--repeats`` times, so a shared machine's load falls on all alike.
Every kernel's output is checked against numpy's first. Reported: the median GB/s of each
kernel and shape, and what a whole step's weight products (every layer and the head) would take
at those rates, against the floor (their bytes over the higher of two ``tools.bench.bandwidth``
probes, before and after). The graphs' other nodes and the attention are not in it:
``tools.bench.graphs`` times those.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime import cli
from runtime.errors import InvalidArgumentError

KERNELS = ("ort", "ort-noprepack", "ort-gemm", "numpy", "torch", "torch-matmul")


@dataclass(frozen=True)
class Shape:
    rows: int  # in features: the length of the vector
    cols: int  # out features
    per_step: int  # how many products of this shape a full-depth step runs

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * 4  # float32: what ONNX Runtime's CPU kernels compute in


@dataclass
class Measured:
    shape: Shape
    copies: int
    seconds: dict = field(default_factory=dict)  # kernel -> seconds per round (all copies)

    def gbps(self, kernel: str) -> float:
        return self.copies * self.shape.bytes / statistics.median(self.seconds[kernel]) / 1e9


def weight_shapes(graph: Path) -> list[tuple[int, int]]:
    """(in, out) of every float weight a graph's MatMul/Gemm nodes multiply by."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    shapes = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        t = inits[node.input[1]]
        if len(t.dims) != 2 or t.data_type not in floats:
            continue
        rows, cols = t.dims
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        shapes.append((cols, rows) if trans_b else (rows, cols))
    return shapes


def step_shapes(directory: Path) -> tuple[list[Shape], int]:
    """The distinct weight shapes of a full-depth step, counted, and the number of layers."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise InvalidArgumentError(f"{directory} holds no manifest.json; pass an artifact directory "
                                   "(python -m export build --model opt-125m --out DIR)")
    manifest = json.loads(manifest_path.read_text())
    layers = [g["name"] for g in manifest.get("graphs", []) if g["name"].startswith("layer_")]
    if not layers:
        raise InvalidArgumentError(f"{manifest_path} lists no layer graphs; re-export the artifact "
                                   "(python -m export build)")
    counts: dict[tuple[int, int], int] = {}
    for shape in weight_shapes(directory / f"{layers[0]}.onnx"):
        counts[shape] = counts.get(shape, 0) + len(layers)
    for shape in weight_shapes(directory / "head.onnx"):
        counts[shape] = counts.get(shape, 0) + 1
    if not counts:
        raise InvalidArgumentError(f"{directory}: its layers and head hold no float weight matrices "
                                   "(quantized weights run MatMulNBits, not a GEMV); pass a float32 or "
                                   "float16 artifact")
    return [Shape(r, c, n) for (r, c), n in counts.items()], len(layers)


def _session(ort, weights: list[np.ndarray], gemm: bool, threads: int, spin: bool, prepack: bool):
    """One session multiplying x by every weight, one node each: the nodes of one ``session.run``, as
    a layer's products are, so its per-run cost is shared as it is in a layer."""
    from onnx import TensorProto, helper, numpy_helper

    from runtime.backends.onnxruntime import session_options

    rows = weights[0].shape[1] if gemm else weights[0].shape[0]
    cols = weights[0].shape[0] if gemm else weights[0].shape[1]
    nodes = [helper.make_node("Gemm", ["x", f"w{i}"], [f"y{i}"], transB=1) if gemm
             else helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(len(weights))]
    graph = helper.make_graph(nodes, "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, cols])
                               for i in range(len(weights))],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = session_options(ort, threads, spin=spin)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def kernels(shape: Shape, copies: int, threads: int, spin: bool, only: str | None = None, seed: int = 0) -> dict:
    """kernel (or just ``only``) -> a callable computing x @ W for every copy of W (a list of
    (1, out) arrays), each checked against numpy's."""
    import onnxruntime as ort

    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, shape.rows), dtype=np.float32)  # (1, in)
    ws = [rng.standard_normal((shape.rows, shape.cols), dtype=np.float32) * 0.02 for _ in range(copies)]  # (in, out)
    want = [x @ w for w in ws]
    calls = {"numpy": lambda: [x @ w for w in ws]}
    for name, gemm, prepack in (("ort", False, True), ("ort-noprepack", False, False), ("ort-gemm", True, True)):
        if only in (None, name):
            weights = [np.ascontiguousarray(w.T) for w in ws] if gemm else ws  # (out, in) : (in, out)
            s = _session(ort, weights, gemm, threads, spin, prepack)
            calls[name] = lambda s=s: s.run(None, {"x": x})
    if torch is not None and only in (None, "torch"):
        xt, wts = torch.from_numpy(x), [torch.from_numpy(np.ascontiguousarray(w.T)) for w in ws]  # (out, in)
        calls["torch"] = lambda: [torch.nn.functional.linear(xt, w).numpy() for w in wts]
    if torch is not None and only in (None, "torch-matmul"):
        xt, wms = torch.from_numpy(x), [torch.from_numpy(w) for w in ws]  # (in, out)
        calls["torch-matmul"] = lambda: [(xt @ w).numpy() for w in wms]
    calls = {k: calls[k] for k in KERNELS if k in calls and only in (None, k)}
    for name, fn in calls.items():
        for i, (got, ref) in enumerate(zip(fn(), want, strict=True)):
            np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4, err_msg=f"{name}, copy {i} of {shape}")
    return calls


def time_kernel(kernel: str, shapes: list[Shape], copies: list[int], rounds: int, threads: int,
                spin: bool) -> list[list[float]]:
    """In this process: seconds per round of one kernel on each shape; a round runs every shape."""
    calls = [kernels(shape, n, threads, spin, only=kernel)[kernel] for shape, n in zip(shapes, copies)]
    time.sleep(0.5)  # numpy's reference products leave OpenBLAS's threads spinning for a moment
    seconds = [[] for _ in shapes]
    for _ in range(rounds + 1):  # the first round warms the kernel up, untimed
        for fn, times in zip(calls, seconds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [times[1:] for times in seconds]


# One kernel a process: OpenBLAS's and OpenMP's threads spin on for a while after each call and
# would take a core from whichever kernel ran next in the same process.
_CHILD = """
import json, sys
from tools.bench import gemv
a = json.loads(sys.argv[1])
shapes = [gemv.Shape(*s) for s in a["shapes"]]
print(json.dumps(gemv.time_kernel(a["kernel"], shapes, a["copies"], a["rounds"], a["threads"], a["spin"])))
"""


def available_kernels() -> tuple[str, ...]:
    import importlib.util

    return tuple(k for k in KERNELS if not k.startswith("torch") or importlib.util.find_spec("torch") is not None)


def measure(shapes: list[Shape], evict_bytes: int, rounds: int, threads: int, spin: bool, repeats: int,
            log=print) -> list[Measured]:
    """Every kernel in its own process, ``repeats`` times in turn (A, B, ..., A, B, ...), the rounds
    of all its processes pooled."""
    from .runner import REPO

    copies = [max(1, math.ceil(evict_bytes / s.bytes)) for s in shapes]
    results = [Measured(s, n, {}) for s, n in zip(shapes, copies)]
    for repeat in range(repeats):
        for kernel in available_kernels():
            log(f"{kernel} ({repeat + 1}/{repeats})")
            arg = json.dumps({"kernel": kernel, "shapes": [[s.rows, s.cols, s.per_step] for s in shapes],
                              "copies": copies, "rounds": rounds, "threads": threads, "spin": spin})
            done = subprocess.run([sys.executable, "-c", _CHILD, arg], cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"timing {kernel} failed:\n{done.stderr[-2000:]}")
            for result, times in zip(results, json.loads(done.stdout.splitlines()[-1])):
                result.seconds.setdefault(kernel, []).extend(times)
    return results


def table(results: list[Measured], layers: int, bandwidth: float) -> tuple[str, dict]:
    names = list(results[0].seconds)
    lines = ["| weight (in x out) | MB | per step | copies | " + " | ".join(f"{k} GB/s" for k in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    step_bytes = sum(r.shape.bytes * r.shape.per_step for r in results)
    step_ms = {k: sum(r.shape.bytes * r.shape.per_step / (r.gbps(k) * 1e9) for r in results) * 1e3 for k in names}
    for r in results:
        s = r.shape
        lines.append(f"| {s.rows} x {s.cols} | {s.bytes / 1e6:.1f} | {s.per_step} | {r.copies} | "
                     + " | ".join(f"{r.gbps(k):.1f}" for k in names) + " |")
    floor_ms = step_bytes / bandwidth * 1e3
    lines.append(f"| **a step's products, ms** ({layers} layers + head, {step_bytes / 1e6:.0f} MB; "
                 f"floor {floor_ms:.2f}) | | | | " + " | ".join(f"{step_ms[k]:.2f} ({step_ms[k] / floor_ms:.2f}x)"
                                                          for k in names) + " |")
    summary = {"bandwidth": bandwidth, "floor_ms": floor_ms, "step_ms": step_ms,
               "shapes": [{"rows": r.shape.rows, "cols": r.shape.cols, "per_step": r.shape.per_step,
                           "copies": r.copies, "gbps": {k: r.gbps(k) for k in names}} for r in results]}
    return "\n".join(lines), summary


def blas_name() -> str:
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas['version']}"
    except (AttributeError, KeyError, TypeError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.gemv", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("artifact", type=Path, help="an artifact directory (python -m export build)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of ONNX Runtime and torch (default 2)")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per kernel and process (default 30)")
    p.add_argument("--spin", action="store_true", help="ONNX Runtime sessions with the backend's spin=True")
    p.add_argument("--evict-mib", type=int, default=128,
                   help="distinct bytes per shape, MiB: more than the last-level cache (default 128)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="array the bandwidth is measured on, MiB (default 1024: larger than any cache)")
    p.add_argument("--repeats", type=int, default=2,
                   help="processes per kernel, the kernels' processes taking turns (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    args = p.parse_args(argv)
    return cli.run(lambda: _main(args))


def _main(args) -> int:
    from . import bandwidth as bw_probe

    for name, value in (("--threads", args.threads), ("--rounds", args.rounds), ("--evict-mib", args.evict_mib),
                        ("--repeats", args.repeats),
                        ("--bandwidth-mib", args.bandwidth_mib)):
        if value < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    shapes, layers = step_shapes(args.artifact)
    print(f"measuring memory read bandwidth ({args.threads} thread(s))", file=sys.stderr)
    bw = bw_probe.measure(args.threads, array_bytes=args.bandwidth_mib << 20).best
    results = measure(shapes, args.evict_mib << 20, args.rounds, args.threads, args.spin, args.repeats,
                      log=lambda text: print(f"timing {text}", file=sys.stderr))
    bw = max(bw, bw_probe.measure(args.threads, array_bytes=args.bandwidth_mib << 20).best)
    text, summary = table(results, layers, bw)
    print(f"memory read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} thread(s); the higher of a probe before "
          f"and after the kernels); float32, batch 1, "
          f"{args.rounds} rounds, medians; ONNX Runtime and torch at {args.threads} thread(s)"
          f"{', spinning' if args.spin else ''}, numpy's BLAS ({blas_name()}) at its own count")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
