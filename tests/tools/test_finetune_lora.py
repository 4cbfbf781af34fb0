"""tools.finetune --lora-rank: adapters train while the base weights stay, a resumed run ends with
the same adapters, and the merged model it writes equals export's merge of its adapter/ into the base."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from export import checkpoint
from export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply
from tests.families import save_tiny_checkpoint
from tests.tools.test_finetune import _config, tiny_dir  # noqa: F401  (a fixture)
from tools.finetune.train import TrainError, train

pytest.importorskip("peft")


def _state(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_lora_trains_resumes_exactly_and_merges_as_export_does(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny = save_tiny_checkpoint(tmp_path / "llama", "llama3")
    kw = dict(epochs=2, speedups=(1.0, 2.0), horizon=6, lora_rank=4, lr=1e-2)
    out = train(_config(tiny, tmp_path, **kw))

    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in log if "val_loss" in r]
    assert all(val[-1][k] < val[0][k] for k in val[0])  # the adapters learned something
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "adapter": "adapter"}
    config = json.loads((out / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    # a checkpoint holds the adapters alone: a few tensors per layer, not the model
    assert not (out / "checkpoint-4" / "model.safetensors").exists()
    assert all(".lora_" in k for k in load_file(out / "checkpoint-4" / ADAPTER_WEIGHTS))
    # and exports as it is: an adapter over the base, with the policy it was trained for
    source = checkpoint.resolve(str(out / "checkpoint-4"))
    assert source.kind == "adapter" and checkpoint.skipdecode_training(source)["horizon"] == 6
    assert checkpoint.adapter_base(source).location == str(tiny.resolve())

    base, merged = _state(tiny), _state(out)
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # norms, embeddings untouched

    # export's merge (no peft) of the adapter into the base model gives the merged weights
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert apply(model, out / "adapter") == 7 * 5  # seven projections in each of five layers
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, merged[name], atol=1e-6, rtol=1e-6, msg=name)

    resumed = train(_config(tiny, tmp_path, out=str(tmp_path / "out2"), resume=str(out / "checkpoint-4"), **kw))
    again = _state(resumed)
    for name in merged:
        torch.testing.assert_close(again[name], merged[name], atol=1e-6, rtol=1e-6, msg=name)


def test_lora_on_opt_and_a_subset_of_the_training_pairs(tiny_dir, tmp_path):
    out = train(_config(tiny_dir, tmp_path, epochs=1, lora_rank=2, max_train=4, val=None))
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "skipdecode.json").read_text())["trained_from"][-1]["max_train"] == 4
    assert any("out_proj" in k for k in load_file(out / "adapter" / ADAPTER_WEIGHTS))  # OPT's names


def test_a_negative_rank_is_refused(tiny_dir, tmp_path):
    with pytest.raises(TrainError, match="--lora-rank -1: a rank is a positive number"):
        train(_config(tiny_dir, tmp_path, lora_rank=-1))
