"""The PyTorch backend against ONNX Runtime, transformers and the skip-aware reference."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

import runtime
from export.build import BuildOptions, build
from runtime.backends.torch import TorchBackend
from runtime.modeling import OPTLayer, PagedOPTLayer, SkipOPT
from runtime.errors import ArtifactError
from runtime.manifest import MANIFEST_NAME, file_entry, load_manifest
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS
from tests.runtime.test_generate import hf_generate, padded, spying

NEW = 12
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


# -- the paged layer (the exported graph's math) -------------------------------------------------


@pytest.mark.parametrize("past, new, page", [(0, 5, 4), (4, 3, 4), (7, 1, 2), (7, 1, 16)])
def test_paged_layer_equals_opt_layer(hf_model, past, new, page):
    """PagedOPTLayer over a paged past, unused positions masked, equals OPTLayer over the plain past."""
    config = hf_model.config
    hf_layer = hf_model.model.decoder.layers[1]
    reference = OPTLayer(hf_layer, config.num_attention_heads, config.do_layer_norm_before)
    ours = PagedOPTLayer(reference)
    g = torch.Generator().manual_seed(past)
    B, nh, hd = 2, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    hidden = torch.randn(B, new, config.hidden_size, generator=g)  # (B, T, D)
    mask = torch.ones(B, past + new, dtype=torch.int64)
    mask[0, :2] = 0  # left padding in row 0
    past_key, past_value = torch.randn(2, B, nh, past, hd, generator=g)  # (B, nh, P, hd) each
    pages = max(1, -(-past // page))
    # unused positions hold stale values (as a slot's earlier row leaves them): masked, they must not count
    paged_key = torch.randn(pages * page, B, nh, hd, generator=g) * 3
    paged_value = torch.randn(pages * page, B, nh, hd, generator=g) * 3
    paged_key[:past], paged_value[:past] = past_key.permute(2, 0, 1, 3), past_value.permute(2, 0, 1, 3)
    paged_key = paged_key.view(pages, page, B, nh, hd).permute(0, 2, 3, 4, 1)  # (n, B, nh, hd, page)
    paged_value = paged_value.view(pages, page, B, nh, hd).permute(0, 2, 3, 1, 4)  # (n, B, nh, page, hd)
    paged_mask = torch.cat([torch.zeros(B, pages * page, dtype=torch.int64), mask[:, past:]], dim=1)
    paged_mask[:, :past] = mask[:, :past]
    with torch.no_grad():
        want, want_k, want_v = reference(hidden, mask, past_key, past_value)
        got, new_k, new_v = ours(hidden, paged_mask, paged_key, paged_value)
    real = mask[:, past:].bool()  # padded queries attend to nothing real: their output is never used
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
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
    assert 1.7 < ours.stats.theoretical_speedup < 2.3


# -- the KV cache ----------------------------------------------------------------------------------


def test_kv_buffers_are_preallocated_and_written_in_place(torch_generator, torch_spy):
    """Addresses never change, a step writes exactly its new position, and the past is never copied."""
    backend = torch_spy.inner
    m = torch_generator.manifest.model
    pointers = {(k.data_ptr(), v.data_ptr()) for k, v in zip(backend.keys, backend.values)}
    assert backend.keys[0].shape == (torch_generator.max_batch, m.num_heads, torch_generator.max_length, m.head_dim)
    seen = []
    for k in backend.keys:  # earlier tests left these very K/V behind: start from a known state
        k.fill_(float("nan"))

    def layer(index, hidden, mask, slots, positions, update=None):
        before = backend.keys[index].clone()
        out = backend.layer(index, hidden, mask, slots, positions, update)
        after = backend.keys[index]
        changed = ((after != before) & ~after.isnan()).any(dim=3).any(dim=1).nonzero().tolist()  # [slot, pos]
        seen.append((index, mask.shape[1] - hidden.shape[1], changed, positions.copy(), update))
        return out

    torch_spy.layer = layer
    result = torch_generator.generate(PROMPTS, NEW, speedup=2, ignore_eos=True)
    assert {(k.data_ptr(), v.data_ptr()) for k, v in zip(backend.keys, backend.values)} == pointers
    T0 = result.stats.prompt_tokens
    for index, past, changed, positions, update in seen:
        if past == 0:  # prefill: the prompt's positions of the request's rows
            assert {p for _, p in changed} <= set(range(T0))
        else:  # decode: one position per updated row, at that row's length
            rows = np.flatnonzero(update)
            assert sorted(changed) == sorted([int(s), int(positions[s])] for s in rows)


def test_layer_checks_its_inputs(torch_generator):
    backend = torch_generator.backend
    S = backend.slots
    hidden = np.zeros((S, 1, 32), np.float32)
    with pytest.raises(ValueError, match=r"a decode step \(past 4\) runs every slot in order; got slots \[0\]"):
        backend.layer(0, hidden[:1], np.ones((1, 5), np.int64), np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match=f"positions up to {backend.capacity + 1} exceed the capacity "
                                         f"{backend.capacity} given to allocate"):
        backend.layer(0, hidden, np.ones((S, 5), np.int64), np.arange(S), np.full(S, backend.capacity))


def test_hidden_states_stay_on_the_device(torch_generator):
    backend = torch_generator.backend
    hidden = backend.embed(np.array([[5, 6]], np.int64), np.ones((1, 2), np.int64))
    assert isinstance(hidden, torch.Tensor) and hidden.device == backend.device and hidden.shape == (1, 2, 32)
    hidden = backend.layer(0, hidden, np.ones((1, 2), np.int64), np.array([0]), np.array([0]))
    assert isinstance(hidden, torch.Tensor)
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
        assert all(k.device.type == "cuda" for k in gen.backend.keys)
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
        ours.allocate(len(PROMPTS), ids.shape[1] + 1)
        hidden = ours.embed(ids, mask)
        slots, zeros = np.arange(len(PROMPTS)), np.zeros(len(PROMPTS), np.int64)
        for i in range(len(ours.layers)):
            hidden = ours.layer(i, hidden, mask, slots, zeros)
        a = ours.head(hidden)
        b = next(iter(theirs.stream(PROMPTS, 1))).logits
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=FP16_LOGIT_ATOL, rtol=0)
    finally:
        ours.close()
        theirs.close()
