"""The TensorRT backend. TensorRT cannot be installed here, so the backend runs against a fake
``tensorrt`` (tests/engines/fakes.py) whose engines execute the artifact's ONNX graphs with ONNX
Runtime on host pointers: the buffers, KV rotation, profile choice, I/O checks and limits are the
backend's real code, on torch CPU tensors. The test against real TensorRT skips without it."""

import importlib.util

import numpy as np
import pytest

import runtime
from engines.build import build_engines
from engines.config import EngineBuildConfig
from engines.device import DeviceInfo
from engines.errors import EngineLimitError, EngineMismatchError, TensorRTMissingError
from runtime.backends import CacheReleasedError
from runtime.backends import tensorrt as trt_backend
from runtime.backends.tensorrt import (CudaGraphsNotImplementedError, HostDevice, check_engine_io,
                                       context_memory_api, torch_dtype)
from runtime.errors import ArtifactError, SkipDecodeError
from runtime.manifest import load_manifest
from tests.conftest import PROMPTS
from tests.engines.fakes import ORIN, FakeTensorRT, FakeToolchain

LIMITS = dict(max_batch=4, max_seq=32, max_prompt=16)
NEW = 10
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


def load(artifact_dir, engine_dir):
    return runtime.load(artifact_dir, backend="tensorrt", engine_dir=engine_dir)


def run(gen, **kwargs):
    stream = gen.stream(PROMPTS, NEW, **kwargs)
    logits = [event.logits for event in stream]
    return stream.result, logits


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("speedup", [None, 2])
def test_generation_matches_onnxruntime(artifact_dir, generator, tmp_path, fake_gpu, flavour, speedup):
    version, int_dtype = FLAVOURS[flavour]
    fake = fake_gpu(version, int_dtype)
    gen = load(artifact_dir, build(artifact_dir, tmp_path, version))
    expected, expected_logits = run(generator, speedup=speedup)
    result, logits = run(gen, speedup=speedup)
    assert result.token_ids == expected.token_ids and result.texts == expected.texts
    assert result.stats.layers_per_step == expected.stats.layers_per_step
    for got, want in zip(logits, expected_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert fake.context_apis == {context_memory_api(version)}
    # one activation block shared by every context, given the 8.x or the 10.x way
    assert len(fake.scratch) == gen.num_layers + 2 and len({ptr for ptr, _ in fake.scratch}) == 1
    assert {size for _, size in fake.scratch} == ({None} if version.startswith("8.") else {4096})
    gen.close()


def test_profiles_switch_once_per_layer(artifact_dir, tmp_path, fake_gpu):
    fake = fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    result = gen.generate(PROMPTS, NEW, ignore_eos=True)
    L = gen.num_layers
    for i in range(L):
        name = f"layer_{i:02d}"
        assert [p for g, p in fake.switches if g == name] == [0, 1]  # prefill, then decode for good
        runs = [p for g, p in fake.executions if g == name]
        assert runs == [0] + [1] * (len(runs) - 1)
    assert [p for g, p in fake.switches if g == "head"] == [0]  # one position always fits profile 0
    # The embedding has no past input: it stays on the prefill profile while the mask fits it
    # (total <= max_prompt 16), then moves to the decode profile for good.
    prompt = result.stats.prompt_tokens
    totals = [prompt] + [prompt + g + 1 for g in range(len(result.stats.steps))]
    assert [p for g, p in fake.executions if g == "embed"] == [0 if t <= 16 else 1 for t in totals]
    assert max(totals) > 16 and [p for g, p in fake.switches if g == "embed"] == [0, 1]


def test_kv_cache_rotates_without_aliasing(artifact_dir, tmp_path, fake_gpu):
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    backend, L = gen.backend, gen.num_layers
    buffers = [t.data_ptr() for pair in [*backend._kv, backend._spare] for t in pair]
    assert len(set(buffers)) == 2 * (L + 1)  # L layers plus ONE spare pair
    result = gen.generate(PROMPTS, NEW, ignore_eos=True, policy={"max_layers": L, "min_layers": 2,
                                                                  "warmup_layers": 1})
    prompt = result.stats.prompt_tokens
    ran = [set(s.layers) for s in result.stats.steps]
    for i in range(L):
        steps = sum(i in r for r in ran)
        if i in ran[-1]:
            assert backend.cache_length(i) == prompt + steps
        else:
            assert backend.cache_length(i) == 0 and i in backend._released
    after = [t.data_ptr() for pair in [*backend._kv, backend._spare] for t in pair]
    assert sorted(after) == sorted(buffers)  # ownership moved, nothing was allocated or copied
    released = min(backend._released)
    with pytest.raises(CacheReleasedError):
        backend.layer(released, None, None)


def test_backend_reuses_buffers_across_batches(artifact_dir, generator, tmp_path, fake_gpu):
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    gen.generate(PROMPTS, NEW)
    again = gen.generate(PROMPTS[:1], NEW)  # smaller batch: a prefix of the same buffers
    assert again.token_ids == generator.generate(PROMPTS[:1], NEW).token_ids


def test_io_names_checked_at_load(artifact_dir, tmp_path, fake_gpu):
    fake_gpu(rename={"present_key": "present_k"})
    engines = build(artifact_dir, tmp_path)
    with pytest.raises(ArtifactError) as info:
        load(artifact_dir, engines)
    assert str(info.value) == (
        f"{engines / 'layer_00.plan'} has inputs ['attention_mask', 'hidden_states', 'past_key', "
        f"'past_value'] and outputs ['hidden_states_out', 'present_k', 'present_value'], but the "
        f"artifact manifest says ['hidden_states', 'attention_mask', 'past_key', 'past_value'] and "
        f"['hidden_states_out', 'present_key', 'present_value'] for layer_00: engines and artifact come "
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


def test_limits(artifact_dir, tmp_path, fake_gpu):
    fake_gpu()
    gen = load(artifact_dir, build(artifact_dir, tmp_path))
    with pytest.raises(EngineLimitError, match="batch of 5 exceeds max_batch 4 of the engines"):
        gen.generate(["a"] * 5, 2)
    with pytest.raises(EngineLimitError, match=r"prompt \+ max_new_tokens = (\d+) exceeds max_seq 32 of "
                                               r"the engines in .*; shorten the prompt or lower max_new_tokens "
                                               r"by \d+, or rebuild the engines with .* --max-seq \1`") as info:
        gen.generate(PROMPTS, 30)
    long_prompt = next(p for p in (" ".join(["Hello"] * n) for n in range(1, 30))
                       if len(gen.tokenizer(p)["input_ids"]) == 20)  # over max_prompt 16, under max_seq
    with pytest.raises(EngineLimitError, match=r"prompt of \d+ tokens \(padded\) exceeds max_prompt 16"):
        gen.generate(long_prompt, 2)
    assert isinstance(info.value, SkipDecodeError)


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
    io = {"present_value": ("output", "FLOAT"), "past_value": ("input", "FLOAT"),
          "hidden_states_out": ("output", "FLOAT"), "present_key": ("output", "FLOAT"),
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
        expected, expected_logits = run(generator, speedup=speedup)
        result, logits = run(gen, speedup=speedup)
        assert result.token_ids == expected.token_ids
        for got, want in zip(logits, expected_logits, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-3)  # TF32 may be on by default
    gen.close()
