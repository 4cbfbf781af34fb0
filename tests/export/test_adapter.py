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
