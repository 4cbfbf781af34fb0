"""tools.finetune: the policy mask, its parity with step-by-step decoding, data handling, training,
checkpoint/resume, and the hand-off to `python -m export build`."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoTokenizer, OPTForCausalLM

from runtime.models.opt import SkipOPT
from runtime.policy import SkipPolicy
from tests.conftest import save_tiny_checkpoint, tiny_config
from tools.finetune.data import (DataError, Encoded, Example, collate, common_words, copied_tokens, encode,
                                 read_pairs, split_by_prompt, write_csv)
from tools.finetune.skip import PolicySampler, layer_mask, skip_forward
from tools.finetune.train import TrainConfig, TrainError, faithful_pairs, masked_loss, train

PAIRS = [Example(f"name[Place {i}], food[{food}]", f"Place {i} serves {food} food.")
         for i, food in enumerate(["French", "Italian", "Chinese", "English", "Indian", "Thai"])]


def test_layer_mask_runs_prompt_at_full_depth_and_the_policy_after():
    policy = SkipPolicy(6, 4, 2, warmup_layers=1, horizon=4)
    mask = layer_mask([policy, SkipPolicy.full_depth(6)], torch.tensor([3, 5]), seq_len=9)  # (B, T, L)
    assert mask.shape == (2, 9, 6)
    assert mask[0, :3].all() and mask[1].all()
    for g in range(6):
        expected = torch.zeros(6, dtype=torch.bool)
        expected[list(policy.active_layers(g))] = True
        assert torch.equal(mask[0, 3 + g], expected), g
    # nested: a layer a position skips is skipped by every later position too
    assert (mask[0, 1:] <= mask[0, :-1]).all()


@pytest.mark.parametrize("variant, shape", [
    ("pre_ln", {}), ("post_ln_350m", {}),
    ("pre_ln", {"decay": "power", "exponent": 2.0, "prefill": "policy"}), ("pre_ln", {"prefill": "policy"})])
def test_masked_parallel_pass_equals_step_by_step_decoding(variant, shape):
    """The training pass under a policy gives, at every target position, the logits that decoding
    the same tokens step by step under that policy gives (teacher forcing)."""
    torch.manual_seed(0)
    model = SkipOPT(OPTForCausalLM(tiny_config(variant)).eval())
    policies = [SkipPolicy(6, 5, 2, horizon=5, **shape), SkipPolicy(6, 3, 3, horizon=8, **shape)]
    prompt_lens, lengths = [4, 7], [12, 10]  # different prompts, right padding in the batch
    T = max(lengths)
    ids = torch.randint(4, 512, (2, T))
    attention = torch.zeros(2, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention[b, :n] = 1
    mask = layer_mask(policies, torch.tensor(prompt_lens), T)
    with torch.no_grad():
        parallel = skip_forward(model, ids, attention, mask).float()  # (B, T, V)

    assert_equals_step_by_step(model, ids, parallel, policies, prompt_lens, lengths)


def assert_equals_step_by_step(model, ids, parallel, policies, prompt_lens, lengths):
    """``parallel`` (B, T, V), the masked pass's logits, equals decoding each row's tokens step by
    step under its policy (teacher forcing) at every target position."""
    for b in range(len(policies)):
        p, n, policy = prompt_lens[b], lengths[b], policies[b]
        row = ids[b:b + 1, :n]
        logits, past = model(row[:, :p], torch.ones(1, p, dtype=torch.long),
                             active=policy.prefill_layers())  # the prompt's layers
        torch.testing.assert_close(parallel[b, p - 1], logits[0, -1], atol=1e-5, rtol=1e-5)
        for g in range(n - p):
            t = p + g
            logits, past = model(row[:, t:t + 1], torch.ones(1, t + 1, dtype=torch.long), past,
                                 policy.active_layers(g))
            torch.testing.assert_close(parallel[b, t], logits[0, -1], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"row {b} step {g}: {m}")


def test_policy_sampler_uses_the_runtime_policies():
    sampler = PolicySampler(12, (1.0, 2.0, 5.0), horizon=32)
    assert sampler.policies() == [SkipPolicy.for_speedup(12, s, horizon=32) for s in (1.0, 2.0, 5.0)]
    drawn = sampler.sample(200, random.Random(0))
    assert set(drawn) == set(sampler.policies())
    power = PolicySampler(12, (2.0, 5.0), horizon=32, decay="power", exponent=3.0, prefill="policy")
    assert power.policies() == [SkipPolicy.for_speedup(12, s, horizon=32, decay="power", exponent=3.0,
                                                       prefill="policy") for s in (2.0, 5.0)]


def test_layer_mask_under_prefill_policy_runs_the_prompt_at_step_0s_layers():
    policy = SkipPolicy(6, 4, 2, warmup_layers=1, horizon=4, prefill="policy")
    mask = layer_mask([policy], torch.tensor([3]), seq_len=6)  # (B, T, L)
    first = torch.tensor([i in policy.active_layers(0) for i in range(6)])
    assert all(torch.equal(mask[0, t], first) for t in range(4))


def test_collate_puts_loss_on_target_tokens_only():
    batch = collate([Encoded([2, 10, 11, 20, 21, 2], 3), Encoded([2, 12, 30, 2], 2)], pad_id=1)
    assert batch.input_ids.tolist() == [[2, 10, 11, 20, 21, 2], [2, 12, 30, 2, 1, 1]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    # position t predicts token t+1: from the last prompt token up to EOS
    assert batch.labels.tolist() == [[-100, -100, 20, 21, 2, -100], [-100, 30, 2, -100, -100, -100]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ft-base"), "pre_ln", max_position_embeddings=128)


def test_encode_keeps_the_prompt_as_the_runtime_tokenizes_it(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    enc = encode(tok, PAIRS[0])
    assert enc.input_ids[:enc.prompt_len] == tok(PAIRS[0].prompt)["input_ids"]
    assert enc.input_ids[0] == tok.bos_token_id and enc.input_ids[-1] == tok.eos_token_id
    assert tok.decode(enc.input_ids[enc.prompt_len:-1]) == " " + PAIRS[0].target
    with pytest.raises(DataError, match="exceeds the model's 5 positions"):
        encode(tok, PAIRS[0], max_len=5)


def _word_offsets(text: str) -> list[tuple[int, int]]:
    """A word-per-token tokenization's character spans, each word with the space before it."""
    spans, start = [], 0
    for word in text.split(" ")[1:]:
        spans.append((start, start + 1 + len(word)))
        start += 1 + len(word)
    return spans


def test_copied_tokens_are_a_new_names_pieces_not_the_tasks_words():
    prompt = "name[Tovselbri's], eatType[pub], near[Quay Tavern]"
    text = " Tovselbri's is a pub near Quay Tavern"
    common = common_words(["Zizzi is a pub near Tavern Lane.", "It is a pub near the river."], share=1.0)
    assert common == {"is", "a", "pub", "near"}
    # "pub" is in the prompt but every answer says it; "Tavern" is common to neither
    assert copied_tokens(prompt, text, _word_offsets(text), common) == [
        True, False, False, False, False, True, True]
    # a piece of a word: its letters must lie in a 4-character string of the prompt
    assert copied_tokens("name[Tovsel]", " Tovsel Tovx", [(0, 4), (4, 7), (7, 12)]) == [True, True, False]


def test_copy_weight_weighs_the_copied_tokens_alone(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    pair = Example("name[Kestrelbury], food[French]", "Kestrelbury serves French food.")
    enc = encode(tok, pair, copy_weight=4.0, common={"serves", "food", "French"})
    target = enc.input_ids[enc.prompt_len:]
    assert len(enc.weights) == len(target) and enc.weights[-1] == 1.0  # EOS weighs 1
    heavy = "".join(tok.decode([t]) for t, w in zip(target, enc.weights) if w == 4.0)
    assert heavy.strip() == "Kestrelbury" and set(enc.weights) == {1.0, 4.0}
    assert encode(tok, pair).weights is None  # no weighting: nothing computed


def test_masked_loss_weighs_each_target_token_by_its_weight():
    torch.manual_seed(0)
    model = SkipOPT(OPTForCausalLM(tiny_config("pre_ln")).eval())
    items = [Encoded([2, 10, 11, 20, 21, 2], 3, [3.0, 1.0, 1.0]), Encoded([2, 12, 30, 2], 2, [1.0, 0.5])]
    batch = collate(items, pad_id=1)
    policies = [SkipPolicy(6, 4, 2, horizon=4), SkipPolicy.full_depth(6)]
    with torch.no_grad():
        weighted, n = masked_loss(model, batch, policies)
        mask = layer_mask(policies, batch.prompt_lens, batch.input_ids.shape[1])
        logits = skip_forward(model, batch.input_ids, batch.attention_mask, mask)  # (B, T, V)
        targets = batch.labels != -100
        ce = torch.nn.functional.cross_entropy(logits[targets].float(), batch.labels[targets], reduction="none")
        w = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.5])
        torch.testing.assert_close(weighted, (ce * w).sum() / w.sum())
        batch.weights = None  # unweighted: the plain mean
        torch.testing.assert_close(masked_loss(model, batch, policies)[0], ce.mean())
    assert n == 5


def test_read_pairs_csv_jsonl_and_missing_columns(tmp_path):
    write_csv(tmp_path / "d.csv", PAIRS[:2], "mr", "ref")
    assert read_pairs(tmp_path / "d.csv", "mr", "ref") == PAIRS[:2]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": e.prompt, "target": e.target})
                                                for e in PAIRS[:2]) + "\n")
    assert read_pairs(tmp_path / "d.jsonl") == PAIRS[:2]
    import gzip
    with gzip.open(tmp_path / "d.csv.gz", "wb") as f:
        f.write((tmp_path / "d.csv").read_bytes())
    assert read_pairs(tmp_path / "d.csv.gz", "mr", "ref") == PAIRS[:2]
    with pytest.raises(DataError, match=r"expected a \.csv or \.jsonl file \(optionally \.gz\), got '\.txt\.gz'"):
        (tmp_path / "d.txt.gz").write_bytes((tmp_path / "d.csv.gz").read_bytes())
        read_pairs(tmp_path / "d.txt.gz")
    with pytest.raises(DataError, match=r"lacks the column\(s\) 'prompt', 'target'; its columns are 'mr', 'ref'"):
        read_pairs(tmp_path / "d.csv")
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "nope.csv")


def test_split_by_prompt_never_shares_a_prompt():
    examples = [Example(f"mr{i % 7}", f"ref{i}") for i in range(40)]
    train_set, val = split_by_prompt(examples, 0.3, seed=1)
    assert len(train_set) + len(val) == 40
    assert not {e.prompt for e in train_set} & {e.prompt for e in val}
    assert {e.prompt for e in val}


def _config(tiny_dir, tmp_path, **kw) -> TrainConfig:
    write_csv(tmp_path / "train.csv", PAIRS)
    fields = dict(model=str(tiny_dir), train=str(tmp_path / "train.csv"), val=str(tmp_path / "train.csv"),
                  out=str(tmp_path / "out"), speedups=(1.0, 2.0, 3.0), horizon=8, epochs=3,
                  batch_size=2, lr=3e-3, checkpoint_every=2, keep_checkpoints=10, progress=False,
                  device="cpu")
    fields.update(kw)
    return TrainConfig(**fields)


def _weights(directory):
    return OPTForCausalLM.from_pretrained(directory).state_dict()


def test_training_lowers_the_loss_and_resume_replays_it_exactly(tiny_dir, tmp_path):
    out = train(_config(tiny_dir, tmp_path))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in log if "val_loss" in r]
    assert len(val) == 3 and set(val[0]) == {"1x", "2x", "3x"}
    assert all(val[-1][k] < val[0][k] for k in val[0])
    start, trained = _weights(tiny_dir), _weights(out)  # the weights moved (a learning rate of 0 fails here)
    assert sum(not torch.equal(start[k], trained[k]) for k in start) > len(start) // 2
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["horizon"] == 8 and meta["speedups"] == [1.0, 2.0, 3.0]
    assert meta["policies"][1] == SkipPolicy.for_speedup(6, 2.0, horizon=8).to_dict()

    # an interrupted run resumed from its step-4 checkpoint ends with the same weights
    resumed = train(_config(tiny_dir, tmp_path, out=str(tmp_path / "out2"),
                            resume=str(out / "checkpoint-4")))
    a, b = _weights(out), _weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)
    # its training time counts the interrupted run's up to that checkpoint
    before = torch.load(out / "checkpoint-4" / "trainer_state.pt", weights_only=False)["seconds"]
    assert json.loads((resumed / "skipdecode.json").read_text())["train_seconds"] >= round(before, 1) > 0
    # a resumed run keeps its learning rate: another --lr is not used, and says so
    with pytest.warns(UserWarning, match=r"--lr 0\.001 is not used: a resumed run keeps its own learning rate "
                                         r"\(0\.003\) and schedule; start a new run \(without --resume\)"):
        train(_config(tiny_dir, tmp_path, out=str(tmp_path / "out3"), lr=1e-3, max_steps=5,
                      resume=str(out / "checkpoint-4")))


def test_the_lowest_validation_loss_is_shipped_not_the_last_step(tiny_dir, tmp_path, monkeypatch):
    import tools.finetune.train as train_mod

    scripted = iter([3.0, 1.0, 2.0, 2.5, 2.7, 2.9])  # mean over the policies: lowest at step 4

    def fake_val(model, items, sampler, *args):
        value = next(scripted)
        return {f"{s:g}x": value + i * 0.1 for i, s in enumerate(sampler.speedups)}
    monkeypatch.setattr(train_mod, "evaluate_loss", fake_val)
    out = train(_config(tiny_dir, tmp_path, epochs=2, val_every=2, checkpoint_every=1))  # 6 steps
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [2, 4, 6]  # every 2 steps and the last
    assert [r["best_step"] for r in log if "val_loss" in r] == [2, 4, 4]
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["trained_from"][-1]["selected_step"] == 4
    assert meta["trained_from"][-1]["val_loss"] == {"1x": 1.0, "2x": 1.1, "3x": 1.2}
    shipped, at_4, last = _weights(out), _weights(out / "checkpoint-4"), _weights(out / "checkpoint-6")
    for name in shipped:
        torch.testing.assert_close(shipped[name], at_4[name], atol=0, rtol=0, msg=name)
    assert any(not torch.equal(shipped[n], last[n]) for n in shipped)


def test_no_select_best_ships_the_last_step(tiny_dir, tmp_path):
    out = train(_config(tiny_dir, tmp_path, epochs=1, select_best=False, checkpoint_every=1))
    shipped, last = _weights(out), _weights(out / "checkpoint-3")
    for name in shipped:
        torch.testing.assert_close(shipped[name], last[name], atol=0, rtol=0, msg=name)
    assert not (out / "best").exists()


def test_max_steps_overrides_epochs_and_the_schedule_spans_them(tiny_dir, tmp_path):
    cfg = _config(tiny_dir, tmp_path, val=None, epochs=1, max_steps=8, checkpoint_every=100)
    out = train(cfg)  # 3 steps an epoch: the data repeats into a third epoch
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert log[-1]["epoch"] == 3
    assert log[-1]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # decayed at the last step
    assert json.loads((out / "skipdecode.json").read_text())["trained_from"][-1]["max_steps"] == 8
    with pytest.raises(TrainError, match=r"--max-steps 0: give a positive number"):
        train(_config(tiny_dir, tmp_path, max_steps=0, out=str(tmp_path / "o2")))


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tiny_dir, tmp_path, monkeypatch):
    # transformers 5.17 reads the GGUF of SmolLM2-135M-Instruct with no pad token
    import tools.finetune.train as train_mod

    load = train_mod._load

    def no_pad(spec):
        model, tokenizer, meta = load(spec)
        tokenizer.pad_token = None
        assert tokenizer.pad_token_id is None
        return model, tokenizer, meta
    monkeypatch.setattr(train_mod, "_load", no_pad)
    out = train(_config(tiny_dir, tmp_path, val=None, epochs=1, checkpoint_every=100))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(r["loss"] > 0 for r in log)


def test_resume_without_a_checkpoint_says_so(tiny_dir, tmp_path):
    with pytest.raises(TrainError, match="nothing to resume"):
        train(_config(tiny_dir, tmp_path, resume="auto"))


def test_bad_speedup_fails_before_training(tiny_dir, tmp_path):
    from runtime.errors import PolicyError

    with pytest.raises(PolicyError, match="out of range for 6 layers"):
        train(_config(tiny_dir, tmp_path, speedups=(1.0, 9.0)))
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_copy_weight_that_is_no_weight_fails_before_training(tiny_dir, tmp_path):
    with pytest.raises(TrainError, match=r"--copy-weight 0: a loss weight is positive"):
        train(_config(tiny_dir, tmp_path, copy_weight=0.0))
    assert not (tmp_path / "out" / "config.json").exists()


def test_export_build_keeps_the_trained_horizon(tiny_dir, tmp_path):
    import runtime
    from export.build import BuildOptions, build

    out = train(_config(tiny_dir, tmp_path, epochs=1, speedups=(2.0,), horizon=6))
    manifest = build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False),
                     log=lambda *_: None)
    assert manifest.policy["horizon"] == 6
    gen = runtime.load(tmp_path / "art", threads=1)
    assert gen.policy_for(max_new_tokens=40, speedup=2.0) == SkipPolicy.for_speedup(6, 2.0, horizon=6)


def test_deep_copies_recorded_with_the_targets_common_words(tiny_dir, tmp_path):
    from export.build import BuildOptions, build
    from tools.finetune.data import common_words

    with pytest.raises(TrainError, match=r"--deep-copies 7: a deep step's layers lie in \[1, 6\]"):
        train(_config(tiny_dir, tmp_path, deep_copies=7))
    out = train(_config(tiny_dir, tmp_path, epochs=1, speedups=(2.0,), deep_copies=4))
    copies = json.loads((out / "skipdecode.json").read_text())["deep_copies"]
    assert copies == {"layers": 4, "common_words": sorted(common_words([e.target for e in PAIRS]))}
    manifest = build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.policy["deep_copies"] == copies  # so a default build turns them on


def test_export_build_keeps_the_trained_policy_shape(tiny_dir, tmp_path):
    import runtime
    from export.build import BuildOptions, build

    out = train(_config(tiny_dir, tmp_path, epochs=1, speedups=(2.0,), horizon=6, decay="power",
                        exponent=3.0, prefill="policy"))
    meta = json.loads((out / "skipdecode.json").read_text())
    assert (meta["decay"], meta["exponent"], meta["prefill"]) == ("power", 3.0, "policy")
    manifest = build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False),
                     log=lambda *_: None)
    assert (manifest.policy["decay"], manifest.policy["prefill"]) == ("power", "policy")
    gen = runtime.load(tmp_path / "art", threads=1)
    want = SkipPolicy.for_speedup(6, 2.0, horizon=6, decay="power", exponent=3.0, prefill="policy")
    assert gen.policy_for(max_new_tokens=40, speedup=2.0) == want
    assert gen.policy_for(max_new_tokens=40, speedup=2.0, decay="linear", prefill="full") == \
        SkipPolicy.for_speedup(6, 2.0, horizon=6)
    gen.close()


def test_faithful_only_keeps_the_references_with_no_slot_error():
    mr = "name[The Eagle], eatType[coffee shop], area[riverside]"
    pairs = [Example(mr, "The Eagle is a coffee shop by the riverside."),  # every slot
             Example(mr, "The Eagle is a coffee shop."),  # drops the area
             Example(mr, "The Eagle is a pub by the riverside."),  # another venue type
             Example(mr, "By the riverside, The Eagle coffee shop.")]
    assert faithful_pairs(pairs, "x.csv") == [pairs[0], pairs[3]]
    with pytest.raises(TrainError, match="--faithful-only judges targets against E2E meaning representations, "
                                         "but the prompts of x.csv are not all of the form 'slot\\[value\\], ...'"):
        faithful_pairs([Example("Translate: hello", "bonjour")], "x.csv")


def test_a_runs_own_policy_is_trained_recorded_and_served(tiny_dir, tmp_path):
    """--policy 2=3:3: the 2x rows train under 3->3 (not for_speedup's 5->2), skipdecode.json's
    speedup_policies says so, and the export serves it for --speedup 2."""
    import runtime
    from export.build import BuildOptions, build

    shape = dict(horizon=6, decay="power", exponent=3.0)
    out = train(_config(tiny_dir, tmp_path, epochs=1, speedups=(1.0, 2.0), policies=((2.0, 3, 3),), **shape))
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["speedup_policies"] == {"2": {"max_layers": 3, "min_layers": 3}}
    assert meta["policies"][1] == SkipPolicy(6, 3, 3, **shape).to_dict()
    build(BuildOptions(model=str(out), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    with runtime.load(tmp_path / "art", threads=1) as gen:
        assert gen.policy_for(max_new_tokens=40, speedup=2.0) == SkipPolicy(6, 3, 3, **shape)


@pytest.mark.parametrize("policies, error, message", [
    (((2.0, 4, 4),), "PolicyError", r"speedup_policies\['2'\]: 4->4 is a 1.50x policy over 6 steps, not 2x"),
    (((3.0, 2, 2),), "TrainError", "--policy names speedup 3, which --speedups does not train; add it there"),
])
def test_a_policy_that_is_not_its_speedups_fails_before_training(tiny_dir, tmp_path, policies, error, message):
    with pytest.raises(Exception, match=message) as info:
        train(_config(tiny_dir, tmp_path, speedups=(1.0, 2.0), horizon=6, policies=policies))
    assert type(info.value).__name__ == error
    assert not (tmp_path / "out" / "config.json").exists()


def test_the_policy_option_reads_speedup_max_and_min(capsys):
    from tools.finetune.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--model", "m", "--train", "t.csv", "--out", "o", "--policy", "5=18"])
    assert info.value.code == 2
    assert "'5=18' is not S=MAX:MIN (e.g. 5=18:3)" in capsys.readouterr().err
