"""export.parity judges each graph with Polygraphy: its ONNX Runtime runner, Comparator.run and
compare_accuracy against PyTorch's outputs, by numpy's allclose rule (the vector's RMS as the floor of
|reference|) at the export's stated tolerances."""

import copy

import numpy as np
import pytest

from export import parity
from runtime.artifact.manifest import load_manifest
from runtime.models.opt import SkipOPT


@pytest.fixture(scope="module")
def head_cases(artifact_dir, hf_model):
    manifest = load_manifest(artifact_dir)
    head = manifest.graph("head")
    return manifest, head, parity.torch_cases(SkipOPT(hf_model), head, manifest.page_size)


def _nudged(cases, delta, at):
    """The cases with one logit of the last case moved by ``delta`` (a bug in one element)."""
    cases = copy.deepcopy(cases)
    cases[-1].expected[0].flat[at] += delta
    return cases


def test_numpys_allclose_rule_at_the_stated_tolerances(artifact_dir, head_cases):
    manifest, head, cases = head_cases
    atol, rtol = parity.TOLERANCES[manifest.dtype]
    check = parity.compare(head, cases, artifact_dir, manifest.dtype)
    assert check.passed and check.max_abs_diff < atol and (check.atol, check.rtol) == (atol, rtol)
    # an element passes within atol + rtol * |reference|, as numpy.allclose: at the largest logit, where
    # Polygraphy's own rule (the larger of atol and rtol * |reference|) is the stricter by most
    at = int(abs(cases[-1].expected[0]).argmax())
    reference = abs(float(cases[-1].expected[0].flat[at]))
    bound = atol + rtol * reference
    # the two rules disagree at 0.95 * bound, by far more than the graph's own difference
    assert 0.95 * bound - max(atol, rtol * reference) > 10 * check.max_abs_diff
    assert parity.compare(head, _nudged(cases, 0.95 * bound, at), artifact_dir, manifest.dtype).passed
    failed = parity.compare(head, _nudged(cases, 1.3 * bound, at), artifact_dir, manifest.dtype)
    assert not failed.passed and failed.worst == "logits (batch 1, sequence 1, past 7)"
    assert failed.max_abs_diff == pytest.approx(1.3 * bound, rel=0.05)


def test_quantized_rule_is_the_graphs_own_weights_then_their_error(artifact_dir, head_cases):
    """A quantized graph passes when it equals the module with its own weights at the float
    tolerances and those weights are within QUANT_TOLERANCES of the float ones; its outputs'
    error against the float module is reported beside. The float head stands in for one here."""
    manifest, head, cases = head_cases
    tolerance = parity.QUANT_TOLERANCES["int8"]
    quantized = copy.deepcopy(cases)
    for case in quantized:
        case.float_expected = [e * 1.1 for e in case.expected]  # the float module: 10% away
        case.weight_error = 0.5 * tolerance
    check = parity.compare(head, quantized, artifact_dir, manifest.dtype, "int8")
    assert check.passed and check.max_abs_diff < 1e-4 and check.rel_tolerance == tolerance
    assert check.rel_error == pytest.approx(0.1 / 1.1, rel=1e-3)  # reported, not judged
    assert "int8 weights' error 1.00e-02 (tolerance 0.02); max |diff|" in check.line() and check.line().endswith("ok")
    for case in quantized:
        case.weight_error = 3 * tolerance
    check = parity.compare(head, quantized, artifact_dir, manifest.dtype, "int8")
    assert not check.passed and check.worst == "its weights: relative error 6.00e-02"
    check = parity.compare(head, _nudged(quantized, 1.0, at=7), artifact_dir, manifest.dtype, "int8")
    assert not check.passed  # off the module with its own weights: a wiring bug


def test_a_small_element_beside_outliers_is_judged_by_its_vectors_scale():
    """fp32 rounding of a hidden state follows the size of the sums behind it: a real checkpoint's
    outlier channels leave ~1e-3 on small elements (SmolLM2's layer 28: RMS 220), which passes; an
    error of the vector's own scale (a wrong wiring) still fails, and so does NaN."""
    from runtime.compare import compare_func, tolerance

    atol, rtol = parity.TOLERANCES["float32"]
    reference = np.full((1, 2, 576), 0.5, np.float32)
    reference[..., 7] = 5206.0  # one outlier channel: RMS ~217
    nudged = reference.copy()
    nudged[0, 1, 3] += 2.44e-3  # at an element of 0.5: 49x numpy's allclose bound
    assert not np.allclose(nudged, reference, atol=atol, rtol=rtol)
    judge = compare_func(atol, rtol)
    assert judge({"h": nudged}, {"h": reference}) == {"h": True}
    assert tolerance(reference, atol, rtol)[0, 1, 7] == pytest.approx(atol + rtol * 5206.0)  # allclose's own there
    wrong = reference.copy()
    wrong[0, 1, 3] += 0.5 * 217  # off by half the vector's scale
    assert judge({"h": wrong}, {"h": reference}) == {"h": False}
    wrong[0, 1, 3] = np.nan
    assert judge({"h": wrong}, {"h": reference}) == {"h": False}
