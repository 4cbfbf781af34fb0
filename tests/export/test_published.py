"""The Llama-family aliases: hub ids for real use, the published shapes offline with --random-weights."""

import pytest
import torch

from export import checkpoint
from runtime.errors import ModelNotFoundError
from runtime.models import family_of
from runtime.models.published import PUBLISHED

# Parameters of the published checkpoints (model cards; tied embeddings counted once), in millions.
PARAMS_M = {"llama-3.2-1b": 1236, "llama-3.2-3b": 3213, "qwen2.5-0.5b": 494, "qwen3-0.6b": 596,
            "qwen3-1.7b": 1721, "smollm2-135m": 135, "smollm2-360m": 362}


@pytest.mark.parametrize("alias", list(PUBLISHED))
def test_alias_resolves_to_hub_id_and_random_shape(alias):
    hub = checkpoint.resolve(alias)
    assert (hub.kind, hub.location) == ("hub", PUBLISHED[alias].hub_id)
    for spec in (alias, PUBLISHED[alias].hub_id, alias.upper()):
        random = checkpoint.resolve(spec, random_weights=True)
        assert (random.kind, random.location) == ("random", alias)


@pytest.mark.parametrize("alias", list(PUBLISHED))
def test_published_shape_has_the_published_size(alias):
    from transformers import AutoModelForCausalLM

    config = PUBLISHED[alias].config(bos=2, eos=2, pad=1)
    family_of(config)  # every published shape is supported
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters()) / 1e6  # a tied head is one parameter
    assert params == pytest.approx(PARAMS_M[alias], rel=0.01)


def test_random_weights_build_the_real_shape_with_a_matching_tokenizer():
    model, tokenizer = checkpoint.load(checkpoint.resolve("smollm2-135m", random_weights=True))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tokenizer) == model.config.vocab_size == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as published
    assert tokenizer.decode([49151]).strip()  # the top id decodes to text
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_unknown_alias_lists_the_llama_family_ones():
    with pytest.raises(ModelNotFoundError, match=r"random weights need a known architecture, got 'qwen9-7b'; "
                                                 r"use one of: .*llama-3.2-1b, .*qwen3-0.6b"):
        checkpoint.resolve("qwen9-7b", random_weights=True)


@pytest.mark.parametrize("variant", ["llama3", "smollm2", "qwen2", "qwen3"])
def test_plan_counts_every_weight_and_the_kv_heads_only(variant):
    """export plan on a Llama-family shape: fp32 weights are exactly the model's parameters (a tied
    head once), and the KV cache holds KV heads x head_dim per position, not hidden_size."""
    from export import plan as pm
    from export.plan import plan_arch
    from tests.families import tiny_model

    model = tiny_model(variant)
    config = model.config.to_dict()
    arch = plan_arch(variant, config)
    params = {id(p): p.numel() for p in model.parameters()}  # a tied head is one parameter
    assert pm.weight_bytes(arch, "fp32")[0] == 4 * sum(params.values())
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = pm.Workload(tokens=64, batch=2, prompt=8)
    assert pm.kv_cache_bytes(arch, w, 2) == c.num_hidden_layers * 2 * 2 * c.num_key_value_heads * hd * 64 * 2


def test_plan_reads_a_llama_family_artifact(tmp_path):
    from export import plan as pm
    from export.build import BuildOptions, build
    from tests.families import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), check=False, progress=False), log=lambda *_: None)
    arch = pm.resolve_arch(str(tmp_path / "art"))
    assert (arch.num_layers, arch.kv_width) == (5, 12)
    assert arch.weights == pm.resolve_arch(str(tmp_path / "art")).weights and len(arch.weights) > 5 * 9
