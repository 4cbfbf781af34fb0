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
                                               OrtValueStorage, build_helper_graphs, helper_graph_file)
from runtime.artifact.manifest import load_manifest
from runtime.kvcache import ArrayStorage
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import assert_same_steps

NEW = 12
LONG = 36  # new tokens that take a prompt past the first page of 32: the width grows
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


def buffers(storage):
    """Every layer's K then V as the graphs see them, on the host."""
    return storage.to_host() if isinstance(storage, OrtValueStorage) else [*storage.keys, *storage.values]


def pointers(storage):
    return [b.data_ptr() for b in [*storage.keys, *storage.values]]


def host(buffer):
    return buffer.numpy() if isinstance(buffer, ort.OrtValue) else buffer


def assert_same_buffers(ours, theirs, atol=0, rows=None, positions=None):
    """Every layer's K and V of two storages: the same shapes and values (of the first ``rows``
    rows' first ``positions`` positions, when given: what a re-lay keeps)."""
    assert len(buffers(ours)) == len(buffers(theirs))
    for k, (a, b) in enumerate(zip(buffers(ours), buffers(theirs))):
        a, b = host(a), host(b)
        assert a.shape == b.shape
        if positions is not None:
            axis = 3 if k < len(ours.keys) else 2  # K (rows, nh, hd, W), V (rows, nh, W, hd)
            a, b = np.take(a[:rows], range(positions), axis), np.take(b[:rows], range(positions), axis)
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)


def test_kv_stays_at_its_address_and_equals_the_plain_backends(bound, plain):
    """Within a width the device buffers are written in place (addresses fixed) with the same K/V as
    the host ones."""
    for gen in (bound, plain):
        cache = gen.engine.cache
        assert cache.used == 0  # the engines are idle
        cache.reserve(0, 0, 0)  # nothing in use: one page wide
        cache.storage.allocate(cache.max_rows, cache.capacity, cache.width)  # zeros, whatever earlier tests left
    storage, resizes = bound.engine.cache.storage, bound.engine.cache.resizes
    assert isinstance(storage, OrtValueStorage)
    addresses = pointers(storage)
    a = bound.generate(PROMPTS, NEW, speedup=2, ignore_eos=True)
    b = plain.generate(PROMPTS, NEW, speedup=2, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert bound.engine.cache.resizes == resizes  # the rows stayed within one page: no re-lay
    assert pointers(storage) == addresses
    assert_same_buffers(storage, plain.engine.cache.storage, FP32_ATOL)
    assert any(np.abs(k).max() > 0 for k in buffers(storage)), "nothing was written"


def test_rows_leaving_and_width_changes_equal_the_plain_backend(artifact_dir):
    """A short request leaves from row 0 while a long one decodes past the first page: the rows'
    moves and the re-lays at a new width keep the device K/V equal to the host ones, every step."""
    gens = [runtime.load(artifact_dir, device="cpu", threads=1, max_batch=4, check_hashes=False),
            runtime.load(artifact_dir, threads=1, max_batch=4, check_hashes=False)]
    outcomes = []
    try:
        for gen in gens:
            with gen.stepper() as stepper:
                handles = [stepper.add(PROMPTS[2], 6, ignore_eos=True)]
                stepper.step()
                handles.append(stepper.add(PROMPTS[:2], LONG, speedup=2, ignore_eos=True))
                while not stepper.done:
                    stepper.step()
            assert all(h.error is None and h.result is not None for h in handles)
            cache = gen.engine.cache
            outcomes.append(([h.events for h in handles], cache.moves, cache.resizes, cache.storage))
        (ours, moves, resizes, storage), (theirs, want_moves, want_resizes, want_storage) = outcomes
        assert (moves, resizes) == (want_moves, want_resizes) and moves > 0 and resizes > 0
        for a_events, b_events in zip(ours, theirs, strict=True):
            assert len(a_events) == len(b_events)
            for step, (a, b) in enumerate(zip(a_events, b_events)):
                np.testing.assert_allclose(a.logits, b.logits, atol=FP32_ATOL, rtol=0, err_msg=f"step {step}")
                assert a.token_ids == b.token_ids
        # (the buffers themselves differ where nothing is valid: a re-lay leaves the host memory
        # as it was there and pads the device's with zeros; test_resize_equals_the_array_storage)
    finally:
        for gen in gens:
            gen.close()


ROWS, CAPACITY = 4, 128


def storages(backend, width, seed=0):
    """An OrtValueStorage on ``backend``'s device and a numpy ArrayStorage (the reference), ROWS rows
    at ``width``, holding the same random K/V."""
    L, nh, hd = len(backend._layer_names), backend._nh, backend._hd
    ours = OrtValueStorage(backend)
    theirs = ArrayStorage(L, nh, hd, lambda shape: np.zeros(shape, np.float32))
    ours.allocate(ROWS, CAPACITY, width)
    theirs.allocate(ROWS, CAPACITY, width)
    assert_same_buffers(ours, theirs)  # zeros, both
    rng = np.random.default_rng(seed)
    for i in range(L):
        for mine, reference in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            reference[i][...] = rng.standard_normal(reference[i].shape).astype(np.float32)
            flat = np.zeros(int(np.prod(mine[i].shape())), np.float32)  # the whole capacity
            flat[: reference[i].size] = reference[i].ravel()  # the view at the width comes first
            mine[i].update_inplace(flat)
    return ours, theirs


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("T", [1, 2])
def test_write_equals_the_array_storage(bound, width, T):
    """Batch rows 0 and 2 of 3 get T new positions each, in cache rows 3 and 1, at the first and the
    last positions of the width; nothing else changes, and the buffers stay where they are."""
    backend = bound.backend
    nh, hd = backend._nh, backend._hd
    ours, theirs = storages(backend, width)
    before_k, before_v = theirs.keys[1].copy(), theirs.values[1].copy()
    addresses = pointers(ours)
    rng = np.random.default_rng(1)
    new_k = rng.standard_normal((3, nh, T, hd)).astype(np.float32)  # (B, nh, T, hd)
    new_v = rng.standard_normal((3, nh, T, hd)).astype(np.float32)
    src, dst, positions = np.array([0, 2]), np.array([3, 1]), np.array([0, width - T])
    ours.write(1, backend._to_device(new_k), backend._to_device(new_v), src, dst, positions)
    theirs.write(1, new_k, new_v, src, dst, positions)
    assert pointers(ours) == addresses
    assert_same_buffers(ours, theirs)
    want_k, want_v = before_k, before_v
    for s, d, p in zip(src, dst, positions):
        for t in range(T):
            want_k[d, :, :, p + t] = new_k[s, :, t]  # (nh, hd)
            want_v[d, :, p + t, :] = new_v[s, :, t]
    np.testing.assert_array_equal(theirs.keys[1], want_k)  # the reference writes what it should
    np.testing.assert_array_equal(theirs.values[1], want_v)


@pytest.mark.parametrize("width", [32, 64])
def test_move_equals_the_array_storage(bound, width):
    ours, theirs = storages(bound.backend, width)
    before = [b.copy() for b in buffers(theirs)]
    addresses = pointers(ours)
    for src, dst in ((3, 0), (1, 2)):
        ours.move(src, dst, width)
        theirs.move(src, dst, width)
    assert pointers(ours) == addresses
    assert_same_buffers(ours, theirs)
    for old, new in zip(before, buffers(theirs)):
        np.testing.assert_array_equal(new[0], old[3])
        np.testing.assert_array_equal(new[2], old[1])
        np.testing.assert_array_equal(new[[1, 3]], old[[1, 3]])


@pytest.mark.parametrize("old, new, used", [(32, 64, 3), (32, 96, 4), (64, 32, 3), (96, 64, 1), (64, 32, 0)])
def test_resize_equals_the_array_storage(bound, old, new, used):
    """Rows [0, used) keep their first min(old, new) positions, the rest is zeros; writes after the
    re-lay land where the reference's do (the scatter grid follows the width)."""
    backend = bound.backend
    ours, theirs = storages(backend, old)
    before = [b.copy() for b in buffers(theirs)]
    addresses = pointers(ours)
    ours.resize(new, used)
    theirs.resize(new, used)
    assert ours.width == theirs.width == new
    assert pointers(ours) == addresses  # re-laid in place
    keep = min(old, new)
    assert_same_buffers(ours, theirs, rows=used, positions=keep)
    for k, (was, now) in enumerate(zip(before, buffers(theirs))):
        axis = 3 if k < len(ours.keys) else 2  # K (rows, nh, hd, W), V (rows, nh, W, hd)
        assert now.shape[axis] == new
        kept = [slice(None)] * 4
        kept[axis] = slice(0, keep)
        np.testing.assert_array_equal(now[:used][tuple(kept)], was[:used][tuple(kept)])
        assert np.isfinite(now).all()  # the rest holds what the memory held: masked, and finite
    nh, hd = backend._nh, backend._hd
    new_k = np.ones((2, nh, 1, hd), np.float32)
    src, dst, positions = np.array([0, 1]), np.array([1, 0]), np.array([new - 1, 0])
    ours.write(0, backend._to_device(new_k), backend._to_device(-new_k), src, dst, positions)
    theirs.write(0, new_k, -new_k, src, dst, positions)
    mine = ours.to_host()
    for got, want, at in ((mine[0], theirs.keys[0], lambda a, r, p: a[r, :, :, p]),  # K (rows, nh, hd, W)
                          (mine[len(ours.keys)], theirs.values[0], lambda a, r, p: a[r, :, p])):  # V
        for row, position, value in ((1, new - 1, 1.0), (0, 0, 1.0)):
            np.testing.assert_array_equal(at(got, row, position), at(want, row, position))
            assert np.abs(at(want, row, position)).min() == value


def test_a_layer_binds_its_block_of_rows_in_place(bound, plain):
    """A layer gets the block of rows [1, 3) by address (the buffer's, at the block's first row) and
    shape (rows, nh, hd|W, W|hd) at the current width, and computes what the host backend does on
    the same rows of a numpy buffer."""
    backend, W = bound.backend, 64
    nh, hd = backend._nh, backend._hd
    ours, theirs = storages(backend, W)
    key, value = ours.past(2, 1, 3)
    assert key.buffer is ours.keys[2] and value.buffer is ours.values[2]
    assert key.start == value.start == 1 * nh * hd * W  # elements before row 1
    assert key.shape == (2, nh, hd, W) and value.shape == (2, nh, W, hd)
    rng = np.random.default_rng(2)
    mask = np.concatenate([np.zeros((2, W), np.int64), np.ones((2, 1), np.int64)], axis=1)  # (2, W + 1)
    mask[0, :40], mask[1, 5:20] = 1, 1  # each row's valid past
    hidden = rng.standard_normal((2, 1, 32)).astype(np.float32)
    got = [host(x) for x in backend.layer(2, hidden, mask, key, value)]
    want = plain.backend.layer(2, hidden, mask, *theirs.past(2, 1, 3))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=FP32_ATOL, rtol=0)
    got_block = [host(x) for x in backend.layer(2, hidden, mask, *ours.past(2, 0, 2))]
    assert not np.allclose(got_block[0], got[0]), "another block of rows, another past: another output"


def test_hidden_states_stay_bound_and_only_asked_rows_come_back(bound):
    backend = bound.backend
    storage = OrtValueStorage(backend)
    storage.allocate(2, 32, 32)
    mask = np.concatenate([np.zeros((2, 32), np.int64), np.ones((2, 2), np.int64)], axis=1)  # no valid past
    hidden = backend.embed(np.array([[5, 6], [7, 8]], np.int64), mask)
    assert isinstance(hidden, ort.OrtValue) and hidden.shape() == [2, 2, 32]
    hidden, new_key, new_value = backend.layer(0, hidden, mask, *storage.past(0, 0, 2))
    assert isinstance(hidden, ort.OrtValue)
    assert isinstance(new_key, ort.OrtValue)
    assert new_key.shape() == new_value.shape() == [2, backend._nh, 2, backend._hd]  # (B, nh, T, hd)
    logits = backend.head(hidden, np.array([1]))
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, 512)
    np.testing.assert_allclose(logits, backend.head(hidden)[1:], atol=0, rtol=0)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_cuda_equals_the_cpu(artifact_dir, plain):
    gen = runtime.load(artifact_dir, device="cuda", max_batch=4)
    try:
        assert all(k.device_name() == "cuda" for k in gen.engine.cache.storage.keys)
        for options in ({}, dict(speedup=2)):
            assert_same_steps(gen, plain, NEW, CUDA_ATOL, **options)
    finally:
        gen.close()
