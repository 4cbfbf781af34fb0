"""Tiny random Llama-family checkpoints built from their transformers config classes (nothing is
downloaded): odd shapes, grouped-query attention with 1 and 2 KV heads, tied and untied heads."""

from __future__ import annotations

import torch

from export.checkpoint import build_tokenizer

# The tokenizer of export.checkpoint.build_tokenizer: 512 ids, <pad>=1, </s>=2 (BOS and EOS).
_COMMON = dict(vocab_size=512, max_position_embeddings=64, bos_token_id=2, eos_token_id=2, pad_token_id=1,
               initializer_range=0.2)  # a wide init: greedy choices do not hinge on rounding
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}
VARIANTS = {
    # Llama 3.2: llama3 RoPE scaling, tied embeddings, 2 KV heads for 4 query heads
    "llama3": ("LlamaConfig", dict(hidden_size=40, intermediate_size=56, num_hidden_layers=5,
                                   num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE,
                                   tie_word_embeddings=True)),
    # SmolLM2 (a Llama): 1 KV head for 3 query heads of 12, untied head
    "smollm2": ("LlamaConfig", dict(hidden_size=36, intermediate_size=52, num_hidden_layers=5,
                                    num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False)),
    # Qwen2.5: q/k/v bias, 6 heads of 6 over 2 KV heads, untied
    "qwen2": ("Qwen2Config", dict(hidden_size=36, intermediate_size=50, num_hidden_layers=5,
                                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)),
    # Qwen3: q/k RMSNorm, head_dim 12 with 4 heads over hidden 40 (attention width 48), 1 KV head, tied
    "qwen3": ("Qwen3Config", dict(hidden_size=40, intermediate_size=56, num_hidden_layers=5,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                  tie_word_embeddings=True)),
}


def tiny_config(variant: str, **overrides):
    import transformers

    name, fields = VARIANTS[variant]
    return getattr(transformers, name)(**{**_COMMON, **fields, **overrides})


def tiny_model(variant: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(variant, **overrides)).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(1, 0.2)
    return model


def save_tiny_checkpoint(directory, variant: str, seed: int = 0, **overrides):
    tiny_model(variant, seed, **overrides).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory
