"""The skip-aware Llama-family reference (runtime.models.llama) against transformers, and the family
registry's refusals (runtime.models)."""

import pytest
import torch

from runtime.errors import UnsupportedModelError
from runtime.models import family_of, skip_model
from runtime.policy import SkipPolicy
from tests.families import VARIANTS, tiny_config, tiny_model

NEW = 10


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3], mask[1, :1] = 0, 0  # left padding
    return ids, mask


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_depth_greedy_equals_transformers_generate(variant):
    model = tiny_model(variant)
    ids, mask = _batch()
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            pad_token_id=1, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    ours = skip_model(model).greedy(ids, mask, NEW, pad_token_id=1)
    assert ours.tokens.tolist() == hf.sequences[:, ids.shape[1]:].tolist()
    for step, (a, b) in enumerate(zip(ours.step_logits, hf.logits)):
        torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layers_store_kv_heads_only(variant):
    model = tiny_model(variant)
    ref = skip_model(model)
    c = model.config
    nkv, hd = c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ids, mask = _batch()
    _, past = ref(ids, mask)
    assert [tuple(k.shape) for k, _ in past] == [(3, nkv, hd, 7)] * c.num_hidden_layers
    assert [tuple(v.shape) for _, v in past] == [(3, nkv, 7, hd)] * c.num_hidden_layers


def test_skipped_layers_keep_their_past_and_the_policy_decides_the_tokens():
    model = tiny_model("qwen3")
    ref = skip_model(model)
    ids, mask = _batch()
    policy = SkipPolicy(5, 4, 2, warmup_layers=1, horizon=NEW - 1)
    out = ref.greedy(ids, mask, NEW, policy, pad_token_id=1)
    assert out.step_layers == [policy.active_layers(g) for g in range(NEW - 1)]
    full = ref.greedy(ids, mask, NEW, pad_token_id=1)
    assert out.tokens.tolist() != full.tokens.tolist()  # skipping layers changed something


@pytest.mark.parametrize("config, feature", [
    (lambda: tiny_config("qwen2", use_sliding_window=True, sliding_window=8), "sliding-window attention"),
    (lambda: tiny_config("llama3", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "RoPE types other than default, linear, llama3"),
    (lambda: tiny_config("smollm2", hidden_act="gelu"), "activations other than silu"),
])
def test_unsupported_feature_is_named_with_what_is_supported(config, feature):
    with pytest.raises(UnsupportedModelError) as err:
        family_of(config())
    assert feature in str(err.value)
    assert "supported: opt, llama, qwen2, qwen3" in str(err.value)


def test_unsupported_family_names_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"is a 'gpt2' checkpoint; this toolkit exports model_type "
                                                    r"opt, llama, qwen2, qwen3 \(OPT, Llama 3.x, SmolLM2"):
        family_of(GPT2Config())


def test_manifest_model_before_the_llama_family_reads_as_opt():
    from runtime.artifact.manifest import ModelInfo

    old = dict(num_layers=2, hidden_size=32, num_heads=4, head_dim=8, vocab_size=512, max_position_embeddings=64,
               pre_layer_norm=True, bos_token_id=2, eos_token_id=2, pad_token_id=1)  # no architecture, num_kv_heads
    info = ModelInfo(**old)
    assert (info.architecture, info.kv_heads) == ("opt", 4)
    assert ModelInfo(**old, architecture="qwen3", num_kv_heads=1).kv_heads == 1


@pytest.mark.parametrize("variant", ["opt", *VARIANTS])
def test_every_family_reference_is_a_skip_model_built_through_its_base(variant):
    """One neutral base (runtime.models.base): no family's reference skips another's __init__."""
    from runtime.models.base import SkipModel, graph_module
    from tests.conftest import tiny_config as tiny_opt_config

    if variant == "opt":
        from transformers import OPTForCausalLM

        model = OPTForCausalLM(tiny_opt_config("pre_ln")).eval()
    else:
        model = tiny_model(variant)
    ref = skip_model(model)
    assert isinstance(ref, SkipModel) and type(ref).__mro__[1] is SkipModel
    assert ref.config is model.config and not ref.training
    assert ref.num_layers == model.config.num_hidden_layers and ref.dtype == torch.float32
    assert graph_module(ref, "embed") is ref.embed and graph_module(ref, "head") is ref.head
