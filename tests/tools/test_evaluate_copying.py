"""tools.evaluate.copying: teacher-forced argmax accuracy of the tokens that copy a new name from
the prompt, per policy, on a tiny random model; full depth's figures are the model's own forward
pass's."""

import csv

import pytest
import torch

from tests.families import save_tiny_checkpoint
from tools.evaluate import copying

# 120 names, each in one target: rare words (in under 1% of the targets), as new venue names are
NAMES = [f"{a}{b}" for a in ("Zor", "Tov", "Quil", "Bras", "Kel", "Mev", "Dra", "Fen", "Gor", "Hal", "Jin", "Lys")
         for b in ("blax", "selbri", "lon", "tovik", "varo", "quay", "mira", "dune", "pell", "tarn")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("copying")
    ckpt = save_tiny_checkpoint(d / "ckpt", "llama3")
    path = d / "mrs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref"])
        for k, name in enumerate(NAMES):
            w.writerow([f"name[{name}], food[French]", f"{name} serves French food."])
            w.writerow([f"name[{name}], food[French]", "A second reference, not scored."])
    return ckpt, path


def test_full_depth_is_the_models_own_argmax(data):
    from export import checkpoint
    from runtime.models import skip_model
    from runtime.policy import SkipPolicy

    ckpt, path = data
    hf, tok = checkpoint.load(checkpoint.resolve(str(ckpt)), dtype=torch.float32)
    examples = copying.pairs(path, "mr", "ref")
    assert [e.target for e in examples] == [f"{n} serves French food." for n in NAMES]  # the first of each
    items = copying.encoded(tok, examples, mrs=6)
    model = skip_model(hf).eval()
    L = model.num_layers
    full, skipping = copying.measure(model, items, {"1x": SkipPolicy(L, L, L), "budget 2": SkipPolicy(L, 2, 2)},
                                     tok.eos_token_id)
    right = [0, 0]
    counts = [0, 0]
    for e in items:  # one pair at a time through the Hugging Face model itself
        with torch.no_grad():
            logits = hf(torch.tensor([e.input_ids])).logits[0]
        for t in range(e.prompt_len - 1, len(e.input_ids) - 1):
            k = 0 if e.weights[t - e.prompt_len + 1] > 1 else 1
            right[k] += int(logits[t].argmax() == e.input_ids[t + 1])
            counts[k] += 1
    assert counts[0] > 0 and (full.copied_tokens, full.other_tokens) == tuple(counts)
    assert (full.copied, full.other) == (right[0] / counts[0], right[1] / counts[1])
    assert skipping.copied_tokens == full.copied_tokens and skipping.policy.startswith("budget 2: SkipPolicy")


def test_the_cli_prints_a_row_a_policy_and_refuses_a_missing_column(data, capsys):
    ckpt, path = data
    assert copying.main(["--model", str(ckpt), "--data", str(path), "--speedups", "1", "--budgets", "2",
                         "--policy", '{"max_layers": 3, "min_layers": 2}', "--mrs", "4", "-q"]) == 0
    out = capsys.readouterr().out
    assert "4 of the 120 prompts" in out and out.count("| 1x: SkipPolicy") == 1 and "| budget 2: " in out
    assert '| {"max_layers": 3, "min_layers": 2}: SkipPolicy' in out
    assert copying.main(["--model", str(ckpt), "--data", str(path), "--target-column", "text", "-q"]) == 2
    assert "has no column 'text'; its columns: mr, ref" in capsys.readouterr().err
