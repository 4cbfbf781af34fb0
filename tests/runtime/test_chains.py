"""chains=True: the fused layer graphs through ONNX Runtime's C library, a step's layers chained
into few sessions that share one packed copy of their weights (runtime/backends/chains.py). What a
user cares about: the same tokens as the Python binding's sessions, whatever rows run which
layers, and a clear error where it cannot run."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from export.build import BuildOptions, build
from runtime.backends import ort_capi
from runtime.backends.chains import pieces, runs
from runtime.errors import ArtifactError
from tests.conftest import PROMPTS
from tests.export.test_fused import GQA_SHAPES
from tests.families import save_tiny_checkpoint

NEW = 20

pytestmark = pytest.mark.skipif(not ort_capi.available(), reason="this onnxruntime ships no C library")


@pytest.mark.parametrize("layers", [1, 2, 5, 8, 30, 32])
def test_every_top_suffix_is_its_layers_in_few_chains(layers):
    for k in range(1, layers + 1):
        chains = pieces(layers - k, layers - 1, layers)
        assert sum(chains, ()) == tuple(range(layers - k, layers))  # every layer once, bottom to top
        assert len(chains) <= int(np.log2(layers)) + 1
        assert all(len(c) & (len(c) - 1) == 0 for c in chains)  # powers of two: shared across k


def test_runs_of_consecutive_layers():
    assert runs([0, 13, 14, 15, 31]) == [(0, 0), (13, 15), (31, 31)]
    assert runs(range(4)) == [(0, 3)]
    assert runs([]) == []


@pytest.fixture(scope="module", params=[("llama3", "float"), ("qwen3", "float"), ("smollm2", "int4")])
def artifact(request, tmp_path_factory):
    """Llama-family artifacts with fused layer graphs (shapes whose head_dim is a multiple of 16)."""
    family, weights = request.param
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp(f"{family}-ckpt"), family, **GQA_SHAPES[family])
    out = tmp_path_factory.mktemp(f"{family}-{weights}") / "model"
    options = dict(weights=weights, block_size=16) if weights != "float" else {}
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, **options), log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def pair(artifact):
    plain = runtime.load(artifact, max_batch=4, check_hashes=False)
    chained = runtime.load(artifact, max_batch=4, check_hashes=False, chains=True)
    yield plain, chained
    plain.close()
    chained.close()


@pytest.mark.parametrize("speedup", [None, 2, 5])
def test_same_tokens_as_the_python_sessions(pair, speedup):
    plain, chained = pair
    assert chained.backend.chains and not plain.backend.chains
    kw = {} if speedup is None else {"speedup": speedup}
    want = plain.generate(PROMPTS, NEW, ignore_eos=True, **kw)
    got = chained.generate(PROMPTS, NEW, ignore_eos=True, **kw)
    assert got.token_ids == want.token_ids
    assert got.texts == want.texts


def test_rows_that_run_different_layers_in_one_step(artifact, pair):
    """Requests at different steps and policies share the engine's steps: a step's rows run
    different layers, so a chain runs only where every row of the call runs its layers and the
    others keep their state. Each request gives what it gives alone."""
    plain, _ = pair
    alone = [plain.generate(PROMPTS[:1], NEW, speedup=3, ignore_eos=True),
             plain.generate(PROMPTS[1:], NEW, speedup=2, ignore_eos=True)]
    chained = runtime.load(artifact, max_batch=4, check_hashes=False, chains=True)  # a step loop of its own
    with chained.stepper() as stepper:
        a = stepper.add(PROMPTS[:1], NEW, speedup=3, ignore_eos=True)
        for _ in range(5):
            stepper.step()
        b = stepper.add(PROMPTS[1:], NEW, speedup=2, ignore_eos=True)
        while not stepper.done:
            stepper.step()
    chained.close()
    assert a.error is None and b.error is None
    assert [a.result.token_ids, b.result.token_ids] == [r.token_ids for r in alone]


def test_lossless_verify_passes_run_chained(pair):
    plain, chained = pair
    want = plain.generate(PROMPTS, NEW, ignore_eos=True)
    got = chained.generate(PROMPTS, NEW, speedup=2, lossless=True, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert got.stats.verify_passes > 0


def test_an_artifact_without_fused_graphs_says_so(artifact_dir):
    with pytest.raises(ArtifactError, match=r"chains=True chains the fused layer graphs .* load with chains=False"):
        runtime.load(artifact_dir, check_hashes=False, chains=True)


def test_chains_need_the_fused_graphs(artifact):
    with pytest.raises(ArtifactError, match="chains=True"):
        runtime.load(artifact, check_hashes=False, chains=True, fused=False)


def test_values_are_the_arrays_memory():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert ort_capi.Value(a).array is a
    with pytest.raises(ValueError, match="C-contiguous"):
        ort_capi.Value(a.T)
    with pytest.raises(ValueError, match="no ONNX element type"):
        ort_capi.Value(np.zeros(2, np.complex64))


def test_a_package_without_the_c_library(monkeypatch, tmp_path):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__file__", str(tmp_path / "onnxruntime" / "__init__.py"))
    with pytest.raises(ort_capi.CApiUnavailableError, match="ships no C library"):
        ort_capi.library_path()


def test_errors_are_onnx_runtimes_messages():
    env = ort_capi.environment(None, False)
    with pytest.raises(ort_capi.CApiError, match="(?i)protobuf|parse|invalid"):
        env.session(b"not a model")
