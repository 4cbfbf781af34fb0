"""export.reference: verify's PyTorch side in a process of its own."""

import json
import subprocess
import sys

import numpy as np
import pytest

from export import parity, reference
from runtime.artifact.manifest import load_manifest
from runtime.errors import ModelNotFoundError, VerificationError
from runtime.generation_config import GenerationConfig
from runtime.generator import policy_for
from tests.conftest import PROMPTS

REPO_ROOT = reference.REPO


def test_verify_never_imports_torch_in_its_own_process(artifact_dir):
    """The whole point of the child: torch, transformers and the checkpoint never share a process
    with the ONNX Runtime sessions, so verify peaks at one side, not both."""
    code = ("import json, sys\n"
            "from export.verify import verify\n"
            "report = verify(sys.argv[1], progress=False)\n"
            "print(json.dumps({'passed': report.passed, 'lines': report.lines,\n"
            "                  'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules)}))")
    done = subprocess.run([sys.executable, "-c", code, str(artifact_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["heavy"] == []
    assert out["passed"], out["lines"]
    assert any("identical tokens to the PyTorch reference" in line for line in out["lines"])


def test_child_cases_equal_the_in_process_reference(artifact_dir, hf_model):
    """What comes back through the pickle is what check_graph computes in process."""
    from runtime.models.opt import SkipOPT

    side = reference.run(artifact_dir, None, list(PROMPTS), 4, 2.0)
    manifest = load_manifest(artifact_dir)
    assert list(side.cases) == [g.name for g in manifest.graphs]
    ref = SkipOPT(hf_model)
    for spec in manifest.graphs:
        here = parity.torch_cases(ref, spec, manifest.page_size)
        there = side.cases[spec.name]
        assert [(c.batch, c.sequence, c.past) for c in there] == list(parity.CASES)
        for a, b in zip(here, there):
            assert a.inputs.keys() == b.inputs.keys()
            for x, y in zip([*a.inputs.values(), *a.expected], [*b.inputs.values(), *b.expected]):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    assert len(side.references.hf_tokens) == len(PROMPTS)
    assert side.references.policy == policy_for(manifest, GenerationConfig(max_new_tokens=4, speedup=2.0))


def test_an_error_in_the_child_comes_back_with_its_type_and_message(artifact_dir, tmp_path):
    with pytest.raises(ModelNotFoundError, match="verify needs the checkpoint the artifact was exported "
                                                 "from; pass it with --model DIR"):
        reference.run(artifact_dir, str(tmp_path / "no-such-checkpoint"), list(PROMPTS), 4, 2.0)


def test_a_child_that_dies_is_a_verification_error(artifact_dir, monkeypatch):
    monkeypatch.setattr(reference.sys, "executable", "/bin/false")
    with pytest.raises(VerificationError, match=r"PyTorch reference process failed \(exit 1\)"):
        reference.run(artifact_dir, None, list(PROMPTS), 4, 2.0)


def test_a_wrong_graph_still_fails_against_the_child_cases(artifact_dir, tmp_path, hf_model):
    """compare judges the graph file, whatever computed the expectations: feed it another layer."""
    from runtime.models.opt import SkipOPT

    manifest = load_manifest(artifact_dir)
    layer0, layer1 = manifest.layers[0], manifest.layers[1]
    cases = parity.torch_cases(SkipOPT(hf_model), layer1, manifest.page_size)
    assert parity.compare(layer1, cases, artifact_dir, manifest.dtype).passed
    assert not parity.compare(layer0, cases, artifact_dir, manifest.dtype).passed
