"""``python -m tools.e2e distill``: the fine-tuning targets are the full-depth model's own finished,
slot-error-free descriptions, one per training MR."""

from types import SimpleNamespace

import runtime
from tools.e2e.__main__ import main
from tools.finetune.data import Example, read_pairs, write_csv

MRS = ["name[Alimentum], food[French]", "name[The Eagle], area[riverside]", "name[Zizzi], eatType[pub]"]
TEXTS = {MRS[0]: " Alimentum serves French food.",  # faithful: kept
         MRS[1]: " The Eagle is a restaurant.",  # the area is missing: dropped
         MRS[2]: " Zizzi is a pub"}  # cut at max_new_tokens (see below): dropped


class FakeGenerator:
    num_layers = 4

    def __init__(self):
        self.calls = []

    def generate(self, prompts, max_new_tokens, policy):
        self.calls.append((list(prompts), max_new_tokens, policy))
        ids = [[5] * (max_new_tokens if p == MRS[2] else 3) for p in prompts]
        return SimpleNamespace(texts=[TEXTS[p] for p in prompts], token_ids=ids)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_distill_keeps_finished_faithful_descriptions_at_full_depth(tmp_path, monkeypatch, capsys):
    fake = FakeGenerator()
    monkeypatch.setattr(runtime, "load", lambda directory, **kw: fake)
    # two references of MR 0: it is generated once
    write_csv(tmp_path / "train.csv", [Example(MRS[0], "a"), Example(MRS[1], "b"), Example(MRS[0], "c"),
                                       Example(MRS[2], "d")], "mr", "ref")
    out = tmp_path / "distill.csv"
    assert main(["distill", "--model", "unused", "--train", str(tmp_path / "train.csv"), "--out", str(out),
                 "--batch-size", "2", "--max-new-tokens", "8"]) == 0
    assert read_pairs(out, "mr", "ref") == [Example(MRS[0], "Alimentum serves French food.")]
    assert [c[0] for c in fake.calls] == [MRS[:2], MRS[2:]]
    assert all(c[2].is_full_depth for c in fake.calls)
    assert "1 of 3 MRs kept (2 with a slot error or unfinished)" in capsys.readouterr().out


def test_distill_with_nothing_faithful_says_to_train_longer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "load", lambda directory, **kw: FakeGenerator())
    write_csv(tmp_path / "train.csv", [Example(MRS[1], "b")], "mr", "ref")
    assert main(["distill", "--model", "m", "--train", str(tmp_path / "train.csv"),
                 "--out", str(tmp_path / "d.csv")]) == 2
    assert "none of its 1 descriptions is finished and free of slot errors" in capsys.readouterr().err
    assert not (tmp_path / "d.csv").exists()
