"""The ONNX Runtime IOBinding backend, run on the CPU provider (the same binding code the GPU runs).

On a machine whose onnxruntime offers CUDAExecutionProvider (onnxruntime-gpu) the CUDA tests run
too; elsewhere they skip, saying so.
"""

import numpy as np
import onnxruntime as ort
import pytest

import runtime
from runtime.backends import create_backend
from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.backends.onnxruntime_cuda import (HELPERS, IOBindingDeviceError, OnnxRuntimeIOBindingBackend,
                                               build_helper_graphs, helper_graph_file)
from runtime.manifest import load_manifest
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import assert_same_steps

NEW = 12
NO_CUDA = (f"onnxruntime {ort.__version__} here offers {ort.get_available_providers()}, no "
           f"CUDAExecutionProvider: the IOBinding backend's CUDA path needs onnxruntime-gpu and a GPU")
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
FP32_ATOL = 1e-5  # same graphs, same provider: only the binding differs (measured 0)
CUDA_ATOL = 1e-4  # fp32 on the CUDA provider vs the CPU one


@pytest.fixture(scope="module")
def bound(artifact_dir):
    gen = runtime.load(artifact_dir, device="cpu", threads=1, max_batch=4)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def plain(artifact_dir):
    gen = runtime.load(artifact_dir, threads=1, max_batch=4)
    yield gen
    gen.close()


def test_a_device_selects_the_iobinding_backend(artifact_dir, monkeypatch):
    import runtime.backends as backends

    manifest = load_manifest(artifact_dir)
    assert type(create_backend("onnxruntime", artifact_dir, manifest, device="cpu")) is OnnxRuntimeIOBindingBackend
    assert type(create_backend("onnxruntime", artifact_dir, manifest)) is OnnxRuntimeBackend
    monkeypatch.setattr(backends, "_ort_has_cuda", lambda: True)  # as with onnxruntime-gpu
    with pytest.raises(IOBindingDeviceError, match="needs ONNX Runtime's CUDAExecutionProvider"):
        create_backend("onnxruntime", artifact_dir, manifest)  # the default becomes device="cuda"
    explicit = create_backend("onnxruntime", artifact_dir, manifest, providers=["CPUExecutionProvider"])
    assert type(explicit) is OnnxRuntimeBackend  # providers named: the plain backend, as asked


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_cuda_without_the_provider_says_how_to_fix_it(artifact_dir):
    with pytest.raises(IOBindingDeviceError, match="install onnxruntime-gpu instead of onnxruntime"):
        OnnxRuntimeIOBindingBackend(artifact_dir, load_manifest(artifact_dir), device="cuda")


def test_unknown_device(artifact_dir):
    with pytest.raises(IOBindingDeviceError, match="binds 'cuda', 'cuda:N' or 'cpu'"):
        OnnxRuntimeIOBindingBackend(artifact_dir, load_manifest(artifact_dir), device="tpu")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_shipped_helper_graphs_are_what_the_builder_writes(dtype):
    built = build_helper_graphs(dtype)
    assert sorted(built) == sorted(HELPERS)
    for name, data in built.items():
        assert helper_graph_file(name, dtype).read_bytes() == data, (
            f"{helper_graph_file(name, dtype)} is stale; rewrite it with python -c 'from "
            f"runtime.backends.onnxruntime_cuda import write_helper_graphs; write_helper_graphs()'")


@pytest.mark.parametrize("options", [{}, dict(speedup=2),
                                     dict(policy=SkipPolicy(6, 5, 2, warmup_layers=1, horizon=NEW - 1))])
def test_equals_the_plain_backend_every_step(bound, plain, options):
    assert_same_steps(bound, plain, NEW, FP32_ATOL, **options)


def test_kv_stays_at_its_address_and_equals_the_plain_backends(bound, plain):
    """The device buffers are written in place (addresses fixed) with the same K/V as the host ones."""
    for gen in (bound, plain):  # earlier tests left K/V behind: both start from zeros (the engines are idle)
        gen.backend.allocate(gen.backend.slots, gen.backend.capacity)
    pointers = [k.data_ptr() for k in bound.backend.keys] + [v.data_ptr() for v in bound.backend.values]
    a = bound.generate(PROMPTS, NEW, speedup=2, ignore_eos=True)
    b = plain.generate(PROMPTS, NEW, speedup=2, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert [k.data_ptr() for k in bound.backend.keys] + [v.data_ptr() for v in bound.backend.values] == pointers
    for ours, theirs in zip(bound.backend.keys + bound.backend.values, plain.backend.keys + plain.backend.values):
        np.testing.assert_allclose(ours.numpy(), theirs, atol=FP32_ATOL, rtol=0)
    assert any(np.abs(k.numpy()).max() > 0 for k in bound.backend.keys), "nothing was written"


def test_scatter_writes_only_the_new_positions_in_place(bound):
    """Rows 0 and 2 of 3 get T = 2 new positions each, across a page boundary; nothing else moves."""
    backend = bound.backend
    nh, hd, page, S = backend._nh, backend._hd, backend._page, backend.slots
    rng = np.random.default_rng(0)
    before_k, before_v = backend.keys[1].numpy(), backend.values[1].numpy()  # host copies
    address = backend.keys[1].data_ptr()
    new_k = rng.standard_normal((3, nh, 2, hd)).astype(np.float32)  # (B, nh, T, hd)
    new_v = rng.standard_normal((3, nh, 2, hd)).astype(np.float32)
    rows, positions, slots = np.array([0, 2]), np.array([page - 1, 3]), np.array([1, 0, 3])
    pos = positions[:, None] + np.arange(2)  # (R, T)
    cell = (pos // page * S + slots[rows][:, None]) * (nh * hd * page)
    backend._scatter("k", backend.keys[1], backend._to_device(new_k), rows, cell + pos % page)
    backend._scatter("v", backend.values[1], backend._to_device(new_v), rows, cell + pos % page * hd)
    want_k, want_v = before_k.copy(), before_v.copy()
    for r, b in enumerate(rows):
        for t in range(2):
            p = pos[r, t]
            want_k[p // page, slots[b], :, :, p % page] = new_k[b, :, t]  # (nh, hd)
            want_v[p // page, slots[b], :, p % page, :] = new_v[b, :, t]
    assert backend.keys[1].data_ptr() == address
    np.testing.assert_array_equal(backend.keys[1].numpy(), want_k)
    np.testing.assert_array_equal(backend.values[1].numpy(), want_v)


def test_hidden_states_stay_bound_and_only_asked_rows_come_back(bound):
    backend = bound.backend
    hidden = backend.embed(np.array([[5, 6], [7, 8]], np.int64), np.ones((2, 2), np.int64))
    assert isinstance(hidden, ort.OrtValue) and hidden.shape() == [2, 2, 32]
    hidden = backend.layer(0, hidden, np.ones((2, 2), np.int64), np.array([0, 1]), np.zeros(2, np.int64))
    assert isinstance(hidden, ort.OrtValue)
    logits = backend.head(hidden, np.array([1]))
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, 512)
    np.testing.assert_allclose(logits, backend.head(hidden)[1:], atol=0, rtol=0)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_cuda_equals_the_cpu(artifact_dir, plain):
    gen = runtime.load(artifact_dir, device="cuda", max_batch=4)
    try:
        assert all(k.device_name() == "cuda" for k in gen.backend.keys)
        for options in ({}, dict(speedup=2)):
            assert_same_steps(gen, plain, NEW, CUDA_ATOL, **options)
    finally:
        gen.close()
