import copy

import torch

from runtime.models.opt import SkipOPT
from runtime.policy import SkipPolicy
from tests.conftest import PROMPTS

LOGIT_ATOL = 1e-4  # fp32 reimplementation vs transformers' OPT: differences are rounding only


def encode(tokenizer, prompts=PROMPTS):
    return tokenizer(prompts, padding=True, return_tensors="pt")


def test_full_depth_logits_match_transformers(hf_model, tokenizer):
    enc = encode(tokenizer)
    with torch.no_grad():
        expected = hf_model(**enc).logits
    logits, _ = SkipOPT(hf_model)(enc["input_ids"], enc["attention_mask"])
    real = enc["attention_mask"].bool()  # padded positions are never read
    torch.testing.assert_close(logits[real], expected[real], atol=LOGIT_ATOL, rtol=0)


def test_full_depth_greedy_matches_transformers_generate(hf_model, tokenizer):
    enc = encode(tokenizer)
    with torch.no_grad():
        expected = hf_model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=2)
    out = SkipOPT(hf_model).greedy(enc["input_ids"], enc["attention_mask"], 12, eos_token_id=2)
    assert out.tokens.tolist() == expected[:, enc["input_ids"].shape[1]:].tolist()


def test_skipped_layers_keep_their_cache_and_hidden_state_passes_through(hf_model, tokenizer):
    model = SkipOPT(hf_model)
    enc = encode(tokenizer)
    _, past = model(enc["input_ids"], enc["attention_mask"])
    policy = SkipPolicy(model.num_layers, 3, 3, warmup_layers=1)
    active = policy.active_layers(0)  # (0, L-2, L-1)
    token = torch.full((len(PROMPTS), 1), 5)
    mask = torch.cat([enc["attention_mask"], torch.ones(len(PROMPTS), 1, dtype=torch.long)], 1)
    logits, new_past = model(token, mask, past, active)
    for i in range(model.num_layers):
        grew = new_past[i][0].shape[2] == past[i][0].shape[2] + 1
        assert grew == (i in active), f"layer {i}"
    # The hidden state leaves warm-up layer 0 and enters layer L-2 unchanged.
    with torch.no_grad():
        h = model.embed(token, mask)
        for i in active:
            h, _, _ = model.layers[i](h, mask, *past[i])
        torch.testing.assert_close(model.head(h), logits, atol=0, rtol=0)


def test_skip_policy_changes_the_output(hf_model, tokenizer):
    enc = encode(tokenizer)
    model = SkipOPT(hf_model)
    full = model.greedy(enc["input_ids"], enc["attention_mask"], 8)
    skipped = model.greedy(enc["input_ids"], enc["attention_mask"], 8, SkipPolicy(model.num_layers, 2, 1, 1, 4))
    assert skipped.step_layers[0] == (0, model.num_layers - 1)
    assert skipped.step_layers[-1] == (0,)
    torch.testing.assert_close(skipped.step_logits[0], full.step_logits[0])  # prompt at full depth
    assert not torch.allclose(skipped.step_logits[2], full.step_logits[2])


def test_fp16_reference_stays_finite_on_padding(hf_model, tokenizer):
    model = SkipOPT(copy.deepcopy(hf_model).to(torch.float16))  # the fixture is shared: leave it fp32
    enc = encode(tokenizer)
    logits, past = model(enc["input_ids"], enc["attention_mask"])
    assert torch.isfinite(logits).all(), "fully masked padding rows must not turn into NaN"
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in past)
