"""Check every exported graph against the PyTorch module it was traced from.

Each graph runs in ONNX Runtime (CPU) on random inputs of several shapes, bound as a runtime binds
them (a past as wide as the valid past and the new positions rounded up to whole pages of the
artifact's page size, masked past the valid positions): a prompt with left padding and a past, a
prompt with no past (the prefill, over an all-masked past), and one decode token over a longer past.
The comparing is Polygraphy's (``Comparator.run`` with its ONNX Runtime runner, then
``compare_accuracy`` against PyTorch's outputs as the reference run), the comparator that
``python -m engines verify`` runs on the device between TensorRT and ONNX Runtime. A float graph
passes Polygraphy's ``CompareFunc.simple``: no element off by more than atol and by more than
rtol * |torch| (Polygraphy's elementwise rule: an element fails only when it breaks both).

A graph with quantized weights (export.quantize) is compared with the same fp32/fp16 PyTorch
module, so the difference is the quantization error, not a bug. That error is spread over every
element in a random direction: an elementwise bound loose enough for its largest outlier would
hide a real bug in the rest, so such a graph passes when each output's error is small relative to
the output as a whole, ||onnx - torch||_2 <= rel * ||torch||_2 (``QUANT_TOLERANCES``).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runtime.errors import VerificationError
from runtime.manifest import GraphSpec

if TYPE_CHECKING:
    from runtime.modeling import SkipOPT

# (atol, rtol) per dtype. fp32 graphs differ from torch by kernel order only (~1e-6); fp16 rounds
# every matmul to 11 bits of mantissa, so hidden states of magnitude ~10 move by ~1e-2.
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (3e-2, 3e-2)}
CASES = ((2, 3, 4), (2, 5, 0), (1, 1, 7))  # (batch, sequence, past)
# Relative L2 error per output for quantized weights. Block-wise (32) round-to-nearest puts each
# weight within half a step of 1/15 (int4) or 1/255 (int8) of its block's range: measured on random
# tiny models and on the demo model's graphs, the relative error of logits and new K/V is ~3-6e-2
# for int4 and ~3e-3 for int8 (layer outputs, which carry the residual, much less). The bounds
# leave room for that and still fail a graph whose weights were mangled (transposed, wrong scales:
# relative error ~1). The tight check is tests/export/test_quantize.py: the quantized graph against
# the reference with its weights replaced by the dequantized ones, at the float tolerances.
QUANT_TOLERANCES = {"int8": 0.03, "int4": 0.3}


@dataclass
class GraphCheck:
    graph: str
    max_abs_diff: float
    atol: float
    rtol: float
    passed: bool
    worst: str  # "output (batch, sequence, past)" where the largest violation was
    weights: str = "float"  # "int8" / "int4": judged by rel_error against rel_tolerance instead
    rel_error: float | None = None  # max over outputs of ||onnx - torch|| / ||torch||
    rel_tolerance: float | None = None

    def line(self) -> str:
        status = "ok" if self.passed else "FAIL"
        if self.weights != "float":
            return (f"{self.graph:<10} {self.weights} relative error {self.rel_error:.2e}  "
                    f"(tolerance {self.rel_tolerance:g}; max |diff| {self.max_abs_diff:.2e})  {status}")
        return (f"{self.graph:<10} max |diff| {self.max_abs_diff:.2e}  "
                f"(atol {self.atol:g}, rtol {self.rtol:g})  {status}")


def ort_session(path: Path, threads: int = 1):
    import onnxruntime as ort

    from runtime.backends.onnxruntime import new_session_options

    opts = new_session_options(ort)
    if opts.use_per_session_threads:  # else the process's shared pool (a spin=True load made it)
        opts.intra_op_num_threads = threads  # tiny graphs: one thread beats two (docs/design.md section 7)
    opts.log_severity_level = 3
    # One run per shape: packing the weights would only add a second copy of them (the head's
    # is the largest tensor of the model) while verify holds the PyTorch model too.
    opts.add_session_config_entry("session.disable_prepacking", "1")
    # ONNX Runtime fuses a QDQ int4 weight + MatMul into MatMulNBits with int8 activations (accuracy
    # level 4) unless told otherwise; the check is of the graph as written, in float.
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@dataclass
class Case:
    """One input shape of a graph's check: the inputs and what PyTorch made of them. Plain numpy,
    so ``export verify`` can compute them in a process that holds the PyTorch model and compare
    them in one that never imports torch (export.reference)."""
    batch: int
    sequence: int
    past: int
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]  # per output, as float32


def torch_cases(model: SkipOPT, spec: GraphSpec, page_size: int) -> list[Case]:
    """Run the PyTorch module behind ``spec`` on every shape of ``CASES``, the past bound in whole
    pages of ``page_size`` (the artifact's ``kv_cache.page_size``)."""
    import torch

    from runtime.modeling import graph_module

    from .onnx_export import example_inputs

    module = graph_module(model, spec.name)
    cases = []
    for seed, (batch, seq, past) in enumerate(CASES):
        inputs = example_inputs(model, spec, batch, seq, past, page_size, seed=seed + 1)
        with torch.no_grad():
            expected = module(*inputs.values())
        expected = expected if isinstance(expected, tuple) else (expected,)
        cases.append(Case(batch, seq, past, {k: v.numpy() for k, v in inputs.items()},
                          [e.float().numpy() for e in expected]))
    return cases


REFERENCE = "pytorch"  # the runner name of the reference outputs in Polygraphy's results


def polygraphy_version() -> str:
    """Polygraphy's version, for reports: the comparisons below are its Comparator's."""
    import polygraphy

    return polygraphy.__version__


def compare_func(atol: float, rtol: float, rel_tol: float | None = None):
    """Polygraphy's comparison for an export's stated tolerances: ``CompareFunc.simple`` (an element
    fails when it is off by more than ``atol`` and by more than ``rtol`` of the reference), or, for
    quantized weights, each output's relative L2 error against ``rel_tol`` (Polygraphy's own L2
    comparison is absolute)."""
    from polygraphy import comparator

    if rel_tol is None:  # SimpleCompareFunc from 0.53; CompareFunc.simple before (deprecated since)
        simple = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple
        return simple(atol=atol, rtol=rtol, check_shapes=True)

    def relative_l2(ours, reference):
        return {name: bool(_relative_l2(ours[name], reference[name]) <= rel_tol) for name in reference}

    return relative_l2


def _relative_l2(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected, dtype=np.float32)
    if got.shape != expected.shape:
        return float("inf")
    return float(np.linalg.norm(got - expected) / max(float(np.linalg.norm(expected)), 1e-12))


@contextlib.contextmanager
def _torch_stays_out():
    """Polygraphy asks of every array whether it is a torch tensor, importing torch (when installed)
    to find out. A numpy array never is one, and export verify's ONNX Runtime side must not import
    torch (export.reference): while torch is not imported yet, ``import torch`` fails here, which
    Polygraphy reads as "not importable" (sys.modules[name] = None is Python's way to block an import)."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def reference_results(spec: GraphSpec, cases: list[Case]):
    """PyTorch's outputs of ``cases`` as Polygraphy RunResults (one iteration per case)."""
    from polygraphy.comparator import IterationResult, RunResults

    names = [o.name for o in spec.outputs]
    iterations = [IterationResult(dict(zip(names, case.expected)), runner_name=REFERENCE) for case in cases]
    return RunResults([(REFERENCE, iterations)])


def compare(spec: GraphSpec, cases: list[Case], directory: Path, dtype: str,
            weights: str = "float") -> GraphCheck:
    """Run the exported graph on each case's inputs through Polygraphy's ONNX Runtime runner and
    judge it against PyTorch's outputs with Polygraphy's ``compare_accuracy``."""
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.logger import G_LOGGER

    atol, rtol = TOLERANCES[dtype]
    rel_tol = QUANT_TOLERANCES.get(weights)
    runner = OnnxrtRunner(lambda: ort_session(Path(directory) / spec.file), name="onnxruntime")
    # Polygraphy logs every output's statistics at INFO
    with _torch_stays_out(), G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        ours = Comparator.run([runner], data_loader=[case.inputs for case in cases])
        # one RunResults of both runners, ours first: Polygraphy's relative error is against the second
        both = RunResults([*ours, *reference_results(spec, cases)])
        passed = bool(Comparator.compare_accuracy(both, compare_func=compare_func(atol, rtol, rel_tol)))
    worst_rel, max_diff, worst_excess, worst = 0.0, 0.0, -np.inf, ""
    for case, got in zip(cases, ours[0][1]):
        for out_spec, e in zip(spec.outputs, case.expected):
            g = np.asarray(got[out_spec.name]).astype(np.float32)
            where = f"batch {case.batch}, sequence {case.sequence}, past {case.past}"
            if g.shape != e.shape:
                raise VerificationError(
                    f"{spec.name}: output {out_spec.name} has shape {g.shape} in ONNX Runtime but "
                    f"{e.shape} in PyTorch for {where}")
            diff = np.abs(g - e)
            max_diff = max(max_diff, float(diff.max(initial=0.0)))
            if rel_tol is not None:
                rel = _relative_l2(g, e)
                worst_rel = max(worst_rel, rel)
                excess = rel - rel_tol
            else:  # how far past Polygraphy's bound (the larger of the two) the worst element is
                excess = float((diff - np.maximum(atol, rtol * np.abs(e))).max(initial=-np.inf))
            if excess > worst_excess:
                worst_excess, worst = excess, f"{out_spec.name} ({where})"
    passed = passed and bool(np.isfinite(max_diff))
    if rel_tol is None:
        return GraphCheck(spec.name, max_diff, atol, rtol, passed, worst)
    return GraphCheck(spec.name, max_diff, atol, rtol, passed, worst, weights, worst_rel, rel_tol)


def check_graph(model: SkipOPT, spec: GraphSpec, directory: Path, dtype: str,
                weights: str = "float", *, page_size: int) -> GraphCheck:
    return compare(spec, torch_cases(model, spec, page_size), directory, dtype, weights)


def check_all(model: SkipOPT, specs: list[GraphSpec], directory: Path, dtype: str, *, page_size: int,
              progress: bool = False, weights=lambda name: "float") -> list[GraphCheck]:
    """``weights(graph name)``: "float", "int8" or "int4" (``Manifest.graph_weights``);
    ``page_size``: the artifact's KV page, the step of the past widths the checks bind."""
    from tqdm.auto import tqdm

    return [check_graph(model, spec, directory, dtype, weights(spec.name), page_size=page_size)
            for spec in tqdm(specs, desc="check vs torch", unit="graph", disable=not progress)]


def raise_on_failure(results: list[GraphCheck]) -> None:
    failed = [r for r in results if not r.passed]
    if failed:
        lines = "\n".join(f"  {r.line()}  worst at {r.worst}" for r in failed)
        hint = ("; for quantized weights, a smaller --block-size or int8 lowers the error"
                if any(r.weights != "float" for r in failed) else "")
        raise VerificationError(
            f"{len(failed)} graph(s) differ from PyTorch beyond tolerance:\n{lines}\n"
            f"This is a bug in the exporter or in ONNX Runtime; please report it with the model "
            f"and dtype{hint}")


def summary(results: list[GraphCheck]) -> dict:
    return {"graphs": [asdict(r) for r in results],
            "max_abs_diff": max((r.max_abs_diff for r in results), default=0.0),
            "passed": all(r.passed for r in results)}
