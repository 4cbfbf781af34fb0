"""export.adapter: a peft LoRA adapter merged without peft, and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, apply
from tests.families import tiny_model

KEY = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(directory, a, b, **config):
    directory.mkdir()
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": a.shape[0], "lora_alpha": 4,
                                                        "base_model_name_or_path": "base", **config}))
    save_file({f"{KEY}.lora_A.weight": a, f"{KEY}.lora_B.weight": b}, directory / ADAPTER_WEIGHTS)
    return directory


def test_the_merge_adds_b_a_times_alpha_over_r(tmp_path):
    model = tiny_model("llama3")
    linear = model.model.layers[0].self_attn.q_proj
    before = linear.weight.detach().clone()
    a, b = torch.randn(2, linear.in_features), torch.randn(linear.out_features, 2)
    assert apply(model, _adapter(tmp_path / "ad", a, b)) == 1
    torch.testing.assert_close(linear.weight.detach(), before + b @ a * (4 / 2))


def test_an_adapter_of_another_shape_is_refused_naming_its_base(tmp_path):
    model = tiny_model("llama3")
    directory = _adapter(tmp_path / "ad", torch.randn(2, 7), torch.randn(5, 2))
    with pytest.raises(AdapterError, match=r"adapter 'model.layers.0.self_attn.q_proj' fits no linear layer "
                                           r"of this model .* its base: 'base'"):
        apply(model, directory)


def test_dora_and_a_missing_weights_file_are_refused(tmp_path):
    model = tiny_model("llama3")
    a, b = torch.randn(2, 40), torch.randn(40, 2)
    with pytest.raises(AdapterError, match="only plain LoRA adapters merge here"):
        apply(model, _adapter(tmp_path / "dora", a, b, use_dora=True))
    directory = _adapter(tmp_path / "gone", a, b)
    (directory / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing or unreadable"):
        apply(model, directory)


def test_export_build_takes_an_adapter_folder_and_equals_the_merged_model(tmp_path):
    """--model ADAPTER_DIR: the base its config names, the adapter merged, its skipdecode.json's
    horizon kept; full-depth greedy tokens equal transformers' generate on the merged model."""
    import runtime
    from export.build import BuildOptions, build
    from tests.export.test_build_llama import PROMPTS, _hf, _hf_generate
    from tests.families import save_tiny_checkpoint

    base = save_tiny_checkpoint(tmp_path / "base", "llama3")
    model, tok = _hf("llama3", base)
    linear = model.model.layers[2].mlp.down_proj
    a, b = torch.randn(4, linear.in_features), torch.randn(linear.out_features, 4) * 0.5
    directory = tmp_path / "ad"
    directory.mkdir()
    (directory / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                        "base_model_name_or_path": str(base)}))
    save_file({"base_model.model.model.layers.2.mlp.down_proj.lora_A.weight": a,
               "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight": b}, directory / ADAPTER_WEIGHTS)
    (directory / "skipdecode.json").write_text(json.dumps({"horizon": 7}))
    with torch.no_grad():
        linear.weight += b @ a * 2
    _, expected, _ = _hf_generate(model, tok)

    manifest = build(BuildOptions(model=str(directory), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert (manifest.source["kind"], manifest.source["base"]) == ("adapter", str(base.resolve()))
    assert manifest.policy["horizon"] == 7
    gen = runtime.load(tmp_path / "art", threads=1)
    try:
        tokens = gen.generate(PROMPTS, len(expected[0])).token_ids
        assert [t + [2] * (len(e) - len(t)) for t, e in zip(tokens, expected)] == expected
    finally:
        gen.close()


def test_an_adapter_without_a_base_says_so(tmp_path):
    from export import checkpoint
    from runtime.errors import UnsupportedModelError

    directory = _adapter(tmp_path / "ad", torch.randn(2, 40), torch.randn(40, 2), base_model_name_or_path=None)
    source = checkpoint.resolve(str(directory))
    assert source.kind == "adapter"
    with pytest.raises(UnsupportedModelError, match="names no base model .base_model_name_or_path."):
        checkpoint.load(source)
