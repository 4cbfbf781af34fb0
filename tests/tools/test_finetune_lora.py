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
from tools.finetune.skip import PolicySampler
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


def _one_batch(directory):
    """The training pairs of tests.tools.test_finetune as one padded batch."""
    from transformers import AutoTokenizer

    from tests.tools.test_finetune import PAIRS
    from tools.finetune.data import batches, encode

    tok = AutoTokenizer.from_pretrained(directory)
    items = [encode(tok, ex) for ex in PAIRS]
    (batch,) = batches(items, len(items), tok.eos_token_id, shuffle=False, rng=None)
    return batch


def _kl_to_full_depth(model_dir, base_dir, speedup: float) -> float:
    """Mean KL(base at full depth || model_dir under the speedup's policy) over the training pairs'
    target tokens."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from runtime.models import skip_model
    from tools.finetune.skip import PolicySampler, layer_mask, skip_forward

    batch = _one_batch(base_dir)
    keep = batch.labels != -100
    out = []
    for directory, s in ((base_dir, 1.0), (model_dir, speedup)):
        skip = skip_model(AutoModelForCausalLM.from_pretrained(directory)).eval()
        policy = PolicySampler(skip.num_layers, (s,), horizon=6).policies()[0]
        mask = layer_mask([policy] * len(keep), batch.prompt_lens, batch.input_ids.shape[1])
        with torch.no_grad():
            out.append(F.log_softmax(skip_forward(skip, batch.input_ids, batch.attention_mask, mask)[keep], -1))
    return float(F.kl_div(out[1], out[0], log_target=True, reduction="batchmean"))


def test_distilling_brings_the_skipping_policy_to_full_depths_predictions(tmp_path):
    tiny = save_tiny_checkpoint(tmp_path / "llama", "llama3")
    out = train(_config(tiny, tmp_path, epochs=10, speedups=(1.0, 2.0), horizon=6, lora_rank=4, lr=1e-2,
                        distill=1.0, val=None))
    assert json.loads((out / "skipdecode.json").read_text())["trained_from"][-1]["distill"] == 1.0
    before, after = _kl_to_full_depth(tiny, tiny, 2.0), _kl_to_full_depth(out, tiny, 2.0)
    assert after < 0.5 * before, (before, after)  # 2x now predicts what full depth does
    assert _kl_to_full_depth(out, tiny, 1.0) < 0.25 * before  # and full depth stays the model it was


def test_the_teacher_is_the_starting_model_with_its_adapters_off(tmp_path):
    from transformers import AutoModelForCausalLM

    from runtime.models import skip_model
    from tools.finetune import lora
    from tools.finetune.train import teacher_logits

    tiny = save_tiny_checkpoint(tmp_path / "llama", "llama3")
    batch = _one_batch(tiny)
    expected = AutoModelForCausalLM.from_pretrained(tiny)(batch.input_ids, attention_mask=batch.attention_mask).logits
    model = lora.inject(AutoModelForCausalLM.from_pretrained(tiny), 4, 8.0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # adapters that change the model
    skip = skip_model(model).train()
    got = teacher_logits(model, skip, batch)
    torch.testing.assert_close(got, expected[batch.labels != -100], atol=1e-4, rtol=1e-4)
    assert skip.training and all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    changed = skip_forward_full(skip, batch)
    assert not torch.allclose(changed, got, atol=1e-2)  # outside the block the adapters are on again


def skip_forward_full(skip, batch):
    from tools.finetune.skip import skip_forward

    B, T = batch.input_ids.shape
    with torch.no_grad():
        logits = skip_forward(skip.eval(), batch.input_ids, batch.attention_mask,
                              torch.ones((B, T, skip.num_layers), dtype=torch.bool))
    return logits[batch.labels != -100]


def test_skipping_only_adapters_leave_the_prompt_and_full_depth_as_they_were(tmp_path):
    """--skipping-only: where no token skips (a full-depth row, a prompt's positions) the model is
    the starting one to the bit; a skipping row's generated positions see the adapters."""
    from transformers import AutoModelForCausalLM

    from runtime.models import skip_model
    from tools.finetune import lora
    from tools.finetune.skip import layer_mask, skip_forward
    from tools.finetune.train import skipping_gate

    tiny = save_tiny_checkpoint(tmp_path / "llama", "llama3")
    batch = _one_batch(tiny)
    model = lora.inject(AutoModelForCausalLM.from_pretrained(tiny), 4, 8.0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    skip = skip_model(model).eval()
    B, T = batch.input_ids.shape
    policies = PolicySampler(skip.num_layers, (1.0, 2.0), horizon=6).policies()
    rows = [policies[b % 2] for b in range(B)]  # full depth and 2x, alternately
    gate = skipping_gate(rows, batch.prompt_lens, T)
    assert gate[0].sum() == 0 and gate[1, : int(batch.prompt_lens[1])].sum() == 0 and gate[1].sum() > 0
    mask = layer_mask(rows, batch.prompt_lens, T)
    with torch.no_grad():
        with lora.gated(model, gate):
            gated = skip_forward(skip, batch.input_ids, batch.attention_mask, mask)  # (B, T, V)
        with lora.disabled(model):
            base = skip_forward(skip, batch.input_ids, batch.attention_mask, mask)
    assert torch.equal(gated[0], base[0])  # the full-depth row: the starting model exactly
    p = int(batch.prompt_lens[1])
    assert torch.equal(gated[1, :p], base[1, :p])  # the skipping row's prompt too
    assert not torch.allclose(gated[1, p:], base[1, p:], atol=1e-3)  # its generated tokens are adapted


def test_a_skipping_only_run_trains_the_skipping_policy(tmp_path):
    tiny = save_tiny_checkpoint(tmp_path / "llama", "llama3")
    out = train(_config(tiny, tmp_path, epochs=4, speedups=(2.0,), horizon=6, lora_rank=4, lr=1e-2,
                        skipping_only=True))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [r["val_loss"]["2x"] for r in log if "val_loss" in r]
    assert val[-1] < val[0]
    assert json.loads((out / "skipdecode.json").read_text())["trained_from"][-1]["skipping_only"] is True


@pytest.mark.parametrize("kw, message", [
    (dict(skipping_only=True), "--skipping-only needs --lora-rank"),
    (dict(skipping_only=True, lora_rank=2, speedups=(1.0,)), "--skipping-only trains the adapters on the tokens "
                                                              "that skip layers, and --speedups has no policy"),
    (dict(distill=0.5), "--distill needs --lora-rank: the teacher is the starting model"),
    (dict(distill=1.5, lora_rank=2), r"--distill 1.5: the KL term's share of the loss lies in \[0, 1\]"),
])
def test_distill_refuses_what_it_cannot_do(tiny_dir, tmp_path, kw, message):
    with pytest.raises(TrainError, match=message):
        train(_config(tiny_dir, tmp_path, **kw))
