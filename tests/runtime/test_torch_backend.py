"""The PyTorch backend against ONNX Runtime, transformers and the skip-aware reference."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

import runtime
from export.build import BuildOptions, build
from runtime.artifact.manifest import MANIFEST_NAME, file_entry, load_manifest
from runtime.backends.base import run_layers
from runtime.backends.torch import TorchBackend
from runtime.errors import ArtifactError
from runtime.kvcache import KVCache
from runtime.models.opt import CachedOPTLayer, OPTLayer, SkipOPT
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import hf_generate, padded, spying

NEW = 12
LONG = 40  # new tokens that take every prompt past the first page of 32: the width grows to 64
LOGIT_ATOL = 1e-4  # fp32 torch vs fp32 ONNX Runtime, every step (measured ~3e-6)
FP16_LOGIT_ATOL = 5e-2  # fp16 torch CPU vs fp16 ONNX Runtime, first step (measured ~7e-3 on logits ~4)
NO_CUDA = "no CUDA device visible to PyTorch on this machine; the CUDA path runs only on a GPU"
quiet = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def torch_generator(artifact_dir):
    gen = runtime.load(artifact_dir, backend="torch", device="cpu")
    yield gen
    gen.close()


@pytest.fixture
def torch_spy(torch_generator):
    with spying(torch_generator) as spy_backend:
        yield spy_backend


def skip_policies(num_layers):
    return [None, SkipPolicy(num_layers, 5, 2, warmup_layers=1, horizon=NEW - 1),
            SkipPolicy(num_layers, 4, 3, warmup_layers=2, horizon=NEW - 1)]


# -- weights ---------------------------------------------------------------------------------------


def test_weights_come_from_the_graphs(torch_generator, hf_model):
    """Every state_dict entry, including the exporter's Identity-deduplicated ones, is the checkpoint's."""
    ours = torch_generator.backend.hf_model.state_dict()
    theirs = hf_model.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    backend = torch_generator.backend
    embed, lm_head = backend.hf_model.model.decoder.embed_tokens.weight, backend.hf_model.lm_head.weight
    assert lm_head.data_ptr() == embed.data_ptr(), "tied embeddings are loaded once"


def drop_weight(path, name):
    """Remove weight ``name`` from a graph: its initializer, or the Identity node that aliases it."""
    proto = onnx.load(str(path))
    inits = [t for t in proto.graph.initializer if t.name in (name, name + ".T")]  # .T: stored transposed
    if inits:
        proto.graph.initializer.remove(inits[0])
    else:
        node = next(n for n in proto.graph.node if n.op_type == "Identity" and n.output[0] == name)
        proto.graph.node.remove(node)
    onnx.save(proto, str(path))


@pytest.mark.parametrize("name", ["fc1.weight", "k_proj.bias"])  # k_proj.bias is an Identity alias
def test_missing_weight_is_an_artifact_error(artifact_dir, tmp_path, name):
    copy = tmp_path / "artifact"
    shutil.copytree(artifact_dir, copy)
    drop_weight(copy / "layer_02.onnx", name)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["files"]["layer_02.onnx"] = file_entry(copy / "layer_02.onnx")  # a consistent artifact
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy, backend="torch")
    message = str(info.value)
    attn = "self_attn." if name.startswith("k_proj") else ""
    assert f"layer_02.onnx has no weight '{name}' (model.decoder.layers.2.{attn}{name})" in message
    assert "python -m export build" in message


def test_external_data(checkpoint_dir, artifact_dir, tmp_path, torch_generator):
    out = tmp_path / "external"
    manifest = build(BuildOptions(model=str(checkpoint_dir), out=str(out), external_data="never",
                                  progress=False, check=False), **quiet)
    assert manifest.graphs[1].data_file is None  # self-contained; the fixture's share weights.bin
    gen = runtime.load(out, backend="torch")
    ours, theirs = gen.backend.hf_model.state_dict(), torch_generator.backend.hf_model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert gen.generate(PROMPTS, 6).token_ids == torch_generator.generate(PROMPTS, 6).token_ids


# -- the cached layer (the exported graph's math) ------------------------------------------------


@pytest.mark.parametrize("past, new, width", [(0, 5, 4), (4, 3, 4), (3, 2, 8), (7, 1, 8), (7, 1, 16)])
def test_cached_layer_equals_opt_layer(hf_model, past, new, width):
    """CachedOPTLayer over a block of rows W wide, unused positions masked, equals OPTLayer over
    the plain past; it returns only the new positions' K/V."""
    config = hf_model.config
    hf_layer = hf_model.model.decoder.layers[1]
    reference = OPTLayer(hf_layer, config.num_attention_heads, config.do_layer_norm_before)
    ours = CachedOPTLayer(reference)
    g = torch.Generator().manual_seed(past + 100 * width)
    B, nh, hd = 2, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    hidden = torch.randn(B, new, config.hidden_size, generator=g)  # (B, T, D)
    mask = torch.ones(B, past + new, dtype=torch.int64)
    mask[0, :2] = 0  # left padding in row 0
    past_key, past_value = torch.randn(2, B, nh, past, hd, generator=g)  # (B, nh, P, hd) each
    # positions [past, W) hold stale values (what a row's earlier occupant or a moved row left):
    # masked, they must not count
    cached_key = torch.randn(B, nh, hd, width, generator=g) * 3  # (B, nh, hd, W)
    cached_value = torch.randn(B, nh, width, hd, generator=g) * 3  # (B, nh, W, hd)
    cached_key[..., :past] = past_key.transpose(2, 3)
    cached_value[:, :, :past] = past_value
    cached_mask = torch.cat([torch.zeros(B, width, dtype=torch.int64), mask[:, past:]], dim=1)  # (B, W + T)
    cached_mask[:, :past] = mask[:, :past]
    with torch.no_grad():
        want, want_k, want_v = reference(hidden, mask, past_key, past_value)
        got, new_k, new_v = ours(hidden, cached_mask, cached_key, cached_value)
    real = mask[:, past:].bool()  # padded queries attend to nothing real: their output is never used
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert new_k.shape == new_v.shape == (B, nh, new, hd)
    assert torch.equal(new_k, want_k[:, :, past:]) and torch.equal(new_v, want_v[:, :, past:])  # new only


# -- generation ------------------------------------------------------------------------------------


def test_full_depth_batch_equals_onnxruntime_and_transformers(torch_generator, generator, hf_model, tokenizer):
    expected, _ = hf_generate(hf_model, tokenizer, PROMPTS, NEW)
    ours = torch_generator.generate(PROMPTS, NEW)
    assert padded(ours.token_ids, NEW) == expected  # batched, left padded
    assert ours.token_ids == generator.generate(PROMPTS, NEW).token_ids
    assert ours.texts == [tokenizer.decode(t, skip_special_tokens=True) for t in ours.token_ids]


@pytest.mark.parametrize("which", ["full", "speedup2", "policy"])
def test_logits_every_step_match_onnxruntime(torch_generator, generator, which):
    L = torch_generator.num_layers
    kwargs = {"full": {}, "speedup2": {"speedup": 2},
              "policy": {"policy": SkipPolicy(L, 5, 2, warmup_layers=1, horizon=NEW - 1)}}[which]
    ours = list(torch_generator.stream(PROMPTS, NEW, ignore_eos=True, **kwargs))
    theirs = list(generator.stream(PROMPTS, NEW, ignore_eos=True, **kwargs))
    assert len(ours) == len(theirs) == NEW
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a.logits.dtype == np.float32 and a.logits.shape == b.logits.shape
        np.testing.assert_allclose(a.logits, b.logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"step {step}")
        assert a.token_ids == b.token_ids


def test_skip_policies_equal_onnxruntime_and_reference(torch_generator, generator, hf_model, tokenizer, torch_spy):
    L = torch_generator.num_layers
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    for policy in skip_policies(L)[1:] + [torch_generator.policy_for(NEW, speedup=2)]:
        torch_spy.calls.clear()
        expected = SkipOPT(hf_model).greedy(enc["input_ids"], enc["attention_mask"], NEW, policy, eos_token_id=2)
        ours = torch_generator.generate(PROMPTS, NEW, policy=policy)
        assert padded(ours.token_ids, expected.tokens.shape[1]) == expected.tokens.tolist(), policy
        assert ours.token_ids == generator.generate(PROMPTS, NEW, policy=policy).token_ids, policy
        ran = [i for i in torch_spy.calls if isinstance(i, int)]
        assert len(ran) == L + sum(len(s.layers) for s in ours.stats.steps)  # only the active layers


def test_speedup_argument_equals_onnxruntime(torch_generator, generator):
    ours = torch_generator.generate(PROMPTS, 16, speedup=2, ignore_eos=True)
    assert ours.token_ids == generator.generate(PROMPTS, 16, speedup=2, ignore_eos=True).token_ids
    assert 1.7 < ours.stats.layer_reduction < 2.3


# -- the KV cache ----------------------------------------------------------------------------------


def test_kv_buffers_are_preallocated_and_written_in_place(torch_generator, torch_spy, monkeypatch):
    """Buffers of the whole capacity whose addresses never change, not even when the width grows;
    every layer binds a view of its block of rows at the cache's width (no copy), and a step writes
    exactly its new positions."""
    backend, cache = torch_spy.inner, torch_generator.engine.cache
    storage = backend.storage
    m = torch_generator.manifest.model
    assert cache.storage is storage and storage.fixed
    assert cache.capacity == -(-torch_generator.max_length // cache.page) * cache.page
    assert storage.keys[0].shape == (torch_generator.max_batch, m.num_heads, m.head_dim, cache.capacity)
    assert storage.values[0].shape == (torch_generator.max_batch, m.num_heads, cache.capacity, m.head_dim)
    buffers = lambda: [t.data_ptr() for t in storage.keys + storage.values]  # noqa: E731
    pointers = buffers()
    assert len(set(pointers)) == 2 * torch_generator.num_layers
    for t in storage.keys + storage.values:  # earlier tests left K/V behind: start from a known state
        t.fill_(0.375)  # finite (masked positions still enter the products), and no K/V is exactly it
    resizes = cache.resizes
    bound, writes = [], []

    def layer(index, hidden, mask, past_key, past_value):
        rows, T = hidden.shape[0], hidden.shape[1]
        if not cache.length[:rows].any():  # the prompt: its rows hold nothing, one page of zeros
            assert mask.shape == (rows, cache.page + T) and not mask[:, : cache.page].any()
            assert past_key.data_ptr() == storage.zeros_flat.data_ptr() and not past_key.any()
            assert past_key.shape == (rows, m.num_heads, m.head_dim, cache.page)
            return backend.layer(index, hidden, mask, past_key, past_value)
        assert mask.shape == (rows, cache.width + T)
        for view, buffer in ((past_key, storage.keys[index]), (past_value, storage.values[index])):
            # a view of the block at row 0 (one request: it prefills and decodes from row 0), no copy
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert view.data_ptr() == buffer.data_ptr()
        assert past_key.shape == (rows, m.num_heads, m.head_dim, cache.width)
        assert past_value.shape == (rows, m.num_heads, cache.width, m.head_dim)
        bound.append(cache.width)
        return backend.layer(index, hidden, mask, past_key, past_value)

    real_write = storage.write

    def write(index, new_key, new_value, src, dst, positions):
        before_k, before_v = storage.keys[index].clone(), storage.values[index].clone()
        real_write(index, new_key, new_value, src, dst, positions)
        changed_k = (storage.keys[index] != before_k).any(dim=2).any(dim=1).nonzero().tolist()  # [row, pos]
        changed_v = (storage.values[index] != before_v).any(dim=3).any(dim=1).nonzero().tolist()
        writes.append((index, cache.decoding, cache.length.copy(), new_key.shape[2], changed_k, changed_v))

    torch_spy.layer = layer
    monkeypatch.setattr(storage, "write", write)
    result = torch_generator.generate(PROMPTS, LONG, speedup=2, ignore_eos=True)
    assert buffers() == pointers
    assert cache.resizes > resizes and set(bound) == {cache.page, 2 * cache.page}  # the width grew
    prefill = [w for w in writes if w[1] == 0]  # nothing decodes while the one request prefills
    decode = [w for w in writes if w[1] > 0]
    assert len(prefill) == torch_generator.num_layers and len(decode) == len(torch_spy.updates)
    T0 = result.stats.prompt_tokens
    for index, _, lengths, T, changed_k, changed_v in prefill:  # the prompt's positions of its rows
        assert T == T0 and not lengths.any()
        assert sorted(changed_k) == sorted(changed_v) == [[r, p] for r in range(len(PROMPTS)) for p in range(T0)]
    for (index, _, lengths, T, changed_k, changed_v), (layer_index, update) in zip(decode, torch_spy.updates):
        # decode: one position per updated row, at that row's length
        assert index == layer_index and T == 1
        want = [[int(r), int(lengths[r])] for r in np.flatnonzero(update)]
        assert sorted(changed_k) == sorted(changed_v) == want


def test_the_capacity_is_bound_whole_and_no_further(torch_generator):
    """The torch storage is the capacity wide from the start: widths up to the capacity are views
    of the same buffers (the last one is the whole buffer), and the KV cache refuses a position
    past it."""
    backend = TorchBackend.from_model(torch_generator.backend.hf_model)  # the same weights, its own storage
    try:
        cache = KVCache(backend.kv_storage(), 2, 40, 32)  # 40 positions: 2 pages of 32
        storage = backend.storage
        assert cache.capacity == 64 and storage.keys[0].shape[3] == 64
        pointers = [t.data_ptr() for t in storage.keys + storage.values]
        rows = cache.seat([SimpleNamespace(row=-1), SimpleNamespace(row=-1)])
        assert rows == range(0, 2)
        ids = np.full((2, 63), 5, np.int64)
        new = np.ones((2, 63), np.int64)
        cache.reserve(0, 2, 63)
        assert cache.width == 64
        mask = cache.mask(0, 2, new)  # (2, 64 + 63)
        hidden = backend.embed(ids, mask)
        run_layers(backend, cache, 0, 2, hidden, mask, range(len(backend.layers)))
        cache.advance(0, 2, new)
        cache.reserve(0, 2, 1)  # the 64th position: still inside
        key, value = cache.past(0, 0, 2)
        assert key.shape[3] == value.shape[2] == 64 and key.data_ptr() == storage.keys[0].data_ptr()
        assert key.is_contiguous() and value.is_contiguous()  # at the capacity: the whole rows
        with pytest.raises(ValueError, match="rows would hold 65 positions, past the KV capacity 64"):
            cache.reserve(0, 2, 2)
        assert cache.width == 64 and cache.length.tolist() == [63, 63]  # nothing changed
        assert [t.data_ptr() for t in storage.keys + storage.values] == pointers
        assert not torch.isnan(storage.keys[0]).any() and storage.keys[0][:, :, :, :63].abs().sum() > 0
    finally:
        backend.close()


def test_hidden_states_stay_on_the_device(torch_generator):
    backend = torch_generator.backend
    m = torch_generator.manifest.model
    W = 32
    mask = np.concatenate([np.zeros((1, W), np.int64), np.ones((1, 2), np.int64)], axis=1)  # no valid past
    hidden = backend.embed(np.array([[5, 6]], np.int64), mask)
    assert isinstance(hidden, torch.Tensor) and hidden.device == backend.device and hidden.shape == (1, 2, 32)
    past_key = torch.zeros(1, m.num_heads, m.head_dim, W, dtype=backend.dtype, device=backend.device)
    past_value = torch.zeros(1, m.num_heads, W, m.head_dim, dtype=backend.dtype, device=backend.device)
    hidden, new_key, new_value = backend.layer(0, hidden, mask, past_key, past_value)
    assert isinstance(hidden, torch.Tensor) and hidden.device == backend.device
    assert isinstance(new_key, torch.Tensor)
    assert new_key.shape == new_value.shape == (1, m.num_heads, 2, m.head_dim)  # (B, nh, T, hd): the new only
    logits = backend.head(hidden)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, 512)


# -- loading, options, fp16 ------------------------------------------------------------------------


def test_generate_from_a_directory(artifact_dir, torch_generator):
    by_dir = runtime.generate(artifact_dir, PROMPTS, max_new_tokens=6, speedup=2, backend="torch", device="cpu")
    assert by_dir.token_ids == torch_generator.generate(PROMPTS, 6, speedup=2).token_ids


def test_threads_sets_torch_threads(artifact_dir):
    before = torch.get_num_threads()
    try:
        runtime.load(artifact_dir, backend="torch", threads=1, check_hashes=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)



@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_says_so(artifact_dir):
    with pytest.raises(ValueError, match="no CUDA device is visible to PyTorch .* use device='cpu'"):
        runtime.load(artifact_dir, backend="torch", device="cuda", check_hashes=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("policy", [0, 1, 2])
def test_cuda_equals_cpu(artifact_dir, torch_generator, policy):
    gen = runtime.load(artifact_dir, backend="torch", device="cuda", check_hashes=False)
    try:
        chosen = skip_policies(gen.num_layers)[policy]
        ours = list(gen.stream(PROMPTS, NEW, policy=chosen, ignore_eos=True))
        cpu = list(torch_generator.stream(PROMPTS, NEW, policy=chosen, ignore_eos=True))
        assert all(k.device.type == "cuda" for k in gen.backend.storage.keys)
        for step, (a, b) in enumerate(zip(ours, cpu)):
            np.testing.assert_allclose(a.logits, b.logits, atol=LOGIT_ATOL, rtol=0, err_msg=f"step {step}")
            assert a.token_ids == b.token_ids
    finally:
        gen.close()


@pytest.mark.filterwarnings("ignore:this float16 artifact runs on ONNX Runtime's CPU provider")
def test_fp16_matches_onnxruntime_fp16(fp16_artifact_dir):
    ours = runtime.load(fp16_artifact_dir, backend="torch")
    theirs = runtime.load(fp16_artifact_dir, threads=1)
    try:
        assert load_manifest(fp16_artifact_dir).dtype == "float16"
        assert ours.backend.hf_model.lm_head.weight.dtype == torch.float16
        a = next(iter(ours.stream(PROMPTS, 1))).logits
        b = next(iter(theirs.stream(PROMPTS, 1))).logits
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=FP16_LOGIT_ATOL, rtol=0)
        steps = list(ours.stream(PROMPTS, NEW, speedup=2, ignore_eos=True))
        assert all(np.isfinite(e.logits).all() for e in steps)  # left padding stays finite in fp16
    finally:
        ours.close()
        theirs.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_fp16_cuda_matches_onnxruntime_fp16(fp16_artifact_dir):
    ours = TorchBackend(fp16_artifact_dir, load_manifest(fp16_artifact_dir), device="cuda")
    theirs = runtime.load(fp16_artifact_dir, threads=1)
    try:
        ids = theirs.tokenizer(PROMPTS, padding=True, return_tensors="np")
        ids, mask = ids["input_ids"].astype(np.int64), ids["attention_mask"].astype(np.int64)
        B, T = ids.shape
        cache = KVCache(ours.kv_storage(), B, T + 1, theirs.manifest.page_size)
        cache.seat([SimpleNamespace(row=-1) for _ in range(B)])
        cache.reserve(0, B, T)
        mask = cache.mask(0, B, mask)  # (B, W + T): nothing valid in the past
        hidden = ours.embed(ids, mask)
        hidden = run_layers(ours, cache, 0, B, hidden, mask, range(len(ours.layers)))
        a = ours.head(hidden)
        b = next(iter(theirs.stream(PROMPTS, 1))).logits
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=FP16_LOGIT_ATOL, rtol=0)
    finally:
        ours.close()
        theirs.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_logits_come_back_through_pinned_memory_whole_and_owned():
    from runtime.backends.torch import to_host

    logits = torch.randn(8, 1000, device="cuda")  # (R, V)
    first = to_host(logits)
    want = logits.cpu().numpy()
    logits.add_(1.0)
    second = to_host(logits)  # a later step's copy must not land in the array the engine still holds
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, want + np.float32(1.0))
