"""The model families this toolkit exports and runs, each declared once, and their references.

This package is each family's home: ``base`` (``SkipModel``, what every skip-aware reference shares),
``opt`` and ``llama`` (the references whose modules become the graphs: Llama 3.x, SmolLM2, Qwen2/2.5,
Qwen3), and here the registry that says which reference serves which checkpoint.

A ``Family`` says what differs between architectures and nothing else: which transformers
``model_type`` values it covers, its causal-LM class, the PyTorch reference that becomes its graphs
(imported lazily: this module needs no torch), how the graphs' weight names map back to the
checkpoint's state_dict, and which config features it does not support. Export (checkpoint checks,
manifest fields), the torch backend (rebuilding the model from an artifact) and tools.finetune read
it from here; the decode loop and the other backends know no family: the manifest tells them the
KV heads and head size (``runtime.artifact.manifest.ModelInfo``), and every graph derives positions from the
attention mask it is given, so the graph contract is the same for all families.

Like optimum's per-architecture export configs, adding a Llama-like architecture is one entry in
``FAMILIES``, provided its layers are the reference's math (runtime.models.llama).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import UnsupportedModelError

_OPT_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")  # under self_attn. in the HF OPT layer


@dataclass(frozen=True)
class Unsupported:
    """A config feature the graphs do not implement: the checkpoint is refused when ``present``."""

    feature: str  # what the user is told, e.g. "sliding-window attention"
    present: object  # config -> bool


def _opt_key(graph: str, name: str) -> str:
    """embed: embed_tokens.weight -> model.decoder.embed_tokens.weight (also embed_positions,
    project_in); layer_NN: q_proj.weight -> model.decoder.layers.N.self_attn.q_proj.weight, fc1.bias
    -> model.decoder.layers.N.fc1.bias; head: lm_head.weight -> lm_head.weight, final_layer_norm.weight
    -> model.decoder.final_layer_norm.weight"""
    if graph == "embed":
        return f"model.decoder.{name}"
    if graph == "head":
        return name if name.startswith("lm_head.") else f"model.decoder.{name}"
    attn = "self_attn." if name.split(".")[0] in _OPT_ATTENTION else ""
    return f"model.decoder.layers.{int(graph.split('_')[1])}.{attn}{name}"


def _llama_key(graph: str, name: str) -> str:
    """The reference keeps the HF modules' own names under ``model.`` (runtime.models.llama): embed:
    embed_tokens.weight -> model.embed_tokens.weight; layer_NN: self_attn.q_proj.weight ->
    model.layers.N.self_attn.q_proj.weight; head: norm.weight -> model.norm.weight, lm_head.weight."""
    if graph == "embed":
        return f"model.{name}"
    if graph == "head":
        return name if name.startswith("lm_head.") else f"model.{name}"
    return f"model.layers.{int(graph.split('_')[1])}.{name}"


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


# RoPE whose inverse frequencies are fixed at load (what the graphs hold as a constant); dynamic
# NTK, YaRN and longrope change them with the sequence length or scale attention.
STATIC_ROPE = ("default", "linear", "llama3")


def _sliding_window(config) -> bool:
    if getattr(config, "use_sliding_window", False):
        return True
    return any(t != "full_attention" for t in (getattr(config, "layer_types", None) or []))


_LLAMA_LIKE = (
    Unsupported("sliding-window attention (use_sliding_window / sliding layer_types)", _sliding_window),
    Unsupported(f"RoPE types other than {', '.join(STATIC_ROPE)}",
                lambda c: _rope_type(c) not in STATIC_ROPE),
    Unsupported("activations other than silu", lambda c: getattr(c, "hidden_act", "silu") != "silu"),
)


@dataclass(frozen=True)
class Family:
    name: str  # what the manifest records as model.architecture
    model_types: tuple[str, ...]  # transformers config.model_type values it covers
    hf_class: str  # the transformers causal-LM class of its checkpoints
    reference: str  # "module:Class" of the skip-aware PyTorch reference (runtime.models.opt / runtime.models.llama)
    hf_key: object  # (graph name, weight name in the graph) -> the checkpoint's state_dict key
    embed_key: str  # the token embedding's state_dict key (lm_head ties to it)
    unsupported: tuple[Unsupported, ...] = ()
    # What export.plan counts (from config.json alone), so that it branches on no family's name:
    qkv_bias: bool = False  # q/k/v projections always carry biases (else only with attention_bias)
    qk_norm: bool = False  # an RMSNorm on each head's q and k
    tied_by_default: bool = True  # tie_word_embeddings where config.json leaves it out (transformers')

    def check(self, config, what: str = "the checkpoint") -> None:
        """Refuse a config with a feature the graphs do not implement, before any work."""
        found = [u.feature for u in self.unsupported if u.present(config)]
        if found:
            raise UnsupportedModelError(
                f"{what} ({config.model_type}) uses {' and '.join(found)}, which this toolkit does not "
                f"export; supported: {supported()}, with full attention in every layer and RoPE "
                f"{'/'.join(STATIC_ROPE)}")

    def skip_model(self, hf_model):
        """The skip-aware reference over ``hf_model``'s own modules (shares its weights)."""
        module, cls = self.reference.split(":")
        return getattr(importlib.import_module(module), cls)(hf_model)

    def model_class(self):
        import transformers

        return getattr(transformers, self.hf_class)


FAMILIES = (
    Family("opt", ("opt",), "OPTForCausalLM", "runtime.models.opt:SkipOPT", _opt_key,
           "model.decoder.embed_tokens.weight"),
    # Llama 2/3.x (llama3 RoPE scaling, tied or untied head) and SmolLM2, which is a Llama
    Family("llama", ("llama",), "LlamaForCausalLM", "runtime.models.llama:SkipLlama", _llama_key,
           "model.embed_tokens.weight", _LLAMA_LIKE, tied_by_default=False),
    # Qwen2 / Qwen2.5: q/k/v projections with bias
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", "runtime.models.llama:SkipLlama", _llama_key,
           "model.embed_tokens.weight", _LLAMA_LIKE, qkv_bias=True),
    # Qwen3: RMSNorm on each head's q and k, head_dim independent of hidden / heads
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", "runtime.models.llama:SkipLlama", _llama_key,
           "model.embed_tokens.weight", _LLAMA_LIKE, qk_norm=True),
)


def supported() -> str:
    return ", ".join(t for f in FAMILIES for t in f.model_types)


def family_of(config, what: str = "the checkpoint") -> Family:
    """The family of a transformers config, its features checked; UnsupportedModelError otherwise."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            family.check(config, what)
            return family
    raise UnsupportedModelError(
        f"{what} is a {model_type!r} checkpoint; this toolkit exports model_type {supported()} "
        f"(OPT, Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3)")


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise UnsupportedModelError(f"unknown model architecture {name!r}; this toolkit knows {supported()}")


def kv_heads(config) -> int:
    """K/V heads: fewer than the query heads under grouped-query attention."""
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def head_dim(config) -> int:
    """Qwen3 sets it apart from hidden_size / heads; the others derive it."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def skip_model(hf_model):
    """The skip-aware reference of any supported checkpoint (a runtime.models.base.SkipModel)."""
    return family_of(hf_model.config).skip_model(hf_model)


__all__ = ["FAMILIES", "Family", "family_named", "family_of", "head_dim", "kv_heads", "skip_model",
           "supported"]
