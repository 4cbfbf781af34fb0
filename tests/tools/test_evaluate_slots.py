"""tools.evaluate.slots: the E2E slot error rules on hand-written texts, and the slot errors, the
references' rate and the per-round speedup spread on the page."""

from __future__ import annotations

import pytest

from tools.evaluate import report, summary as summary_mod, targets as targets_mod
from tools.evaluate.slots import is_mr_list, parse_mr, repeated_values, slot_errors, summarize

MR = ("name[The Eagle], eatType[coffee shop], food[French], priceRange[cheap], "
      "customer rating[5 out of 5], area[riverside], familyFriendly[no], near[Burger King]")
FAITHFUL = ("The Eagle is a cheap French coffee shop near Burger King by the riverside. It has a "
            "customer rating of 5 out of 5 and is not family-friendly.")


def test_parse_mr():
    assert parse_mr("name[The Eagle], food[French]") == {"name": "The Eagle", "food": "French"}
    assert parse_mr("customer rating[5 out of 5]") == {"customer rating": "5 out of 5"}
    assert parse_mr("a cat?") is None and parse_mr("name[X] trailing") is None
    assert is_mr_list([MR, "name[A]"]) and not is_mr_list([MR, "a cat?"]) and not is_mr_list([])


def test_a_faithful_text_has_no_error():
    e = slot_errors(MR, FAITHFUL)
    assert (e.slots, e.missing, e.wrong) == (8, [], [])


@pytest.mark.parametrize("text, missing", [
    (FAITHFUL.replace("French ", ""), [("food", "French")]),
    (FAITHFUL.replace(" near Burger King", ""), [("near", "Burger King")]),
    (FAITHFUL.replace(" and is not family-friendly", ""), [("familyFriendly", "no")]),
    (FAITHFUL.replace("is not family-friendly", "is family-friendly"), [("familyFriendly", "no")]),
    (FAITHFUL.replace("The Eagle", "It"), [("name", "The Eagle")]),
    (FAITHFUL.replace(" by the riverside", ""), [("area", "riverside")]),
])
def test_missing_values(text, missing):
    assert slot_errors(MR, text).missing == missing


@pytest.mark.parametrize("text, wrong", [
    (FAITHFUL.replace("French", "French and Italian"), [("food", "Italian")]),
    (FAITHFUL.replace("coffee shop", "coffee shop and pub"), [("eatType", "pub")]),
    (FAITHFUL.replace("by the riverside", "by the riverside in the city centre"), [("area", "city centre")]),
    (FAITHFUL.replace("near Burger King", "near Burger King and Café Rouge"), [("venue", "Café Rouge")]),
])
def test_values_the_mr_does_not_hold(text, wrong):
    e = slot_errors(MR, text)
    assert e.wrong == wrong and e.missing == []


def test_venue_names_realise_no_other_slot():
    mr = "name[The Golden Curry], eatType[pub], near[Café Rouge]"
    # "Curry" and "Café" inside venue names are neither Indian food nor a coffee shop
    assert slot_errors(mr, "The Golden Curry is a pub near Café Rouge.").errors == 0
    assert slot_errors(mr + ", food[Indian]", "The Golden Curry is a pub near Café Rouge.").missing \
        == [("food", "Indian")]
    # an MR without an eatType: asserting one is an error; "restaurant" is generic
    assert slot_errors("name[Zizzi]", "Zizzi is a coffee shop.").wrong == [("eatType", "coffee shop")]
    assert slot_errors("name[Zizzi]", "Zizzi is a restaurant.").errors == 0


def test_rule_variants():
    assert slot_errors("near[Crowne Plaza Hotel]", "It is near the Crown Plaza.").errors == 0
    assert slot_errors("name[The Eagle], familyFriendly[yes]", "Eagle's is kid friendly.").errors == 0
    assert slot_errors("area[city centre]", "It is in the centre of town.").errors == 0
    assert slot_errors("food[English]", "Prices in English pounds.").missing == [("food", "English")]
    assert slot_errors("priceRange[£20-25]", "It costs £20-25.").errors == 0


def test_repeated_values_are_the_near_area_and_food_stated_twice():
    assert repeated_values(MR, FAITHFUL) == []
    twice = FAITHFUL + " It is located near Burger King by the river, serving French food."
    assert repeated_values(MR, twice) == [("near", "Burger King"), ("area", "riverside"), ("food", "French")]
    # a venue's own words are not its slot's value: Burger King is no second fast food
    assert repeated_values("name[Zizzi], food[Fast food], near[Burger King]",
                           "Zizzi serves fast food near Burger King.") == []
    # the name may come back ("Zizzi ... Zizzi's prices"): not counted
    assert repeated_values("name[Zizzi], food[Italian]", "Zizzi is Italian. Zizzi is cheap.") == []


def test_summary_counts_slots_not_texts():
    s = summarize([MR, "name[Zizzi], food[Italian]"], [FAITHFUL, "Zizzi serves Chinese food."])
    # second text: Italian missing, Chinese wrong; 10 slots in all
    assert (s.slots, s.missing, s.wrong, s.texts_with_errors) == (10, 1, 1, 1)
    assert s.rate == pytest.approx(20.0) and s.texts_with_errors_pct == pytest.approx(50.0)
    with pytest.raises(ValueError, match="2 MRs but 1 texts"):
        summarize([MR, MR], [FAITHFUL])


# -- on the page --------------------------------------------------------------------------------

def _run(speedup, hyps, rounds):
    L = 6
    policy = {"num_layers": L, "max_layers": L if speedup == 1 else 3, "min_layers": L if speedup == 1 else 2,
              "warmup_layers": 1, "horizon": 31}
    return {"speedup": speedup, "policy": policy, "hypotheses": hyps, "decode_steps": 10,
            "layers_run": 10 * (L if speedup == 1 else 2), "generated_tokens": 20, "prefill_seconds": 0.1,
            "timing": {"rounds": len(rounds), "decode_seconds": sum(rounds), "decode_steps": 10 * len(rounds),
                       "round_decode_seconds": list(rounds), "round_decode_steps": [10] * len(rounds)}}


def e2e_results() -> dict:
    prompts = [MR, "name[Zizzi], food[Italian]"]
    refs = [[FAITHFUL, "The Eagle is a coffee shop."], ["Zizzi serves Italian food."]]
    return {
        "tool": "tools.evaluate", "argv": ["--data", "dev.csv"],
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 8.0, "python": "3.11", "versions": {}},
        "settings": {"data": "dev.csv", "prompt_column": "mr", "target_column": "ref", "limit": None,
                     "pairs": 3, "max_new_tokens": 64, "batch_size": 16, "speedups": [1.0, 5.0],
                     "backend": "onnxruntime", "threads": 1, "timing_rounds": 3, "seed": 0},
        "prompts": prompts, "references": refs, "elapsed_s": 1.0,
        "models": [{"name": "tuned", "dir": "a", "num_layers": 6, "dtype": "float32", "runs": [
            _run(1.0, [FAITHFUL, "Zizzi serves Italian food."], [1.0, 1.2, 1.0]),
            _run(5.0, [FAITHFUL, "Zizzi serves Chinese food."], [0.25, 0.4, 0.2])]}]}


def test_slot_errors_reference_rate_and_speedup_spread_on_the_page():
    data = e2e_results()
    s = summary_mod.summarize(data)
    full, fast = s.find("tuned", 1.0), s.find("tuned", 5.0)
    assert full.slot_errors.rate == 0 and fast.slot_errors.rate == pytest.approx(20.0)
    # the second reference of MR 1 omits 6 of its 8 values; 8 + 8 + 2 slots over the 3 references
    ref = s.reference_slot_errors
    assert (ref.texts, ref.slots, ref.missing, ref.wrong) == (3, 18, 6, 0)
    # per round: 1.0/0.25, 1.2/0.4, 1.0/0.2; over all rounds 3.2/0.85
    assert fast.round_speedups == pytest.approx([4.0, 3.0, 5.0])
    assert fast.measured_speedup == pytest.approx(3.2 / 0.85)
    assert report.speedup_cell(fast) == "3.76x (3.00–5.00)"
    page = report.render(data, s, targets_mod.evaluate(s))
    assert "| 5x | 3→2 over 31 | 2.0 | 3.00x |" in page and "| 20.0% | 50.0% |" in page
    assert "The human references of this data, each scored against its MR by the same rules: **33.3%**" in page
    got = {(t.name, t.status) for t in targets_mod.evaluate(s)}
    assert ("tuned: slot error rate at 1x <= 5%", "held") in got
    assert ("tuned: slot error rate at 5x <= 8%", "missed") in got
