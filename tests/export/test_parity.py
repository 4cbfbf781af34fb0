"""export.parity judges each graph with Polygraphy: its ONNX Runtime runner, Comparator.run and
compare_accuracy against PyTorch's outputs, at the export's stated tolerances."""

import copy

import pytest

from export import parity
from runtime.manifest import load_manifest
from runtime.modeling import SkipOPT


@pytest.fixture(scope="module")
def head_cases(artifact_dir, hf_model):
    manifest = load_manifest(artifact_dir)
    head = manifest.graph("head")
    return manifest, head, parity.torch_cases(SkipOPT(hf_model), head, manifest.page_size)


def _nudged(cases, delta):
    """The cases with one logit of the last case moved by ``delta`` (a bug in one element)."""
    cases = copy.deepcopy(cases)
    cases[-1].expected[0].flat[7] += delta
    return cases


def test_polygraphys_elementwise_rule_at_the_stated_tolerances(artifact_dir, head_cases):
    manifest, head, cases = head_cases
    atol, rtol = parity.TOLERANCES[manifest.dtype]
    check = parity.compare(head, cases, artifact_dir, manifest.dtype)
    assert check.passed and check.max_abs_diff < atol and (check.atol, check.rtol) == (atol, rtol)
    # Polygraphy fails an element only when it breaks both atol and rtol * |reference|
    bound = max(atol, rtol * abs(float(cases[-1].expected[0].flat[7])))
    assert parity.compare(head, _nudged(cases, 0.5 * bound), artifact_dir, manifest.dtype).passed
    failed = parity.compare(head, _nudged(cases, 3 * bound), artifact_dir, manifest.dtype)
    assert not failed.passed and failed.worst == "logits (batch 1, sequence 1, past 7)"
    assert failed.max_abs_diff == pytest.approx(3 * bound, rel=0.05)


def test_quantized_rule_is_relative_l2_per_output(artifact_dir, head_cases):
    """The float head judged as if int8: the quantization bound is the L2 error relative to the output."""
    manifest, head, cases = head_cases
    check = parity.compare(head, cases, artifact_dir, manifest.dtype, "int8")
    assert check.passed and check.rel_error < 1e-5 and check.rel_tolerance == parity.QUANT_TOLERANCES["int8"]
    scaled = copy.deepcopy(cases)
    scaled[0].expected[0] *= 1.1  # 10% off everywhere: > 3% relative L2
    check = parity.compare(head, scaled, artifact_dir, manifest.dtype, "int8")
    assert not check.passed and check.rel_error == pytest.approx(0.1 / 1.1, rel=1e-3)

