"""How the toolkit judges one ONNX graph against a reference run, for every checker above the
runtime: ``export``'s graphs against PyTorch (export.parity, export verify) and ``engines``' TensorRT
plans against ONNX Runtime (engines verify). Both run Polygraphy's Comparator; both judge its runs
with ``compare_func``; both open the graphs with ``ort_session``."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def ort_session(path: Path, threads: int = 1):
    import onnxruntime as ort

    from .backends.onnxruntime import new_session_options

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


def polygraphy_version() -> str:
    """Polygraphy's version, for reports: the comparisons below are its Comparator's."""
    import polygraphy

    return polygraphy.__version__


def tolerance(expected: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Each element's bound: atol + rtol * max(|reference|, the RMS of its vector along the last
    axis). numpy's ``allclose`` rule where the element is as large as its vector; where it is
    small, rtol of the vector's scale instead. A hidden state or K/V vector comes out of sums
    whose fp32 rounding follows the size of their terms, not of the result: a real checkpoint's
    outlier channels (SmolLM2's layer 28: |h| up to 5,206, RMS 220) leave differences of ~1e-3 on
    its small elements that are rounding, not a wrong graph (a wrong wiring is off by ~the RMS)."""
    expected = np.asarray(expected, dtype=np.float32)
    if expected.ndim == 0 or expected.size == 0:
        return atol + rtol * np.abs(expected)
    rms = np.sqrt(np.mean(np.square(expected, dtype=np.float64), axis=-1, keepdims=True)).astype(np.float32)
    return atol + rtol * np.maximum(np.abs(expected), rms)


def compare_func(atol: float, rtol: float):
    """The compare function given to Polygraphy's ``compare_accuracy``: every element within
    ``tolerance`` (numpy's ``allclose`` rule with the vector's RMS as the floor of |reference|; the
    reference is the second run; same shapes; NaN fails). Polygraphy's own SimpleCompareFunc judges
    each element against atol and rtol apart (within the larger of the two), up to 2x stricter
    where both count: it failed correct graphs of real checkpoints, whose activations are large."""
    def within(ours, reference) -> dict[str, bool]:
        out = {}
        for name, expected in reference.items():
            got = np.asarray(ours[name], dtype=np.float32) if name in ours else None
            expected = np.asarray(expected, dtype=np.float32)
            out[name] = got is not None and got.shape == expected.shape and bool(
                np.all(np.abs(got - expected) <= tolerance(expected, atol, rtol)))  # NaN: False
        return out

    return within
