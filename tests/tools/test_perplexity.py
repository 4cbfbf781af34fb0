"""tools.evaluate.perplexity: full depth is transformers' own perplexity, the layers reported are
the policy's, and bad input gets one line."""

import math

import pytest
import torch
import torch.nn.functional as F

from export.checkpoint import build_tokenizer
from runtime.models import skip_model
from tests.families import tiny_model
from tools.evaluate import perplexity as ppl

TEXT = " ".join(f"the {w} cafe serves food near the river, rated {n} of 5." for n, w in
                enumerate(["Eagle", "Mill", "Punter", "Wrestlers", "Phoenix", "Olive"] * 4))
SETTINGS = ppl.Settings(prompt_tokens=8, tokens=16, windows=5, batch_size=2)


@pytest.fixture(scope="module")
def setup():
    hf = tiny_model("smollm2")
    ids = ppl.windows(build_tokenizer(), TEXT, SETTINGS)
    return hf, skip_model(hf), ids


def test_full_depth_is_transformers_perplexity(setup):
    hf, model, ids = setup
    (row,) = ppl.measure(model, ids, ppl.policies(model.num_layers, [1], SETTINGS), SETTINGS, progress=False)
    p = SETTINGS.prompt_tokens
    with torch.no_grad():
        logits = hf(ids).logits[:, p - 1:-1]  # each scored token from the position before it
    expected = math.exp(float(F.cross_entropy(logits.flatten(0, 1), ids[:, p:].flatten())))
    assert ids.shape == (5, 24) and row.layers_per_token == model.num_layers
    assert row.perplexity == pytest.approx(expected, rel=1e-5)


def test_a_skip_policy_reports_its_own_layers_and_changes_the_perplexity(setup):
    _, model, ids = setup
    policies = ppl.policies(model.num_layers, [1, 2], SETTINGS)
    full, half = ppl.measure(model, ids, policies, SETTINGS, progress=False)
    # the first scored token comes from the full-depth prompt, the others from decode steps 0 ...
    budgets = [model.num_layers] + [policies[2].budget(g) for g in range(SETTINGS.tokens - 1)]
    assert half.layers_per_token == pytest.approx(sum(budgets) / len(budgets))
    assert half.perplexity != pytest.approx(full.perplexity, rel=1e-3)
    assert "| 2x | SkipPolicy(L=5, layers" in ppl.table([full, half])


def test_a_text_shorter_than_one_window_is_refused(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ppl.PerplexityError, match=r"the text has \d+ tokens, fewer than one window of 24 "
                                                  r"\(--prompt-tokens 8 \+ --tokens 16\)"):
        ppl.windows(build_tokenizer(), short.read_text(), SETTINGS)
    data = tmp_path / "pairs.csv"
    data.write_text("mr,ref\na,b\n")
    assert ppl.main(["--model", "tiny-random", "--text", str(data), "--column", "text", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {data} has no column 'text'; its columns: mr, ref\n"
    assert ppl.main(["--model", "tiny-random", "--text", str(short), "--windows", "0", "-q"]) == 2
    assert capsys.readouterr().err == "error: --windows must be >= 1, got 0\n"


def test_draft_adapters_score_the_skipping_tokens_alone(setup, tmp_path):
    """--draft-adapter: full depth is the model's own perplexity to the bit; under a skip policy the
    adapter (gated to the skipping tokens) changes it."""
    pytest.importorskip("peft")
    from tools.finetune import lora

    hf, model, ids = setup
    adapted = lora.inject(tiny_model("smollm2"), 4, 8.0)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    lora.save(adapted, tmp_path / "adapter", 4, 8.0, "base")
    drafts = ppl.with_drafts(tiny_model("smollm2"), str(tmp_path / "adapter"))
    policies = ppl.policies(model.num_layers, [1, 2], SETTINGS)
    own = ppl.measure(model, ids, policies, SETTINGS, progress=False)
    gated = ppl.measure(skip_model(drafts), ids, policies, SETTINGS, progress=False, drafts=drafts)
    assert gated[0].perplexity == own[0].perplexity
    assert gated[1].perplexity != pytest.approx(own[1].perplexity, rel=1e-3)


def test_warmup_layers_sets_the_policies_bottom_layers(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = ["--model", "tiny-random", "--text", str(text), "--speedups", "1", "2", "--prompt-tokens", "8",
              "--tokens", "16", "--windows", "2", "-q"]
    assert ppl.main(common + ["--warmup-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 2x | SkipPolicy(" in out and "warm-up 2" in out and "warm-up 1" not in out
    assert ppl.main(common + ["--warmup-layers", "99"]) == 2
    err = capsys.readouterr().err
    assert err == "error: warmup_layers must lie in [0, 8] (the model's layers), got 99\n"


def test_policy_scores_a_speedup_under_its_own_budgets(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    common = ["--model", "tiny-random", "--text", str(text), "--speedups", "1", "2", "--prompt-tokens", "8",
              "--tokens", "16", "--windows", "2", "-q"]
    assert ppl.main(common) == 0
    picked = capsys.readouterr().out
    assert ppl.main(common + ["--policy", "2=4:4"]) == 0  # 2x flat: 4 of the 8 layers at every step
    flat = capsys.readouterr().out
    assert "| 2x | SkipPolicy(L=8, layers 4->4 over 16 steps" in flat and "layers 4->4" not in picked
    row = next(line for line in flat.splitlines() if line.startswith("| 2x"))
    assert row.split("|")[3].strip() == "4.2"  # the first scored token from the full-depth prompt: (8 + 15 x 4) / 16
    assert ppl.main(common + ["--policy", "3=4:2"]) == 2
    assert capsys.readouterr().err == "error: --policy names speedup 3, which --speedups does not score; add it there\n"
    assert ppl.main(common + ["--policy", "2=8:6"]) == 2
    assert "8->6 is a 1.1" in capsys.readouterr().err  # a policy of another speedup than its key's
    with pytest.raises(SystemExit):
        ppl.main(common + ["--policy", "2=4"])
    assert "'2=4' is not S=MAX:MIN (e.g. 5=18:3)" in capsys.readouterr().err
