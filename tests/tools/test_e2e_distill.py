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


def test_distill_on_the_demo_model_keeps_its_own_faithful_descriptions(tmp_path, capsys):
    """The real path, not a fake: the shipped demo model's export describes three development MRs at
    full depth; what distill writes is exactly its finished, slot-error-free greedy texts."""
    from export.build import BuildOptions, build
    from tools.evaluate.slots import slot_errors

    art = tmp_path / "demo"
    build(BuildOptions(out=str(art), progress=False, check=False), log=lambda *_: None)
    mrs = ["name[The Eagle], eatType[coffee shop], food[French], area[riverside]",
           "name[Alimentum], area[city centre], familyFriendly[no]",
           "name[Zizzi], eatType[pub], food[Italian], customer rating[high], near[Burger King]"]
    write_csv(tmp_path / "train.csv", [Example(mr, "ref") for mr in mrs], "mr", "ref")
    out = tmp_path / "distill.csv"
    assert main(["distill", "--model", str(art), "--train", str(tmp_path / "train.csv"), "--out", str(out),
                 "--batch-size", "2", "--max-new-tokens", "48"]) == 0
    kept = read_pairs(out, "mr", "ref")
    with runtime.load(art) as gen:
        result = gen.generate(mrs, 48)
    expected = [Example(mr, text.strip()) for mr, text, ids in zip(mrs, result.texts, result.token_ids)
                if len(ids) < 48 and not slot_errors(mr, text.strip()).errors]
    assert kept == expected and kept  # the demo model describes most MRs faithfully
    assert f"{len(kept)} of 3 MRs kept" in capsys.readouterr().out
