"""tools.finetune.bridge: closed-form linear bridges over the skipped layers. The identity is plain
skipping to the bit, the fitted maps predict full depth's states better than it, full depth never
meets one, and tools.evaluate.perplexity and tools.finetune read the file the command writes."""

import pytest
import torch
from transformers import OPTForCausalLM

from runtime.models import skip_model
from runtime.policy import SkipPolicy
from tests.conftest import save_tiny_checkpoint
from tests.families import tiny_model
from tools.evaluate import perplexity as ppl
from tools.finetune import bridge
from tools.finetune.skip import layer_mask, skip_forward


@pytest.fixture(scope="module")
def model():
    return skip_model(tiny_model("smollm2")).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("bridge-base"), "pre_ln", max_position_embeddings=128)


def _ids(seed: int, n: int = 6, T: int = 24) -> torch.Tensor:
    return torch.randint(4, 512, (n, T), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, policy, bridges=None):
    B, T = ids.shape
    with torch.no_grad():
        return skip_forward(model, ids, torch.ones_like(ids), layer_mask([policy] * B, torch.full((B,), 8), T), bridges)


def test_identity_bridges_are_plain_skipping_and_full_depth_meets_none(model):
    L, D = model.num_layers, model.config.hidden_size
    identity = {s: torch.eye(D + 1, D) for s in range(2, L)}
    ids, skipping = _ids(0), SkipPolicy(L, 4, 2, horizon=8)
    assert torch.equal(_logits(model, ids, skipping, identity), _logits(model, ids, skipping))
    fitted = bridge.fit(model, _ids(1), progress=False)
    full = SkipPolicy(L, L, L)
    assert torch.equal(_logits(model, ids, full, fitted), _logits(model, ids, full))
    assert not torch.allclose(_logits(model, ids, skipping, fitted), _logits(model, ids, skipping))


def test_fitted_bridges_predict_full_depth_better_than_skipping(model):
    fitted = bridge.fit(model, _ids(1), ridge=0.0, progress=False, batch_size=4)
    assert sorted(fitted) == list(range(2, model.num_layers))  # every layer a step can jump to
    assert all(m.shape == (model.config.hidden_size + 1, model.config.hidden_size) for m in fitted.values())
    # on the text they were fitted on, least squares cannot do worse than the identity, one of its choices
    for s, (plain, bridged) in bridge.errors(model, _ids(1), fitted).items():
        assert bridged < 0.9 * plain, s
    # a huge ridge gives plain skipping back
    for m in bridge.fit(model, _ids(1), ridge=1e9, progress=False).values():
        assert torch.allclose(m, torch.eye(*m.shape), atol=1e-4)


def test_bad_settings_say_what_is_allowed(model):
    with pytest.raises(bridge.BridgeError, match=r"warmup_layers must leave a layer to skip and one to jump to: "
                                         r"1 <= warmup_layers < 4, got 4"):
        bridge.fit(model, _ids(1), warmup_layers=4, progress=False)
    with pytest.raises(bridge.BridgeError, match="ridge must be >= 0, got -1"):
        bridge.fit(model, _ids(1), ridge=-1, progress=False)


def test_the_command_fits_a_file_perplexity_and_training_read(tmp_path, capsys):
    words = ["river", "cafe", "food", "price", "family", "rating", "centre", "pub"]
    fit_text = tmp_path / "fit.txt"
    fit_text.write_text(" ".join(f"the {w} near {v} is {n}." for n, (w, v) in
                                 enumerate(zip(words * 40, reversed(words * 40)))))
    scored = tmp_path / "scored.txt"
    scored.write_text(" ".join(f"a {w} by the {v}, number {n}." for n, (w, v) in enumerate(zip(words * 30, words[1:] * 30))))
    out = tmp_path / "bridges" / "b.safetensors"
    assert bridge.main(["--model", "tiny-random", "--text", str(fit_text), "--windows", "4", "--out", str(out), "-q"]) == 0
    assert capsys.readouterr().out == f"{out}: 6 bridges (layers 2-7) fitted on 640 tokens of {fit_text}, ridge 0.1\n"
    assert [p.name for p in out.parent.iterdir()] == ["b.safetensors"]  # no partial file left
    args = ["--model", "tiny-random", "--text", str(scored), "--speedups", "1", "2", "--prompt-tokens", "8",
            "--tokens", "16", "--windows", "4", "-q"]
    assert ppl.main(args) == 0
    plain = capsys.readouterr().out.splitlines()
    assert ppl.main(args + ["--bridges", str(out)]) == 0
    bridged = capsys.readouterr().out.splitlines()
    assert bridged[0] == plain[0] + f", bridges {out}"
    assert bridged[3] == plain[3]  # full depth: no token jumps
    assert bridged[4] != plain[4] and bridged[4].startswith("| 2x |")


def test_a_file_that_does_not_fit_the_model_is_refused(model, tmp_path, capsys):
    D = model.config.hidden_size
    bridge.save({2: torch.zeros(D, D)}, tmp_path / "wrong.safetensors")
    with pytest.raises(bridge.BridgeError, match=rf"layer_02 of shape \({D}, {D}\) does not fit this model "
                                                 rf"\(5 layers, hidden size {D}: a bridge per layer 2..4"):
        bridge.load(tmp_path / "wrong.safetensors", model)
    assert bridge.main(["--model", "tiny-random", "--text", str(tmp_path / "none.txt"), "--out",
                        str(tmp_path / "b.safetensors"), "-q"]) == 2
    assert capsys.readouterr().err == f"error: text file {tmp_path / 'none.txt'} does not exist\n"
    assert not (tmp_path / "b.safetensors").exists()


def test_training_runs_the_jumps_through_the_bridges_it_is_given(tiny_dir, tmp_path):
    import json

    from tests.tools.test_finetune import _config
    from tools.finetune.train import train

    skip = skip_model(OPTForCausalLM.from_pretrained(tiny_dir)).eval()
    fit = torch.randint(4, 500, (4, 24), generator=torch.Generator().manual_seed(3))
    bridge.save(bridge.fit(skip, fit, ridge=0.0, progress=False), tmp_path / "b.safetensors")

    def first_loss(name, **kw):
        out = train(_config(tiny_dir, tmp_path, out=str(tmp_path / name), max_steps=1, val=None, **kw))
        meta = json.loads((out / "skipdecode.json").read_text())
        return json.loads((out / "train_log.jsonl").read_text().splitlines()[0])["loss"], meta

    plain, _ = first_loss("plain")
    bridged, meta = first_loss("bridged", bridges=str(tmp_path / "b.safetensors"))
    assert bridged != plain and meta["trained_from"][-1]["bridges"] == str(tmp_path / "b.safetensors")
