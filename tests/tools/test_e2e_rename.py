"""``python -m tools.e2e rename``: copies of E2E pairs with invented venue names, the same in the MR
and its descriptions, from two pools with no word in common."""

import random

from tools.e2e.__main__ import main
from tools.e2e.names import POOLS, invent, rename_text
from tools.evaluate.slots import VENUES, parse_mr, slot_errors
from tools.finetune.data import Example, group_by_prompt, read_pairs, write_csv

MR = "name[The Eagle], eatType[pub], near[Burger King]"
TEXTS = ["The Eagle is a pub near Burger King.", "Near Burger King, the Eagle's pub is open.",
         "Eagles is a pub near Burger King."]  # the last spells the name in a way the slot rules miss


def _words(pool):
    return {w.lower() for part in POOLS[pool][:2] for x in part for w in x.split()}


def test_the_pools_share_no_word_with_each_other_or_the_e2e_venues():
    venue_words = {w.lower() for v in VENUES for w in v.split()}
    assert not _words("train") & _words("dev")
    assert not (_words("train") | _words("dev")) & venue_words
    train = {invent(random.Random(k), "train") for k in range(300)}
    dev = {invent(random.Random(k), "dev") for k in range(300)}
    assert len(train) > 250 and len(dev) > 250 and not train & dev


def test_the_wide_pool_shares_no_word_with_the_dev_pool_and_only_chosen_ones_with_e2e_venues():
    from tools.e2e.names import SHARED, wide_words

    words = {w.lower() for w in wide_words()}
    venue_words = {w.lower() for v in VENUES for w in v.split()}
    assert len(words) > 5000 and not words & (_words("dev") | _words("train") | venue_words)
    assert {w.lower() for w in SHARED} <= venue_words
    names = [invent(random.Random(k), "wide") for k in range(300)]
    assert len(set(names)) > 295 and not set(names) & set(VENUES)
    # a word of a wide name is one of the pool's, a shared one, a syllable word or a form's own word
    assert not {w.lower().removesuffix("'s") for n in names for w in n.split()} & (_words("dev") - {"the"})
    assert sum(any(w in SHARED for w in n.split()) for n in names) > 10  # "Golden Marrow" beside new words


def test_rename_text_keeps_a_possessive_and_an_optional_the():
    mapping = {"The Eagle": "Lantern Quay", "Burger King": "The Copper Kettle"}
    assert rename_text(TEXTS[1], mapping) == "Near The Copper Kettle, Lantern Quay's pub is open."
    assert rename_text(TEXTS[0], mapping) == "Lantern Quay is a pub near The Copper Kettle."


def test_rename_writes_faithful_copies_with_new_names(tmp_path, capsys):
    data = tmp_path / "pairs.csv"
    write_csv(data, [Example(MR, t) for t in TEXTS], "mr", "ref")
    out = tmp_path / "renamed.csv"
    assert main(["rename", "--data", str(data), "--out", str(out), "--copies", "2", "--keep-original"]) == 0
    groups = group_by_prompt(read_pairs(out, "mr", "ref"))
    assert groups[MR] == TEXTS
    renamed = [mr for mr in groups if mr != MR]
    assert len(renamed) == 2  # two copies, each with names of its own
    for mr in renamed:
        slots = parse_mr(mr)
        assert slots["eatType"] == "pub" and slots["name"] not in VENUES and slots["near"] not in VENUES
        assert len(groups[mr]) == 2  # "Eagles" is dropped: the old name would stay in it
        for text in groups[mr]:
            assert not slot_errors(slots, text).errors, text
    assert "7 pairs over 3 MRs (2 renamed descriptions dropped" in capsys.readouterr().out
    # the same seed, the same names
    again = tmp_path / "again.csv"
    main(["rename", "--data", str(data), "--out", str(again), "--copies", "2", "--keep-original"])
    assert read_pairs(again, "mr", "ref") == read_pairs(out, "mr", "ref")


def test_rename_of_prompts_that_are_not_mrs_says_so(tmp_path, capsys):
    data = tmp_path / "pairs.csv"
    write_csv(data, [Example("What is the capital of France?", "Paris.")], "mr", "ref")
    assert main(["rename", "--data", str(data), "--out", str(tmp_path / "r.csv")]) == 2
    assert "is not all of that form" in capsys.readouterr().err
    assert not (tmp_path / "r.csv").exists()
