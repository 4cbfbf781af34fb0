"""``python -m tools.finetune.stack``: adapters trained one after the other, stacked into one whose
merge equals their merges in turn."""

import json

import pytest
import torch

from export import adapter
from tests.families import tiny_model
from tools.finetune.stack import main

peft = pytest.importorskip("peft")


def _adapter(model, directory, rank, alpha, seed):
    """A random LoRA adapter of ``model`` saved in peft's format (B non-zero: it changes the model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    wrapped = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "down_proj"]))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    wrapped.save_pretrained(directory)
    return wrapped.unload()


def test_stacked_adapters_merge_as_the_adapters_in_turn(tmp_path, capsys):
    base = tiny_model("llama3")
    first, second = tmp_path / "a1", tmp_path / "a2"
    _adapter(tiny_model("llama3"), first, rank=4, alpha=8, seed=1)
    _adapter(tiny_model("llama3"), second, rank=2, alpha=16, seed=2)  # another scale: folded into its B
    in_turn = tiny_model("llama3")
    adapter.apply(in_turn, first)
    adapter.apply(in_turn, second)
    assert main(["--adapters", str(first), str(second), "--out", str(tmp_path / "s"), "--dtype", "float32"]) == 0
    assert "2 adapters stacked into one of rank 6" in capsys.readouterr().out
    config = json.loads((tmp_path / "s" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (6, 12)
    stacked = tiny_model("llama3")
    adapter.apply(stacked, tmp_path / "s")
    for (name, want), got in zip(in_turn.state_dict().items(), stacked.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), stacked.state_dict().values()))
    assert not (tmp_path / "s" / "skipdecode.json").exists()  # neither adapter had one


def test_the_stack_keeps_the_first_adapters_policies_and_every_stages_record(tmp_path):
    """A shipped model's folder holds its skipdecode.json; a tools.finetune run's lies above its
    adapter/. A later stage of fewer speedups: the stack serves the first's policies; it records
    every stage once."""
    first, run = tmp_path / "shipped", tmp_path / "run"
    _adapter(tiny_model("llama3"), first, rank=4, alpha=8, seed=1)
    _adapter(tiny_model("llama3"), run / "adapter", rank=2, alpha=4, seed=2)
    stage = {"model": "shipped", "steps": 3}
    (first / "skipdecode.json").write_text(json.dumps(
        {"horizon": 64, "speedups": [1, 2], "speedup_policies": {"2": {"max_layers": 4, "min_layers": 2}},
         "train_seconds": 10.0, "trained_from": [{"model": "base"}], "lora": {"rank": 4, "adapter": "adapter"}}))
    (run / "skipdecode.json").write_text(json.dumps(
        {"horizon": 32, "speedups": [5], "train_seconds": 2.5, "trained_from": [{"model": "base"}, stage]}))
    assert main(["--adapters", str(first), str(run / "adapter"), "--out", str(tmp_path / "s")]) == 0
    meta = json.loads((tmp_path / "s" / "skipdecode.json").read_text())
    assert (meta["horizon"], meta["speedups"], meta["speedup_policies"]) == (
        64, [1, 2], {"2": {"max_layers": 4, "min_layers": 2}})
    assert meta["trained_from"] == [{"model": "base"}, stage] and meta["train_seconds"] == 12.5
    assert meta["lora"] == {"rank": 6, "alpha": 12.0, "adapter": "adapter"}


def test_a_later_stage_that_trained_every_speedup_sets_the_policies(tmp_path):
    """A later stage under another shape (tools.finetune --decay power --policy) that trained
    every speedup the first serves: the stack serves its policies, and no speedup_policies of the
    first's shape."""
    first, run = tmp_path / "shipped", tmp_path / "run"
    _adapter(tiny_model("llama3"), first, rank=4, alpha=8, seed=1)
    _adapter(tiny_model("llama3"), run / "adapter", rank=2, alpha=4, seed=2)
    (first / "skipdecode.json").write_text(json.dumps(
        {"horizon": 64, "speedups": [1, 2], "decay": "linear", "speedup_policies": {"2": {"max_layers": 4, "min_layers": 2}},
         "trained_from": [{"model": "base"}], "separator": " "}))
    (run / "skipdecode.json").write_text(json.dumps(
        {"horizon": 64, "speedups": [1, 2, 2], "decay": "power", "exponent": 4.0, "trained_from": [{"model": "s"}]}))
    assert main(["--adapters", str(first), str(run / "adapter"), "--out", str(tmp_path / "s")]) == 0
    meta = json.loads((tmp_path / "s" / "skipdecode.json").read_text())
    assert (meta["decay"], meta["exponent"], meta["speedups"], meta["separator"]) == ("power", 4.0, [1, 2, 2], " ")
    assert "speedup_policies" not in meta


def test_adapters_of_other_modules_do_not_stack(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    _adapter(tiny_model("llama3"), tmp_path / "a1", rank=2, alpha=4, seed=1)
    get_peft_model(tiny_model("llama3"), LoraConfig(r=2, target_modules=["v_proj"])).save_pretrained(tmp_path / "a2")
    assert main(["--adapters", str(tmp_path / "a1"), str(tmp_path / "a2"), "--out", str(tmp_path / "s")]) == 2
    assert "only adapters of the same modules stack" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
