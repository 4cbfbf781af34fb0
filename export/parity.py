"""Check every exported graph against the PyTorch module it was traced from.

Each graph runs in ONNX Runtime (CPU) on random inputs of several shapes, bound as a runtime binds
them (a past as wide as the valid past and the new positions rounded up to whole pages of the
artifact's page size, masked past the valid positions): a prompt with left padding and a past, a
prompt with no past (the prefill, over an all-masked past), and one decode token over a longer past.
The comparing is Polygraphy's (``Comparator.run`` with its ONNX Runtime runner, then
``compare_accuracy`` against PyTorch's outputs as the reference run), the comparator that
``python -m engines verify`` runs on the device between TensorRT and ONNX Runtime. A float graph
passes numpy's ``allclose`` rule with the vector's scale as a floor (``compare_func``): no element
off by more than atol + rtol * max(|torch|, RMS of its vector along the last axis).

A graph with quantized weights (export.quantize) is judged in two parts that together say what
a user needs: that it computes what its weights mean, and that its weights are the checkpoint's.

* **The graph against the module with the graph's own weights**: the module with every quantized
  weight replaced by what the graph multiplies by (``export.quantize.dequantized_weights``, ONNX
  Runtime's own dequantization), at the float tolerances above. A wiring bug shows here as in a
  float graph.
* **Each quantized weight against the float one**: ||Wq - W||_2 <= rel * ||W||_2 per matrix
  (``QUANT_TOLERANCES``). A mangled weight (transposed, wrong scales, another layer's) is ~1.

The outputs' relative error against the float module on the check's random inputs is reported
beside them, not judged: a real checkpoint's layers fed random hidden states amplify the rounding
by their outlier channels (0.11-0.36 for int4 on SmolLM2-135M-Instruct, whose int4 export answers
as its float one does), which says nothing about the text it writes.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runtime.artifact.manifest import GraphSpec
from runtime.compare import compare_func, ort_session, polygraphy_version, tolerance  # noqa: F401 - export's API too
from runtime.errors import VerificationError

if TYPE_CHECKING:
    from runtime.models.base import SkipModel

# (atol, rtol) per dtype. fp32 graphs differ from torch by kernel order only (~1e-6); fp16 rounds
# every matmul to 11 bits of mantissa, so hidden states of magnitude ~10 move by ~1e-2.
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (3e-2, 3e-2)}
CASES = ((2, 3, 4), (2, 5, 0), (1, 1, 7))  # (batch, sequence, past)
# Relative L2 error of each quantized weight matrix against the float one. Block-wise (32)
# round-to-nearest puts each weight within half a step of 1/15 (int4) or 1/255 (int8) of its
# block's range: measured 0.083-0.093 (int4) and 0.0049-0.0055 (int8) on every matrix of the real
# SmolLM2-135M-Instruct, 0.081-0.083 / 0.0047-0.0049 on `export build --model tiny-random
# --weights int4|int8` (the manifests' checks). The bounds leave room for a checkpoint with wider
# blocks and still fail a mangled weight (~1).
QUANT_TOLERANCES = {"int8": 0.02, "int4": 0.2}
DRAFT_KEY = ".draft"  # a layer's draft graph (export --draft-layers): its check reads layer_NN.draft


@dataclass
class GraphCheck:
    graph: str
    max_abs_diff: float
    atol: float
    rtol: float
    passed: bool
    worst: str  # "output (batch, sequence, past)" where the largest violation was
    weights: str = "float"  # "int8" / "int4": max_abs_diff is against the module with the graph's
    # weights, and weight_error is judged against rel_tolerance too
    rel_error: float | None = None  # reported: max over outputs of ||onnx - float torch|| / ||float torch||
    rel_tolerance: float | None = None  # the bound of weight_error (QUANT_TOLERANCES)
    weight_error: float | None = None  # max over matrices of ||Wq - W|| / ||W||

    def line(self) -> str:
        status = "ok" if self.passed else "FAIL"
        if self.weights != "float":
            return (f"{self.graph:<10} {self.weights} weights' error {self.weight_error:.2e} (tolerance "
                    f"{self.rel_tolerance:g}); max |diff| {self.max_abs_diff:.2e} against them (atol "
                    f"{self.atol:g}, rtol {self.rtol:g})"
                    + ("" if self.rel_error is None else f"; outputs vs float {self.rel_error:.2e}") + f"  {status}")
        return (f"{self.graph:<10} max |diff| {self.max_abs_diff:.2e}  "
                f"(atol {self.atol:g}, rtol {self.rtol:g})  {status}")


@dataclass
class Case:
    """One input shape of a graph's check: the inputs and what PyTorch made of them. Plain numpy,
    so ``export verify`` can compute them in a process that holds the PyTorch model and compare
    them in one that never imports torch (export.reference)."""
    batch: int
    sequence: int
    past: int
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray]  # per output, as float32; quantized: the module with the graph's weights
    float_expected: list[np.ndarray] | None = None  # quantized: the float module's, reported beside
    weight_error: float | None = None  # quantized: the graph's max ||Wq - W|| / ||W|| (every case the same)


def with_graph_weights(module, path: Path, widths_from: Path | None = None):
    """A copy of ``module`` holding the weights its quantized graph at ``path`` multiplies by, and the
    largest relative L2 error of those against the module's own, over the matrices; ``widths_from``:
    the graph that records how its fused weights split (quantize.dequantized_weights)."""
    import copy

    import onnx
    import torch

    from runtime.artifact.manifest import TRANSPOSED

    from .quantize import dequantized_weights

    module = copy.deepcopy(module)
    state = module.state_dict()
    error = 0.0
    widths = None if widths_from is None else onnx.load(str(widths_from), load_external_data=False)
    for key, weight in dequantized_weights(onnx.load(str(path)), widths).items():  # (K, N) as MatMul reads it
        name = key.removesuffix(TRANSPOSED)
        if name not in state:
            raise VerificationError(f"{path.name}: quantized weight {key!r} is no weight of the module "
                                    f"it was exported from; this is a bug in the exporter")
        original = state[name]
        quantized = torch.from_numpy(np.ascontiguousarray(weight.T)).to(original.dtype)  # (N, K)
        if quantized.shape != original.shape:
            raise VerificationError(f"{path.name}: quantized weight {key!r} has shape {list(weight.shape)}, "
                                    f"the module's {list(original.shape)} transposed; this is a bug in the exporter")
        error = max(error, float(torch.linalg.norm((quantized - original).float())
                                 / max(float(torch.linalg.norm(original.float())), 1e-12)))
        state[name] = quantized
    module.load_state_dict(state)
    return module, error


def torch_cases(model: SkipModel, spec: GraphSpec, page_size: int, directory: Path | None = None,
                weights: str = "float", graph_file: str | None = None) -> list[Case]:
    """Run the PyTorch module behind ``spec`` on every shape of ``CASES``, the past bound in whole
    pages of ``page_size`` (the artifact's ``kv_cache.page_size``). ``weights`` int8/int4: also the
    module with the weights of the graph in ``directory`` (the cases' ``expected``), the float
    module's outputs kept as ``float_expected``; ``graph_file``: those of this graph instead of
    ``spec.file`` (a draft layer's, its fused weights split as ``spec.file`` records)."""
    import torch

    from runtime.models.base import graph_module

    from .onnx_export import example_inputs

    module = graph_module(model, spec.name)
    quantized, weight_error = (None, None) if weights == "float" else with_graph_weights(
        module, Path(directory) / (graph_file or spec.file), graph_file and Path(directory) / spec.file)

    def run(m, inputs):
        with torch.no_grad():
            out = m(*inputs.values())
        return [o.float().numpy() for o in (out if isinstance(out, tuple) else (out,))]

    cases = []
    for seed, (batch, seq, past) in enumerate(CASES):
        inputs = example_inputs(model, spec, batch, seq, past, page_size, seed=seed + 1)
        expected = run(module, inputs)
        arrays = {k: v.numpy() for k, v in inputs.items()}
        if quantized is None:
            cases.append(Case(batch, seq, past, arrays, expected))
        else:
            cases.append(Case(batch, seq, past, arrays, run(quantized, inputs), expected, weight_error))
    return cases


REFERENCE = "pytorch"  # the runner name of the reference outputs in Polygraphy's results


def _diffs(got: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[float, float]:
    """(max |got - expected|, how far past its bound (runtime.compare.tolerance) the worst element
    is: <= 0 passes)."""
    diff = np.abs(got - expected)
    return float(diff.max(initial=0.0)), float((diff - tolerance(expected, atol, rtol)).max(initial=-np.inf))


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
    judge it against PyTorch's outputs with Polygraphy's ``compare_accuracy``; quantized weights
    also by the cases' ``weight_error``."""
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.logger import G_LOGGER

    atol, rtol = TOLERANCES[dtype]
    runner = OnnxrtRunner(lambda: ort_session(Path(directory) / spec.file), name="onnxruntime")
    # Polygraphy logs every output's statistics at INFO
    with _torch_stays_out(), G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        ours = Comparator.run([runner], data_loader=[case.inputs for case in cases])
        # one RunResults of both runners, ours first: Polygraphy's relative error is against the second
        both = RunResults([*ours, *reference_results(spec, cases)])
        passed = bool(Comparator.compare_accuracy(both, compare_func=compare_func(atol, rtol)))
    float_rel, max_diff, worst_excess, worst = 0.0, 0.0, -np.inf, ""
    for case, got in zip(cases, ours[0][1]):
        for k, (out_spec, e) in enumerate(zip(spec.outputs, case.expected)):
            g = np.asarray(got[out_spec.name]).astype(np.float32)
            where = f"batch {case.batch}, sequence {case.sequence}, past {case.past}"
            if g.shape != e.shape:
                raise VerificationError(
                    f"{spec.name}: output {out_spec.name} has shape {g.shape} in ONNX Runtime but "
                    f"{e.shape} in PyTorch for {where}")
            largest, excess = _diffs(g, e, atol, rtol)
            max_diff = max(max_diff, largest)
            if case.float_expected is not None:
                float_rel = max(float_rel, _relative_l2(g, case.float_expected[k]))
            if excess > worst_excess:
                worst_excess, worst = excess, f"{out_spec.name} ({where})"
    passed = passed and bool(np.isfinite(max_diff))
    if weights == "float":
        return GraphCheck(spec.name, max_diff, atol, rtol, passed, worst)
    weight_error, tolerance = cases[0].weight_error, QUANT_TOLERANCES[weights]
    if weight_error > tolerance:
        passed, worst = False, f"its weights: relative error {weight_error:.2e}"
    return GraphCheck(spec.name, max_diff, atol, rtol, passed, worst, weights, float_rel, tolerance, weight_error)


def check_graph(model: SkipModel, spec: GraphSpec, directory: Path, dtype: str,
                weights: str = "float", *, page_size: int) -> GraphCheck:
    return compare(spec, torch_cases(model, spec, page_size, directory, weights), directory, dtype, weights)


def check_all(model: SkipModel, specs: list[GraphSpec], directory: Path, dtype: str, *, page_size: int,
              progress: bool = False, weights=lambda name: "float") -> list[GraphCheck]:
    """``weights(graph name)``: "float", "int8" or "int4" (``Manifest.graph_weights``);
    ``page_size``: the artifact's KV page, the step of the past widths the checks bind."""
    from tqdm.auto import tqdm

    return [check_graph(model, spec, directory, dtype, weights(spec.name), page_size=page_size)
            for spec in tqdm(specs, desc="check vs torch", unit="graph", disable=not progress)]


def compare_fused(fused: GraphSpec, cases: list[Case], directory, dtype: str, page_size: int) -> GraphCheck:
    """The fused graph (export.fused) of a layer against PyTorch, on its plain graph's ``torch_cases``
    (the reference's outputs, with the graph's own weights when quantized) turned into its inputs by
    runtime.gqa, as the runtime turns them: its hidden states, and the new K/V it wrote at each
    row's length of the buffers bound in place, within the float tolerances (numpy's allclose
    rule); the positions before each row's length must be left as they were. Its products are the
    plain graph's, whose check judges quantized weights against the checkpoint's: here they are
    the reference's own (``torch_cases``), so the line reads as a float graph's."""
    from runtime.gqa import call_inputs
    from runtime.kvcache import pages_width

    atol, rtol = TOLERANCES[dtype]
    session = ort_session(Path(directory) / fused.file)
    max_diff, worst_excess, worst = 0.0, -np.inf, ""
    for case in cases:
        hidden, mask = case.inputs["hidden_states"], case.inputs["attention_mask"]
        R, T = hidden.shape[:2]
        past = mask[:, :-T]
        length = np.array([np.flatnonzero(row).max(initial=-1) + 1 for row in past])  # (R,)
        width = max(past.shape[1], pages_width(int(length.max()) + T, page_size))  # as KVCache.reserve
        buffers = []
        for name, transposed in (("past_key", True), ("past_value", False)):
            given = case.inputs[name].swapaxes(2, 3) if transposed else case.inputs[name]  # (R, nkv, B, hd)
            buffer = np.zeros(given.shape[:2] + (width, given.shape[3]), given.dtype)
            buffer[:, :, : given.shape[2]] = given
            buffers.append(buffer)
        before = [b.copy() for b in buffers]
        call = call_inputs(mask, length, T, width)
        seqlens_k, query_seqlens = call.seqlens(None)
        binding = session.io_binding()
        for feed, array in (("hidden_states", hidden), ("attention_bias", call.attention_bias),
                            ("position_ids", call.position_ids), ("seqlens_k", seqlens_k),
                            ("total_sequence_length", call.total_sequence_length),
                            ("query_seqlens", query_seqlens), ("past_key", buffers[0]), ("past_value", buffers[1])):
            binding.bind_cpu_input(feed, array)
        out = np.empty_like(hidden)
        for feed, array in (("hidden_states_out", out), ("present_key", buffers[0]), ("present_value", buffers[1])):
            binding.bind_output(feed, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        session.run_with_iobinding(binding)
        rows = np.arange(R)[:, None], length[:, None] + np.arange(T)  # each row's new positions
        got = [out, *(b.transpose(0, 2, 1, 3)[rows].transpose(0, 2, 1, 3) for b in buffers)]  # (R, nkv, T, hd)
        where = f"batch {case.batch}, sequence {case.sequence}, past {case.past}"
        for name, g, e in zip(("hidden_states_out", "new_key", "new_value"), got, case.expected):
            largest, excess = _diffs(g.astype(np.float32), e, atol, rtol)
            max_diff = max(max_diff, largest)
            if excess > worst_excess:
                worst_excess, worst = excess, f"{name} ({where})"
        for b, old in zip(buffers, before):
            kept = np.arange(width)[None, :] < length[:, None]  # (R, W): each row's past
            if not np.array_equal(b.transpose(0, 2, 1, 3)[kept], old.transpose(0, 2, 1, 3)[kept]):
                worst_excess, worst = np.inf, f"the past K/V before a row's length ({where}): overwritten"
    passed = bool(np.isfinite(max_diff)) and worst_excess <= 0
    return GraphCheck(fused.name + ".gqa", max_diff, atol, rtol, passed, worst)


def compare_embed_table(spec: GraphSpec, entry: dict, cases: list[Case], directory, dtype: str,
                        vocab_size: int) -> GraphCheck:
    """The runtime's lookup of the manifest's ``embed_table`` (runtime.artifact.embed_table) against the
    embedding graph ``spec`` in ONNX Runtime, on ``cases``' inputs and on the vocabulary's first and
    last ids: value for value, since the runtime runs the lookup in the graph's stead."""
    from runtime.artifact.embed_table import EmbedTable

    with contextlib.closing(EmbedTable(directory, entry, dtype)) as table:
        session = ort_session(Path(directory) / spec.file)
        ends = Case(1, 2, 0, {"input_ids": np.array([[0, vocab_size - 1]], dtype=np.int64),
                              "attention_mask": np.ones((1, 2), dtype=np.int64)}, [])
        max_diff, worst = 0.0, ""
        for case in [*cases, ends]:
            got = table(case.inputs["input_ids"])
            expected = session.run(None, case.inputs)[0]
            where = f"hidden_states (batch {case.batch}, sequence {case.sequence}, past {case.past})"
            if got.shape != expected.shape:
                raise VerificationError(f"embed_table: the lookup gives shape {got.shape} but the graph "
                                        f"{expected.shape} for {where}")
            diff = float(np.max(np.abs(got.astype(np.float32) - expected.astype(np.float32)), initial=0.0))
            if not np.array_equal(got, expected) and not worst:
                worst = where
            max_diff = max(max_diff, diff)
        return GraphCheck("embed.table", max_diff, 0.0, 0.0, not worst, worst)


def draft_layer_cases(model: SkipModel, plain: GraphSpec, draft: GraphSpec, directory: Path, weights: str,
                      page_size: int) -> list[Case]:
    """``torch_cases`` of layer graph ``plain`` with the module holding its draft graph's weights
    (export --draft-layers: the fused graph with its products quantized to ``weights``)."""
    return torch_cases(model, plain, page_size, directory, weights, graph_file=draft.file)


def compare_draft_layer(draft: GraphSpec, cases: list[Case], directory: Path, dtype: str, weights: str,
                        page_size: int) -> GraphCheck:
    """A layer's draft graph judged as a quantized fused graph, on its ``draft_layer_cases``: against
    the module holding the draft's own dequantized weights at the float tolerances
    (``compare_fused``), and each weight matrix against the float one (QUANT_TOLERANCES). Drafts
    never decide a kept token (the verify pass does), so this catches a broken quantizer, not a
    lossy one."""
    from dataclasses import replace

    check = compare_fused(draft, cases, directory, dtype, page_size)
    weight_error, tolerance = cases[0].weight_error, QUANT_TOLERANCES[weights]
    passed, worst = check.passed, check.worst
    if weight_error > tolerance:
        passed, worst = False, f"its weights: relative error {weight_error:.2e}"
    return replace(check, graph=draft.name + DRAFT_KEY, passed=passed, worst=worst, weights=weights,
                   rel_tolerance=tolerance, weight_error=weight_error)


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
