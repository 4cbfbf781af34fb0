"""The TensorRT backend (engines/backend.py). TensorRT cannot be installed here, so the backend runs
against a fake ``tensorrt`` (tests/engines/fakes.py) whose engines execute the artifact's ONNX graphs
with ONNX Runtime on host pointers: the buffers, the KV cache's writes, moves and re-lays, profile
choice, I/O checks and limits are the backend's real code, on torch CPU tensors. The test against
real TensorRT skips without it."""

import importlib.util
import threading

import numpy as np
import pytest

import runtime
from engines import backend as trt_backend
from engines.backend import (CudaGraphsNotImplementedError, HostDevice, StreamStorage, check_engine_io,
                             context_memory_api, torch_dtype)
from engines.build import build_engines
from engines.config import EngineBuildConfig
from engines.device import DeviceInfo
from engines.errors import EngineLimitError, EngineMismatchError, TensorRTMissingError
from runtime.artifact.manifest import load_manifest
from runtime.backends.base import run_layers
from runtime.errors import ArtifactError, SkipDecodeError
from runtime.kvcache import KVCache
from tests.conftest import PROMPTS
from tests.engines.fakes import ORIN, FakeTensorRT, FakeToolchain
from tests.runtime.test_engine import Picks
from tests.runtime.test_generate import SpyBackend

# The test artifacts have pages of 32 positions: max_seq 48 makes the cache's capacity 2 pages (64).
LIMITS = dict(max_batch=4, max_seq=48, max_prompt=16)
PAGE = 32
NEW = 10
LONG = 36  # new tokens that take every prompt past the first page: the bound width grows 32 -> 64
FLAVOURS = {"trt8.6": ("8.6.2.3", "INT32"), "trt10.3": ("10.3.0", "INT64")}  # JetPack 6.0, 6.1/6.2


def build(artifact_dir, engine_dir, version="10.3.0", device=ORIN, **overrides):
    build_engines(artifact_dir, EngineBuildConfig(**{**LIMITS, **overrides}), engine_dir=engine_dir,
                  progress=False, log=lambda *_: None, toolchain=FakeToolchain(version, device))
    return engine_dir


@pytest.fixture
def fake_gpu(monkeypatch):
    """Swap in a fake tensorrt of a given flavour, an Orin, and host memory for device memory."""
    def install(version="10.3.0", int_dtype="INT64", device=ORIN, **kwargs):
        fake = FakeTensorRT(version, int_dtype, **kwargs)
        monkeypatch.setattr(trt_backend, "_import_tensorrt", lambda: fake)
        monkeypatch.setattr(trt_backend, "_current_device", lambda: device)
        monkeypatch.setattr(trt_backend, "_open_device", HostDevice)
        return fake
    return install


def load(artifact_dir, engine_dir, **kwargs):
    limits = dict(max_batch=LIMITS["max_batch"], max_length=LIMITS["max_seq"])
    return runtime.load(artifact_dir, backend="tensorrt", engine_dir=engine_dir, **{**limits, **kwargs})


def run(gen, new=NEW, prompts=PROMPTS, **kwargs):
    stream = gen.stream(prompts, new, **kwargs)
    logits = [event.logits for event in stream]
    return stream.result, logits


def assert_same(result, logits, expected, expected_logits):
    assert result.token_ids == expected.token_ids and result.texts == expected.texts
    assert result.stats.layers_per_step == expected.stats.layers_per_step
    for got, want in zip(logits, expected_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("speedup", [None, 2])
def test_generation_matches_onnxruntime(artifact_dir, generator, tmp_path, fake_gpu, flavour, speedup):
    version, int_dtype = FLAVOURS[flavour]
    fake = fake_gpu(version, int_dtype)
    gen = load(artifact_dir, build(artifact_dir, tmp_path, version))
    # LONG new tokens: the rows cross into the second page, so decode binds a past 32 then 64 wide
    assert_same(*run(gen, LONG, speedup=speedup), *run(generator, LONG, speedup=speedup))
    assert fake.context_apis == {context_memory_api(version)}
    # one activation block shared by every context, given the 8.x or the 10.x way
    assert len(fake.scratch) == gen.num_layers + 2 and len({ptr for ptr, _ in fake.scratch}) == 1
    assert {size for _, size in fake.scratch} == ({None} if version.startswith("8.") else {4096})
    widths = {shape[3] for g, p, inputs in fake.bound if g.startswith("layer_") and p == 1
              for shape in [inputs["past_key"][1]]}  # (rows, nh, hd, W)
    assert widths == {PAGE, 2 * PAGE}
    assert gen.engine.cache.resizes > 0
    gen.close()


def test_greedy_rows_take_their_argmax_on_the_device(artifact_dir, generator, tmp_path, fake_gpu):
    """generate without a streamer asks for the rows' argmax: the engines' logits stay on the
    device and the ids come back from steps and verify passes, the tokens those of ONNX Runtime's
    logits (plain and lossless)."""
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    picks = Picks(gen.backend)
    try:
        for options in (dict(speedup=2), dict(speedup=3, lossless=True)):
            want = generator.generate(PROMPTS, LONG, ignore_eos=True, **options)
            got = gen.generate(PROMPTS, LONG, ignore_eos=True, **options)
            assert got.token_ids == want.token_ids
        assert got.stats.verify_passes > 0
        # (R,) ids from a step and (n, T) from a pass, never logits
        came = {(call, asked, kind, len(shape)) for call, asked, kind, shape in picks.calls}
        assert came == {("decode", True, "i", 1), ("verify", True, "i", 2)}, came
    finally:
        gen.close()


def test_a_verify_pass_runs_the_head_over_max_batch_positions_at_once(artifact_dir, generator, tmp_path,
                                                                     fake_gpu):
    """A lossless pass's head runs over its positions as rows of up to max_batch, so n rows of T
    positions take ceil(n T / max_batch) head runs, not T, and give ONNX Runtime's tokens and
    logits (streamed: the logits path) and ids (greedy)."""
    fake = fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    try:
        backend, rng = gen.backend, np.random.default_rng(0)
        hidden = rng.standard_normal((3, 5, generator.backend.manifest.model.hidden_size)).astype(np.float32)
        rows = np.array([0, 2])
        before = len(fake.executions)
        got = backend.head_all(hidden, rows)  # (2, 5, V): 10 positions, max_batch 4 a run
        assert [g for g, _ in fake.executions[before:]] == ["head"] * 3
        np.testing.assert_allclose(got, generator.backend.head_all(hidden, rows), atol=1e-5, rtol=1e-5)

        # streamed (the logits path): the same tokens (when drafting starts follows measured times, so
        # the steps may differ between two runs)
        options = dict(speedup=3, lossless=True, ignore_eos=True)
        got, want = run(gen, LONG, **options)[0], run(generator, LONG, **options)[0]
        assert got.token_ids == want.token_ids and got.stats.verify_passes > 0
    finally:
        gen.close()
    # batch 1 on engines of max_batch 17 (a pass's most positions, lossless.plan.DRAFT_MAX + 1): every
    # pass's head in one run
    gen = load(artifact_dir, build(artifact_dir, tmp_path / "wide", max_batch=17), max_batch=17)
    try:
        want = generator.generate(PROMPTS[:1], LONG, **options)
        before = len(fake.executions)
        alone = gen.generate(PROMPTS[:1], LONG, **options)
        assert alone.token_ids == want.token_ids and alone.stats.verify_passes > 0
        heads = sum(g == "head" for g, _ in fake.executions[before:])
        # one head run after the prefill, then one a decode step and one a verify pass
        assert heads == 1 + alone.stats.decode_calls, (heads, alone.stats.decode_calls)
    finally:
        gen.close()


def test_rows_with_their_own_budgets_match_onnxruntime(artifact_dir, generator, tmp_path, fake_gpu):
    """Requests from threads, with different speedups, joining a running batch at different steps:
    each row's tokens and layers per step equal the ONNX Runtime backend's for the request alone
    (rows a layer skips keep their hidden state and K/V; each row's K/V go to its own positions)."""
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    calls = [(PROMPTS[:2], 2), (PROMPTS[2:], None), (PROMPTS[1:2], 3)]
    expected = [generator.generate(p, LONG, speedup=s, ignore_eos=True) for p, s in calls]
    results = [None] * len(calls)
    first_event = threading.Event()

    def call(k):
        prompts, speedup = calls[k]
        stream = gen.stream(prompts, LONG, speedup=speedup, ignore_eos=True)
        for _ in stream:
            first_event.set()  # the later calls join a batch that is already decoding
        results[k] = stream.result

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    assert first_event.wait(60)
    threads += [threading.Thread(target=call, args=(k,)) for k in (1, 2)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    for got, want in zip(results, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.stats.layers_per_step == want.stats.layers_per_step
    assert any(len(set(s.engine_layers)) > len(set(s.layers)) for r in results for s in r.stats.steps), \
        "no step ran a layer for some rows only: the test does not exercise per-row updates"
    gen.close()


def test_profiles_follow_the_phase(artifact_dir, tmp_path, fake_gpu):
    fake = fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    result = gen.generate(PROMPTS, NEW, ignore_eos=True)
    for i in range(gen.num_layers):
        name = f"layer_{i:02d}"
        # every decode step also fits the prefill profile; the layer asks for decode's
        assert [p for g, p in fake.switches if g == name] == [0, 1]
        runs = [p for g, p in fake.executions if g == name]
        assert runs == [0] + [1] * (len(runs) - 1) and len(runs) == 1 + len(result.stats.steps)
    assert [p for g, p in fake.switches if g == "head"] == [0]  # one position always fits profile 0
    # The embedding gets the layers' mask, the bound past (one page of 32) and the new positions:
    # the prompt at prefill, one token at decode. Both fit profile 0, where it stays (no phase asked).
    widths = [inputs["attention_mask"][1][1] for g, _, inputs in fake.bound if g == "embed"]
    assert widths == [PAGE + result.stats.prompt_tokens] + [PAGE + 1] * len(result.stats.steps)
    assert [p for g, p in fake.switches if g == "embed"] == [0]
    assert [p for g, p in fake.executions if g == "embed"] == [0] * (1 + len(result.stats.steps))


def test_past_is_bound_in_place(artifact_dir, tmp_path, fake_gpu):
    """Every layer binds its block of rows of the cache's K/V buffers in place: the engine gets the
    buffer's address at the block's first row and the block's shape at the current width (no copy,
    no concat). A request joining a decoding one prefills its rows (after the decoding ones) the
    same way; within a width the buffers never move (a new width re-lays them)."""
    fake = fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    backend, cache, L = gen.backend, gen.engine.cache, gen.num_layers
    storage = backend.storage
    assert cache.storage is storage and isinstance(storage, StreamStorage)
    assert [tuple(storage.keys[0].shape), tuple(storage.values[0].shape)] == [(4, 4, 8, PAGE), (4, 4, PAGE, 8)]
    assert len({t.data_ptr() for t in [*storage.keys, *storage.values]}) == 2 * L
    calls = []

    class Spy(SpyBackend):  # its decode runs the default step through this layer
        def layer(self, index, hidden, mask, past_key, past_value):
            rows = hidden.shape[0]
            start = 0 if cache.used == cache.decoding else cache.decoding  # decode, or the joining block
            row_bytes = storage.keys[index][0].numel() * storage.keys[index].element_size()
            expected = (storage.keys[index].data_ptr() + start * row_bytes,
                        storage.values[index].data_ptr() + start * row_bytes)
            if not cache.length[start:start + rows].any():  # a first chunk: one page of zeros
                expected = (storage.zeros_flat.data_ptr(),) * 2
            out = backend.layer(index, hidden, mask, past_key, past_value)
            calls.append((index, start, rows, cache.bound(start, start + rows), expected, len(fake.bound)))
            return out

    gen.engine.backend = Spy(backend)
    policy = {"max_layers": L, "min_layers": 2, "warmup_layers": 1}
    with gen.stepper() as stepper:
        first = stepper.add(PROMPTS, LONG, ignore_eos=True, policy=policy)
        stepper.step()
        joining = stepper.add(PROMPTS[1], NEW, ignore_eos=True, policy=policy)
        while not stepper.done:
            stepper.step()
    assert first.result is not None and joining.result is not None
    layer_runs = [b for b in fake.bound if b[0].startswith("layer_")]
    assert len(calls) == len(layer_runs)
    starts, widths, addresses = set(), set(), {}
    for index, start, rows, width, (key_ptr, value_ptr), n in calls:
        graph, profile, inputs = fake.bound[n - 1]  # what this very call bound
        assert graph == f"layer_{index:02d}"
        assert inputs["past_key"] == (key_ptr, (rows, 4, 8, width))
        assert inputs["past_value"] == (value_ptr, (rows, 4, width, 8))
        starts.add(start)
        widths.add(width)
        if start == 0 and profile == 1:  # decode: one address per layer while the width holds
            previous = addresses.setdefault(index, (width, key_ptr))
            assert previous[0] != width or previous[1] == key_ptr
            addresses[index] = (width, key_ptr)
    assert starts == {0, len(PROMPTS)} and widths == {PAGE, 2 * PAGE}  # a block after the decoding rows
    assert cache.resizes >= 1


def test_layer_calls_match_onnxruntime_buffers(artifact_dir, tmp_path, fake_gpu):
    """Backend calls straight, each backend on its own KV cache (TensorRT's StreamStorage, ONNX
    Runtime's numpy one), against each other: a row prefilled over two chunks, then a joining block
    of two rows, then decode steps where some rows skip the layer, across a width change and a row
    leaving from the middle. Outputs and the whole K/V buffers agree after every call, so only the
    updated rows' new positions were written, moves and re-lays match, and skipped rows kept their
    hidden state."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path), max_batch=3)
    trt, manifest = gen.backend, gen.manifest
    ort = OnnxRuntimeBackend(artifact_dir, manifest, threads=1)
    caches = [KVCache(StreamStorage(trt), 4, LIMITS["max_seq"], PAGE),
              KVCache(ort.kv_storage(), 4, LIMITS["max_seq"], PAGE)]
    rng = np.random.default_rng(0)
    layers = (0, 3)

    class Row:
        row = -1

    def same_buffers():
        for mine, theirs in zip(caches[0].storage.keys + caches[0].storage.values,
                                caches[1].storage.keys + caches[1].storage.values, strict=True):
            np.testing.assert_allclose(mine.numpy(), theirs, atol=1e-5, rtol=1e-5)

    def step(start, stop, new, updates=None):
        """Layers 0 and 3 over rows [start, stop) of both caches: ``new`` (R, T) their new mask."""
        hidden = rng.standard_normal((stop - start, new.shape[1], 32)).astype(np.float32)
        for k, index in enumerate(layers):
            update = None if updates is None else updates[k]
            got = []
            for backend, cache in zip((trt, ort), caches):
                cache.reserve(start, stop, new.shape[1])
                mask = cache.mask(start, stop, new)
                out = run_layers(backend, cache, start, stop - start, hidden, mask, [index],
                                 None if update is None else [update])
                # TensorRT's output is a buffer the next call reuses: copied
                got.append(out.numpy().copy() if backend is trt else np.array(out))
            np.testing.assert_allclose(got[0], got[1], atol=1e-5, rtol=1e-5)
            same_buffers()
            if update is not None:  # skipped rows pass through
                np.testing.assert_array_equal(got[0][~update], hidden[~update])
            hidden = got[1]
        for cache in caches:
            cache.advance(start, stop, new)

    owners = [[Row() for _ in range(3)] for _ in caches]
    for cache, rows in zip(caches, owners):
        cache.seat(rows[:1])
    step(0, 1, np.ones((1, 16), np.int64))  # row 0's prompt: two chunks, 31 positions
    step(0, 1, np.ones((1, 15), np.int64))
    for cache, rows in zip(caches, owners):
        cache.promote()
        assert cache.seat(rows[1:]) == range(1, 3)
    step(1, 3, np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int64))  # a joining block, its row 1 left padded
    for cache in caches:
        cache.promote()
    assert caches[0].width == PAGE
    updates = [[np.array([True, False, True]), np.array([True, False, True])],
               [np.array([True, True, False]), np.array([False, True, True])]]
    for update in updates:  # row 0 goes past the first page at the second step
        step(0, 3, np.ones((3, 1), np.int64), update)
    assert caches[0].width == caches[1].width == 2 * PAGE and caches[0].resizes == caches[1].resizes == 1
    for cache, rows in zip(caches, owners):
        cache.release(rows[1].row)  # from the middle: the last row moves into its place
    assert caches[0].moves == caches[1].moves == 1
    same_buffers()
    step(0, 2, np.ones((2, 1), np.int64), [np.array([True, False]), np.array([True, True])])
    assert not caches[0].storage.keys[3][3:].any()  # the row never seated was never written
    ort.close()
    gen.close()


def test_limits(artifact_dir, tmp_path, fake_gpu, generator):
    fake_gpu()
    engines = build(artifact_dir, tmp_path)
    with pytest.raises(EngineLimitError, match=r"max_batch 8 \(KV rows\) exceeds max_batch 4 of the engines "
                                               r"in .*; load with runtime.load\(..., max_batch=4\), or "
                                               r"rebuild the engines with .* --max-batch 8`"):
        load(artifact_dir, engines, max_batch=8)
    # max_length is checked against max_seq itself, not the whole pages the profiles bind
    short = build(artifact_dir, tmp_path / "short", max_seq=48)
    with pytest.raises(EngineLimitError, match=r"max_length 49 \(prompt \+ new tokens per row\) exceeds max_seq "
                                               r"48 of the engines in .*; load with runtime.load\(..., "
                                               r"max_length=48\), or rebuild .* --max-seq 49`") as info:
        load(artifact_dir, short, max_length=49)
    assert isinstance(info.value, SkipDecodeError)
    gen = load(artifact_dir, engines)
    long_prompt = next(p for p in (" ".join(["Hello"] * n) for n in range(1, 30))
                       if len(gen.tokenizer(p)["input_ids"]) == 20)  # over max_prompt 16, under max_seq
    ids = np.ones((1, 20), np.int64)
    with pytest.raises(EngineLimitError, match=r"prompt of 20 tokens \(padded\) exceeds max_prompt 16"):
        gen.backend.embed(ids, ids)  # one graph call takes at most max_prompt tokens...
    # ...so the engine runs a longer prompt in chunks of at most that (16 + 4), as ONNX Runtime would whole
    assert gen.generate(long_prompt, 6, ignore_eos=True).token_ids == \
        generator.generate(long_prompt, 6, ignore_eos=True).token_ids
    gen.close()


def test_load_defaults_to_the_engines_limits(artifact_dir, tmp_path, fake_gpu):
    """Without max_batch / max_length, a Generator takes what the engines were built for."""
    fake_gpu()
    gen = runtime.load(artifact_dir, backend="tensorrt", engine_dir=build(artifact_dir, tmp_path))
    assert (gen.max_batch, gen.max_length) == (LIMITS["max_batch"], LIMITS["max_seq"])
    assert gen.generate(PROMPTS, 2).token_ids
    gen.close()


def test_widths_and_layer_preconditions(artifact_dir, tmp_path, fake_gpu):
    """The cache binds whole pages up to the capacity (the engines' max_seq in pages) and refuses
    more; a layer call whose mask is wider than the engines were built for is refused."""
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path), max_batch=2)
    backend = gen.backend
    cache = KVCache(StreamStorage(backend), 2, LIMITS["max_seq"], PAGE)
    assert cache.capacity == 64 and cache.max_rows == 2
    cache.seat([type("Row", (), {"row": -1})()])
    widths = []
    for n in (0, 1, 32, 33, 48, 64, 1):
        cache.reserve(0, 1, n)
        widths.append(cache.width)
        assert tuple(cache.storage.keys[0].shape) == (2, 4, 8, cache.width)  # exactly the width
    assert widths == [32, 32, 32, 64, 64, 64, 32]
    with pytest.raises(ValueError, match="rows would hold 65 positions, past the KV capacity 64"):
        cache.reserve(0, 1, 65)
    hidden = np.zeros((2, 1, 32), np.float32)
    past_key, past_value = (backend._device.torch.zeros(shape) for shape in [(2, 4, 8, 96), (2, 4, 96, 8)])
    with pytest.raises(EngineLimitError, match=r"attention mask of 2 x 97 exceeds the engines' limits \(4 x 80\)"):
        backend.layer(0, hidden, np.ones((2, 97), np.int64), past_key, past_value)
    gen.close()


def test_io_names_checked_at_load(artifact_dir, tmp_path, fake_gpu):
    fake_gpu(rename={"new_key": "new_k"})
    engines = build(artifact_dir, tmp_path)
    with pytest.raises(ArtifactError) as info:
        load(artifact_dir, engines)
    assert str(info.value) == (
        f"{engines / 'layer_00.plan'} has inputs ['attention_mask', 'hidden_states', 'past_key', "
        f"'past_value'] and outputs ['hidden_states_out', 'new_k', 'new_value'], but the "
        f"artifact manifest says ['hidden_states', 'attention_mask', 'past_key', 'past_value'] and "
        f"['hidden_states_out', 'new_key', 'new_value'] for layer_00: engines and artifact come "
        f"from different exports; rebuild with `python -m engines build {artifact_dir}`")


def test_engines_of_another_tensorrt_version(artifact_dir, tmp_path, fake_gpu):
    fake_gpu("10.3.0")
    engines = build(artifact_dir, tmp_path, version="8.6.2.3")
    with pytest.raises(EngineMismatchError) as info:
        load(artifact_dir, engines)
    assert str(info.value) == (
        f"the engines in {engines} were built with TensorRT 8.6.2.3, but this is TensorRT 10.3.0: a "
        f"TensorRT plan loads only in the version that built it; rebuild with "
        f"`python -m engines build {artifact_dir}`")


def test_engines_of_another_gpu(artifact_dir, tmp_path, fake_gpu):
    fake_gpu(device=DeviceInfo("NVIDIA GeForce RTX 4090", "8.9"))
    engines = build(artifact_dir, tmp_path)
    with pytest.raises(EngineMismatchError, match=r"were built for Orin \(compute capability 8.7\), but this "
                                                  r"GPU is NVIDIA GeForce RTX 4090 \(compute capability 8.9\)"):
        load(artifact_dir, engines)


def test_no_engines_built(artifact_dir, tmp_path, fake_gpu):
    fake_gpu()
    with pytest.raises(EngineMismatchError, match="has no engines.json: no TensorRT engines were built there"):
        load(artifact_dir, tmp_path / "none")


def test_tampered_plan(artifact_dir, tmp_path, fake_gpu):
    fake_gpu()
    engines = build(artifact_dir, tmp_path)
    plan = engines / "layer_03.plan"
    plan.write_bytes(plan.read_bytes().replace(b'"fake_plan": 1', b'"fake_plan": 2'))
    with pytest.raises(EngineMismatchError, match="layer_03.plan does not match its sha256 in engines.json"):
        load(artifact_dir, engines)


def test_cuda_graphs_not_implemented(artifact_dir, tmp_path, fake_gpu):
    fake_gpu()
    engines = build(artifact_dir, tmp_path)
    with pytest.raises(CudaGraphsNotImplementedError, match="cuda_graphs=True is not implemented for the TensorRT"):
        runtime.load(artifact_dir, backend="tensorrt", engine_dir=engines, cuda_graphs=True)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt(artifact_dir):
    with pytest.raises(TensorRTMissingError) as info:
        runtime.load(artifact_dir, backend="tensorrt")
    assert str(info.value).startswith("TensorRT is not installed in this Python environment")
    assert "JetPack" in str(info.value)


def test_check_engine_io_ignores_order(artifact_dir):
    spec = load_manifest(artifact_dir, check_hashes=False).layers[0]
    io = {"new_value": ("output", "FLOAT"), "past_value": ("input", "FLOAT"),
          "hidden_states_out": ("output", "FLOAT"), "new_key": ("output", "FLOAT"),
          "attention_mask": ("input", "INT32"), "hidden_states": ("input", "FLOAT"),
          "past_key": ("input", "FLOAT")}
    check_engine_io(spec, io, "x.plan", "A")
    io["past_key"] = ("output", "FLOAT")
    with pytest.raises(ArtifactError, match="x.plan has inputs"):
        check_engine_io(spec, io, "x.plan", "A")


def test_context_memory_api():
    assert context_memory_api("8.5.2.2") == context_memory_api("8.6.2.3") == "without_device_memory"
    assert context_memory_api("10.3.0") == context_memory_api("11.0.0") == "strategy"


def test_torch_dtype():
    import torch

    assert [torch_dtype(torch, n) for n in ("FLOAT", "HALF", "INT32", "INT64", "BOOL")] == [
        torch.float32, torch.float16, torch.int32, torch.int64, torch.bool]
    with pytest.raises(ArtifactError, match="TensorRT data type FP8 has no torch equivalent"):
        torch_dtype(torch, "FP8")


def test_real_tensorrt_matches_onnxruntime(artifact_dir, generator, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed here (it cannot be on these machines)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but PyTorch sees no CUDA GPU")
    build_engines(artifact_dir, EngineBuildConfig(**LIMITS, workspace=256 * 1024**2), engine_dir=tmp_path,
                  progress=False, log=print)
    gen = load(artifact_dir, tmp_path)
    for speedup in (None, 2):
        expected, expected_logits = run(generator, LONG, speedup=speedup)
        result, logits = run(gen, LONG, speedup=speedup)
        assert result.token_ids == expected.token_ids
        for got, want in zip(logits, expected_logits, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-3)  # TF32 may be on by default
    gen.close()
