"""Llama-family checkpoints (Llama 3.x, SmolLM2, Qwen2.5, Qwen3) exported, verified and decoded like
OPT: per-layer graphs on the same contract with the K/V of the KV heads only, greedy full depth
equal to transformers' generate on every backend, and a policy run calling exactly its layers."""

import json

import numpy as np
import pytest
import torch

import runtime
from export.build import BuildOptions, build
from export.verify import verify
from runtime.errors import UnsupportedModelError
from runtime.models import skip_model
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS, first_logits
from tests.families import VARIANTS, save_tiny_checkpoint, tiny_model
from tests.runtime.test_generate import padded, policy_calls, spying
from tests.runtime.test_tensorrt_backend import fake_gpu  # noqa: F401  (a fixture)

NEW = 12
QUIET = dict(progress=False)


def _build(tmp_path_factory, variant, checkpoint=None, **options):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp(f"{variant}-ckpt"), variant, **(checkpoint or {}))
    out = tmp_path_factory.mktemp(f"{variant}-artifact") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), **QUIET, **options), log=lambda *_: None)
    return ckpt, out


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """(variant, checkpoint dir, fp32 artifact dir)."""
    return (request.param, *_build(tmp_path_factory, request.param))


def _hf(variant, ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    return model, tok


def _hf_generate(model, tok, prompts=PROMPTS, new=NEW):
    enc = tok(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=1, eos_token_id=2,
                             output_logits=True, return_dict_in_generate=True)
    return enc, out.sequences[:, enc["input_ids"].shape[1]:].tolist(), out.logits


def test_manifest_records_family_and_kv_heads(exported):
    variant, ckpt, art = exported
    m = json.loads((art / "manifest.json").read_text())
    config = tiny_model(variant).config
    nkv = config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert m["model"]["architecture"] == {"llama3": "llama", "smollm2": "llama"}.get(variant, variant)
    assert (m["model"]["num_kv_heads"], m["model"]["head_dim"]) == (nkv, hd)
    layer = next(g for g in m["graphs"] if g["name"] == "layer_00")
    dims = {t["name"]: t["dims"] for t in [*layer["inputs"], *layer["outputs"]]}
    assert dims["past_key"] == ["batch", nkv, hd, "past_sequence"]
    assert dims["new_value"] == ["batch", nkv, "sequence", hd]
    assert [t["name"] for t in layer["inputs"]] == ["hidden_states", "attention_mask", "past_key", "past_value"]


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_full_depth_equals_transformers_generate(exported, backend):
    variant, ckpt, art = exported
    model, tok = _hf(variant, ckpt)
    _, expected, hf_logits = _hf_generate(model, tok)
    gen = runtime.load(art, backend=backend, threads=1)
    try:
        stream = gen.stream(PROMPTS, NEW)
        logits = [event.logits for event in stream]
        assert padded(stream.result.token_ids, NEW) == expected
        running = [len(t) for t in stream.result.token_ids]  # a row that emitted EOS stops here, not in transformers
        for step, (a, b) in enumerate(zip(logits, hf_logits)):
            rows = [r for r, n in enumerate(running) if step < n]
            np.testing.assert_allclose(a[rows], b.numpy()[rows], atol=1e-4, rtol=0, err_msg=f"step {step}")
    finally:
        gen.close()


def test_policy_run_calls_exactly_its_active_layers(exported):
    variant, ckpt, art = exported
    model, tok = _hf(variant, ckpt)
    gen = runtime.load(art, threads=1)
    try:
        L = gen.num_layers
        policy = SkipPolicy(L, 4, 2, warmup_layers=1, horizon=NEW - 1)
        enc = tok(PROMPTS, padding=True, return_tensors="pt")
        expected = skip_model(model).greedy(enc["input_ids"], enc["attention_mask"], NEW, policy, eos_token_id=2)
        with spying(gen) as spy:
            result = gen.generate(PROMPTS, NEW, policy=policy)
        assert padded(result.token_ids, expected.tokens.shape[1]) == expected.tokens.tolist()
        assert spy.calls == policy_calls(L, policy, result.stats.new_tokens)
    finally:
        gen.close()


def test_verify_passes_against_transformers(exported):
    variant, ckpt, art = exported
    report = verify(art, prompts=PROMPTS, max_new_tokens=8, log=lambda *_: None, progress=False)
    assert report.passed, "\n".join(report.lines)
    names = {line.split("] ", 1)[1].split(":")[0] for line in report.lines}
    assert {"graphs", "TensorRT 8.6 parser", "TensorRT 10.3 parser", "full depth vs transformers",
            "full depth logits"} <= names, names
    assert any(n.startswith("skip policy") for n in names), names


def test_fp16_export_matches_pytorch_and_decodes(tmp_path_factory):
    _, art = _build(tmp_path_factory, "qwen3", dtype="float16")  # build checks every graph (fp16 tolerances)
    gen = runtime.load(art, threads=1)
    try:
        result = gen.generate(PROMPTS, 6, ignore_eos=True)
        assert all(len(t) == 6 for t in result.token_ids)
    finally:
        gen.close()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weight_only_quantization_decodes_close_to_float(tmp_path_factory, weights):
    shape = dict(hidden_size=64, intermediate_size=96, head_dim=16)  # whole blocks of 16 everywhere
    ckpt, art = _build(tmp_path_factory, "qwen3", checkpoint=shape, weights=weights, block_size=16)
    m = json.loads((art / "manifest.json").read_text())
    assert m["weights"]["layers"] == weights and m["checks"]  # build compared every graph (relative error)
    model, tok = _hf("qwen3", ckpt)
    _, _, hf_logits = _hf_generate(model, tok, new=1)
    gen = runtime.load(art, threads=1)
    try:
        first = first_logits(gen, PROMPTS)
    finally:
        gen.close()
    ref = hf_logits[0].numpy()
    rel = np.linalg.norm(first - ref) / np.linalg.norm(ref)
    # each graph's weights are within QUANT_TOLERANCES (build checked); through 5 layers and the head of random
    # weights the errors add up, yet stay far from what a wrong graph gives (~1)
    assert rel < {"int8": 0.05, "int4": 0.5}[weights]


def test_unsupported_checkpoint_is_refused_before_any_work(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", use_sliding_window=True, sliding_window=8)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="uses sliding-window attention .*; supported: opt, llama"):
        build(BuildOptions(model=str(ckpt), out=str(out), **QUIET), log=lambda *_: None)
    assert not out.exists()


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_is_copied_into_the_artifact_and_read_by_the_runtime(tmp_path):
    from runtime.tokenizer import load_tokenizer

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "smollm2")
    config_path = ckpt / "tokenizer_config.json"  # as older checkpoints ship it: inside the config
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT}))
    out = tmp_path / "art"
    build(BuildOptions(model=str(ckpt), out=str(out), check=False, **QUIET), log=lambda *_: None)
    tok = load_tokenizer(out / "tokenizer", pad_token_id=1)
    assert tok.chat_template == CHAT
    gen = runtime.load(out, threads=1)
    try:
        assert gen.tokenizer.chat_template == CHAT
    finally:
        gen.close()


def test_named_chat_templates_and_none(tmp_path):
    from runtime.tokenizer import read_chat_template

    named = [{"name": "default", "template": CHAT}, {"name": "tool_use", "template": "{{ tools }}"}]
    assert read_chat_template(tmp_path, {"chat_template": named}) == {"default": CHAT, "tool_use": "{{ tools }}"}
    assert read_chat_template(tmp_path, {}) is None


def _run(gen, new, **options):
    stream = gen.stream(PROMPTS, new, ignore_eos=True, **options)
    return stream, [event.logits for event in stream]


@pytest.mark.parametrize("speedup", [None, 2])
def test_iobinding_backend_equals_the_plain_one(exported, speedup):
    """device="cpu": the IOBinding backend's OrtValue KV storage (kv_grids, helper graphs) at the KV heads."""
    _, _, art = exported
    plain, bound = runtime.load(art, threads=1, max_batch=4), runtime.load(art, device="cpu", threads=1, max_batch=4)
    try:
        (a, a_logits), (b, b_logits) = _run(bound, 36, speedup=speedup), _run(plain, 36, speedup=speedup)
        assert a.result.token_ids == b.result.token_ids  # 36 new tokens: the width grows a page
        for x, y in zip(a_logits, b_logits, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    finally:
        plain.close()
        bound.close()


@pytest.mark.parametrize("speedup", [None, 2])
def test_torch_backend_static_steps_equal_onnxruntime(exported, speedup):
    """The step a CUDA graph captures (runtime.models.step: the bias and RoPE tables once a step,
    q/k/v and gate/up as one product, K/V written before one attention product), run eagerly on the
    CPU: ONNX Runtime's tokens, logits within 1e-5, over padded rows and a growing width; and the
    fused products hold no second copy of the weights."""
    from runtime.backends.cuda_graphs import EagerCapture

    _, _, art = exported
    static, cpu = runtime.load(art, backend="torch", max_batch=4), runtime.load(art, threads=1, max_batch=4)
    try:
        static.backend.use_graphs(EagerCapture())
        (a, a_logits), (b, b_logits) = _run(static, 36, speedup=speedup), _run(cpu, 36, speedup=speedup)
        assert a.result.token_ids == b.result.token_ids
        for x, y in zip(a_logits, b_logits, strict=True):
            np.testing.assert_allclose(x, y, atol=5e-5, rtol=0)  # fp32, attention summed in another order (<= 1.6e-5 seen)
        assert static.backend.graphs.steps, "no static step ran"
        layer = static.backend.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.k_proj.weight.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == layer.gate_up_weight.untyped_storage().data_ptr()
    finally:
        static.close()
        cpu.close()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device visible to PyTorch on this machine; the CUDA path runs only on a GPU")
@pytest.mark.parametrize("speedup", [None, 2])
def test_torch_backend_on_cuda_equals_onnxruntime(exported, speedup):
    """The torch backend on a GPU, CUDA graphs on by default, at the KV heads: ONNX Runtime's tokens,
    logits within 1e-4 (fp32 both; cuBLAS and MLAS sum in other orders)."""
    _, _, art = exported
    cuda, cpu = runtime.load(art, backend="torch", device="cuda", max_batch=4), runtime.load(art, threads=1, max_batch=4)
    try:
        (a, a_logits), (b, b_logits) = _run(cuda, 36, speedup=speedup), _run(cpu, 36, speedup=speedup)
        assert a.result.token_ids == b.result.token_ids  # 36 new tokens: the width grows a page
        for x, y in zip(a_logits, b_logits, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
        assert cuda.backend.graphs.steps, "no step was captured"
    finally:
        cuda.close()
        cpu.close()


@pytest.mark.parametrize("flavour", ["trt8.6", "trt10.3"])
def test_tensorrt_backend_equals_onnxruntime(exported, tmp_path, fake_gpu, flavour):
    """Against the fake TensorRT (tests/engines/fakes.py): engines, buffers and KV cache at the KV heads."""
    from tests.runtime.test_tensorrt_backend import FLAVOURS, LONG
    from tests.runtime.test_tensorrt_backend import build as build_engines
    from tests.runtime.test_tensorrt_backend import load as load_engines

    _, _, art = exported
    version, int_dtype = FLAVOURS[flavour]
    fake_gpu(version, int_dtype)
    trt, ort = load_engines(art, build_engines(art, tmp_path, version)), runtime.load(art, threads=1, max_batch=4)
    try:
        (a, a_logits), (b, b_logits) = _run(trt, LONG, speedup=2), _run(ort, LONG, speedup=2)
        assert a.result.token_ids == b.result.token_ids
        for x, y in zip(a_logits, b_logits, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    finally:
        trt.close()
        ort.close()


def test_every_eos_of_the_generation_config_ends_a_row(tmp_path_factory):
    """Llama 3 Instruct names several EOS ids (its chat turn ends on <|eot_id|>, not on the config's
    first): the manifest keeps them all, and a row ends on any of them, as in transformers' generate."""
    from transformers import GenerationConfig

    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("eos-ckpt"), "llama3")
    model, tok = _hf("llama3", ckpt)
    _, free, _ = _hf_generate(model, tok, new=6)
    second = free[0][3]  # row 0's fourth greedy token becomes an EOS id
    assert second != 2 and second not in free[0][:3]
    GenerationConfig(bos_token_id=2, eos_token_id=[2, second], pad_token_id=1).save_pretrained(ckpt)
    out = tmp_path_factory.mktemp("eos-artifact") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), **QUIET), log=lambda *_: None)

    info = json.loads((out / "manifest.json").read_text())["model"]
    assert info["eos_token_id"] == 2 and info["eos_token_ids"] == [2, second]
    gen = runtime.load(out, threads=1)
    try:
        result = gen.generate(PROMPTS, 6)
    finally:
        gen.close()
    assert result.token_ids[0] == free[0][:4] and result.finish_reasons[0] == "eos"
    hf_model, _ = _hf("llama3", ckpt)  # transformers, reading the same generation config
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hf = hf_model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=1)
    assert hf[0, enc["input_ids"].shape[1]:].tolist()[:4] == result.token_ids[0]
