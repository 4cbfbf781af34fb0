"""``python -m tools.e2e consensus``: one target per training MR, the faithful description without a
repeated value that is closest (sentence BLEU) to the MR's other references."""

from tools.e2e.__main__ import main
from tools.finetune.data import Example, read_pairs, write_csv

MR = "name[Zizzi], food[Italian], area[riverside]"
SHARED = "Zizzi serves Italian food in the riverside area."
REFS = [
    "Zizzi serves Italian food by the river.",  # faithful, close to the others
    SHARED,  # faithful and closest: shares most n-grams with the rest
    "Zizzi serves Italian food in the riverside area near the riverside.",  # states the area twice
    "Zizzi serves food in the riverside area.",  # drops the cuisine: a slot error
    "In the riverside area, Zizzi serves Italian food in the riverside area.",
]
LONE = "name[The Eagle], eatType[pub]"


def _pairs(tmp_path, name, pairs):
    write_csv(tmp_path / name, [Example(mr, text) for mr, text in pairs], "mr", "ref")
    return str(tmp_path / name)


def test_consensus_keeps_the_faithful_reference_closest_to_the_others(tmp_path, capsys):
    train = _pairs(tmp_path, "train.csv", [(MR, r) for r in REFS] + [(LONE, "The Eagle is a pub.")])
    out = tmp_path / "c.csv"
    assert main(["consensus", "--train", train, "--out", str(out)]) == 0
    # one pair per MR, in the training file's order; a lone faithful reference is its own consensus
    assert read_pairs(out, "mr", "ref") == [Example(MR, SHARED), Example(LONE, "The Eagle is a pub.")]
    assert "2 of 2 MRs kept (0 without a faithful candidate; 0 targets from --candidates)" in capsys.readouterr().out


def test_consensus_weighs_the_candidates_against_every_reference(tmp_path, capsys):
    train = _pairs(tmp_path, "train.csv", [(MR, r) for r in REFS[:1] + REFS[2:]] + [(LONE, "A cafe.")])
    candidates = _pairs(tmp_path, "distilled.csv", [(MR, SHARED), (LONE, "The Eagle is a pub. The Eagle is a pub")])
    out = tmp_path / "c.csv"
    assert main(["consensus", "--train", train, "--candidates", candidates, "--out", str(out)]) == 0
    # the candidate beats the references; LONE's reference is unfaithful (no name, a cafe for a
    # pub) and its candidate is kept: a name stated twice is not a repeated value
    assert read_pairs(out, "mr", "ref") == [Example(MR, SHARED), Example(LONE, "The Eagle is a pub. The Eagle is a pub")]
    assert "2 targets from --candidates" in capsys.readouterr().out


def test_consensus_with_nothing_faithful_writes_nothing(tmp_path, capsys):
    train = _pairs(tmp_path, "train.csv", [(MR, REFS[3])])
    assert main(["consensus", "--train", train, "--out", str(tmp_path / "c.csv")]) == 2
    assert "no MR has a faithful description without repeated values" in capsys.readouterr().err
    assert not (tmp_path / "c.csv").exists()


def test_consensus_of_prompts_that_are_not_mrs_says_so(tmp_path, capsys):
    train = _pairs(tmp_path, "train.csv", [("What is the capital of France?", "Paris.")])
    assert main(["consensus", "--train", train, "--out", str(tmp_path / "c.csv")]) == 2
    assert "its 'mr' column is not all of the form 'slot[value], ...'" in capsys.readouterr().err


def test_consensus_chooses_among_the_candidates_of_several_files(tmp_path, capsys):
    train = _pairs(tmp_path, "train.csv", [(MR, r) for r in REFS[:1] + REFS[2:]] + [(LONE, "A cafe.")])
    # two models' descriptions: the closest to the references is in the second file, the first
    # file's is unfaithful; LONE is described by the first file only
    first = _pairs(tmp_path, "a.csv", [(MR, REFS[3]), (LONE, "The Eagle is a pub.")])
    second = _pairs(tmp_path, "b.csv", [(MR, SHARED)])
    out = tmp_path / "c.csv"
    assert main(["consensus", "--train", train, "--candidates", first, second, "--out", str(out)]) == 0
    assert read_pairs(out, "mr", "ref") == [Example(MR, SHARED), Example(LONE, "The Eagle is a pub.")]
    assert "2 targets from --candidates" in capsys.readouterr().out
