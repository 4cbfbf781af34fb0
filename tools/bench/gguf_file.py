"""A Llama-family transformers checkpoint as an F32 GGUF, laid out as llama.cpp's
``convert_hf_to_gguf.py`` lays it out, and a GGUF's weight bytes per layer and head.

The llama.cpp peer of ``python -m tools.bench`` reads the same checkpoint as every other row: its
converter refuses the random checkpoints' tokenizer ("BPE pre-tokenizer was not recognized"), so
the file is written here with the ``gguf`` package (tests/export/test_gguf.py reads such files
back exactly through export.gguf) and quantized by llama.cpp itself (llamacpp_worker.py).
Imported by path from the worker, in the peer's venv: the ``gguf`` package and numpy only, and
transformers' objects handed in.
"""

from __future__ import annotations

import json

import numpy as np

# transformers' module names -> GGUF's tensor names (llama.cpp's gguf-py/gguf/tensor_mapping.py)
TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
           "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # the model_types written here


def write_checkpoint_gguf(model, tokenizer, path, eot: int | None = None, add_bos: bool | None = None,
                          matrices: str = "F32", embedding: str = "F32", overrides: dict | None = None):
    """``model`` (a Llama-family transformers model) and ``tokenizer`` (byte-level BPE) as a GGUF
    at ``path``: q/k of Llama rows permuted for llama.cpp's RoPE, the tokenizer as tokens, types and
    merges. ``add_bos``: whether llama.cpp prepends the BOS (None: where ``tokenizer`` does, so that
    both give a prompt the same ids; False: the key is left out). ``matrices``, ``embedding``: the
    GGML type of the layers' weight matrices and of the embedding (and an untied head), quantized
    by gguf's own quantizer (Q4_0, Q4_1, Q8_0 ...); norms and biases stay F32. ``overrides``: another
    type for some of the layers' matrices by GGUF name ({"attn_v": "Q6_K", "ffn_down": "Q6_K"}: the
    Q4_K_M mix of llama.cpp's quantizer, which gives some layers those two at Q6_K)."""
    import gguf

    def add(name: str, t: np.ndarray, ggml_type: str = "F32") -> None:
        if ggml_type == "F32":
            w.add_tensor(name, t)
        else:
            qtype = gguf.GGMLQuantizationType[ggml_type]
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)

    c = model.config
    arch = c.model_type
    if arch not in ARCHITECTURES:
        raise ValueError(f"a {arch!r} checkpoint: the GGUF writer knows {', '.join(ARCHITECTURES)}")
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
    # Q4_K and Q5_K alone name no file type (llama.cpp's are the _S/_M mixes): the _S one
    names = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M" if overrides else "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S"}
    w.add_file_type(gguf.LlamaFileType[names.get(matrices, f"MOSTLY_{matrices}")])
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
    if add_bos is None:
        add_bos = tokenizer("a")["input_ids"][:1] == [c.bos_token_id]
    if add_bos:  # llama.cpp adds a BOS only where the file says so
        w.add_add_bos_token(True)
    if eot is not None:
        w.add_eot_token_id(eot)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add("token_embd.weight", weights["model.embed_tokens.weight"], embedding)
    for i in range(c.num_hidden_layers):
        for hf_name, name in TENSORS.items():
            for kind in ("weight", "bias"):
                t = weights.get(f"model.layers.{i}.{hf_name}.{kind}")
                if t is None:
                    continue
                if arch == "llama" and name in ("attn_q", "attn_k"):  # llama.cpp's LlamaModel.permute
                    n = c.num_attention_heads if name == "attn_q" else c.num_key_value_heads
                    t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
                ggml_type = (overrides or {}).get(name, matrices) if t.ndim == 2 else "F32"
                add(f"blk.{i}.{name}.{kind}", np.ascontiguousarray(t), ggml_type)
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", weights["lm_head.weight"], embedding)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def weight_bytes(path) -> tuple[int, int]:
    """(layer 0's, the head's) bytes in the GGUF at ``path``, as its own types store them: what a
    decode step reads per layer, and for the head (the output matrix, or the tied embedding, and
    the final norm)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    layer = sum(n for name, n in tensors.items() if name.startswith("blk.0."))
    head = tensors.get("output.weight", tensors["token_embd.weight"]) + tensors.get("output_norm.weight", 0)
    return layer, head


__all__ = ["ARCHITECTURES", "TENSORS", "weight_bytes", "write_checkpoint_gguf"]
