"""The public checkpoints the aliases name, per family: hub ids for real use, and their published
shapes, so that ``--random-weights`` builds the real architecture offline (benchmarks, plans,
smoke runs) and ``export plan`` counts its bytes. Data only: no torch, no transformers at import.

OPT's shapes are (layers, hidden, heads, ffn, word_embed_proj_dim, pre-LayerNorm). The Llama
family's are the checkpoints' config.json values (hidden, layers, heads, KV heads, head_dim, MLP
width, vocabulary, context, RoPE, tied embeddings). A random build (export.checkpoint) keeps them
all except the special-token ids, which are those of the offline tokenizer (filled up to the real
vocabulary size), so every id the model can emit decodes to text.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- OPT ---------------------------------------------------------------------------------------------

OPT_HUB_ORG = "facebook"
OPT_ARCHS: dict[str, tuple[int, int, int, int, int, bool]] = {
    "opt-125m": (12, 768, 12, 3072, 768, True),
    "opt-350m": (24, 1024, 16, 4096, 512, False),
    "opt-1.3b": (24, 2048, 32, 8192, 2048, True),
    "opt-2.7b": (32, 2560, 32, 10240, 2560, True),
    "opt-6.7b": (32, 4096, 32, 16384, 4096, True),
    "opt-13b": (40, 5120, 40, 20480, 5120, True),
    "opt-30b": (48, 7168, 56, 28672, 7168, True),
    "opt-66b": (64, 9216, 72, 36864, 9216, True),
}
OPT_ALIASES = {name: f"{OPT_HUB_ORG}/{name}" for name in OPT_ARCHS}
OPT_VOCAB_SIZE = 50272  # every public OPT checkpoint's embedding rows

# -- the Llama family ----------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


@dataclass(frozen=True)
class Published:
    hub_id: str
    model_type: str  # transformers' config.model_type
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # intermediate_size: the gate/up projections' width
    vocab: int
    max_positions: int
    rope: dict
    head_dim: int | None = None  # None: hidden / heads
    rms_eps: float = 1e-6

    def fields(self) -> dict:
        """The config.json fields of the shape (every published one ties its embeddings)."""
        fields = dict(model_type=self.model_type, vocab_size=self.vocab, hidden_size=self.hidden,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, intermediate_size=self.ffn,
                      max_position_embeddings=self.max_positions, rope_parameters=dict(self.rope),
                      rms_norm_eps=self.rms_eps, tie_word_embeddings=True)
        if self.head_dim is not None:
            fields["head_dim"] = self.head_dim
        return fields

    def config(self, bos: int, eos: int, pad: int):
        """The transformers config of this shape, with the given special-token ids."""
        from transformers import AutoConfig

        fields = self.fields()
        return AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=bos, eos_token_id=eos,
                                    pad_token_id=pad)


PUBLISHED: dict[str, Published] = {
    "llama-3.2-1b": Published("meta-llama/Llama-3.2-1B", "llama", 16, 2048, 32, 8, 8192, 128256,
                              131072, LLAMA3_ROPE, head_dim=64, rms_eps=1e-5),
    "llama-3.2-3b": Published("meta-llama/Llama-3.2-3B", "llama", 28, 3072, 24, 8, 8192, 128256,
                              131072, LLAMA3_ROPE, head_dim=128, rms_eps=1e-5),
    "qwen2.5-0.5b": Published("Qwen/Qwen2.5-0.5B", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768,
                              {"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-0.6b": Published("Qwen/Qwen3-0.6B", "qwen3", 28, 1024, 16, 8, 3072, 151936, 40960,
                            {"rope_type": "default", "rope_theta": 1000000.0}, head_dim=128),
    "qwen3-1.7b": Published("Qwen/Qwen3-1.7B", "qwen3", 28, 2048, 16, 8, 6144, 151936, 40960,
                            {"rope_type": "default", "rope_theta": 1000000.0}, head_dim=128),
    "smollm2-135m": Published("HuggingFaceTB/SmolLM2-135M", "llama", 30, 576, 9, 3, 1536, 49152, 8192,
                              {"rope_type": "default", "rope_theta": 100000.0}, head_dim=64, rms_eps=1e-5),
    "smollm2-360m": Published("HuggingFaceTB/SmolLM2-360M", "llama", 32, 960, 15, 5, 2560, 49152, 8192,
                              {"rope_type": "default", "rope_theta": 100000.0}, head_dim=64, rms_eps=1e-5),
}
ALIASES = {name: p.hub_id for name, p in PUBLISHED.items()}


def alias_of(spec: str) -> str | None:
    """The alias ``spec`` names, as an alias or as its hub id (any case); None otherwise."""
    key = spec.lower()
    for name, p in PUBLISHED.items():
        if key in (name, p.hub_id.lower()):
            return name
    return None


__all__ = ["ALIASES", "OPT_ALIASES", "OPT_ARCHS", "OPT_HUB_ORG", "OPT_VOCAB_SIZE", "PUBLISHED", "Published",
           "alias_of"]
