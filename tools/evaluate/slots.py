"""Faithfulness of E2E descriptions: a slot error rate per meaning representation (MR).

An E2E MR is a list of ``slot[value]``: ``name[The Eagle], eatType[coffee shop], food[French]``.
A description has two kinds of slot error, each counted once per value:

- **missing**: a value of the MR that the text does not realise (rules below);
- **wrong**: a value the text asserts that the MR does not hold, for the slots whose values are
  closed and unambiguous in text: another venue name (``name``/``near`` values of the E2E ontology
  that are neither this MR's name nor its near), another cuisine (``food``), another area, another
  venue type (``eatType``). A text that says "pub" for an MR with no eatType slot has a wrong value.

The slot error rate of a set of texts is (missing + wrong) / (slots in the MRs), the usual E2E
definition (Dušek et al. 2019 count added and wrong values alike); an MR with an error is one whose
text has at least one.

Realisation rules (case-insensitive, whole words; venue names are matched, then removed before the
other slots are matched, so "Café Rouge" says nothing about coffee shops, nor "The Golden Curry" or
"Raja Indian Cuisine" about Indian food):

- ``name``, ``near``: the name itself; an apostrophe-s or the missing leading "The" also count
  ("Eagle's", "near Portland Arms"); "Crown Plaza" for Crowne Plaza Hotel.
- ``eatType``: pub: "pub", "public house", "bar", "inn", "tavern"; coffee shop: "coffee shop/house", "café/cafe", "coffee" + noun;
  restaurant: "restaurant", "eatery", "diner", "bistro". As a *wrong* value only pub and coffee shop
  count: references call pubs and coffee shops "restaurants" generically.
- ``food``: the cuisine's adjective (English also "British", but not "English sterling/pounds"); Fast food: "fast food", "fast-food",
  "burger(s)", "fries"; Japanese also "sushi"; Italian also "pasta", "pizza"; Indian also "curry".
  As a wrong value only the adjectives count (a "pizza" in an English-food text is not asserted cuisine).
- ``area``: riverside: "river" (riverside, river side, by the river, waterfront also);
  city centre: "city centre/center", "centre/center of (the) city/town", "town centre",
  "downtown", "in the centre", "central".
- ``priceRange``: cheap: cheap, inexpensive, low price/cost, affordable, budget, "less than £20"
  wordings; less than £20: "£20" / "20 pounds" / "twenty" with less/under/below or cheap; £20-25:
  "20-25", "£20 to £25", "25"; moderate: moderate(ly), mid(-range), average price, reasonabl-,
  affordable; high: high, expensive, pricey, costly, upscale, "£30"; more than £30: "30" (£30,
  30 pounds, thirty), expensive, high, pricey.
- ``customer rating``: "N out of 5" as "N out of 5", "N/5", "N star(s)", the number in words;
  low / average / high: the word near rat-/review/customer/score or "poor(ly)"/"bad"/"mediocre"
  (low), "average"/"ok"/"decent"/"mediocre" (average), "highly"/"well"/"good"/"great"/"excellent"/
  "top" (high) near rat-/review/customer; "5 out of 5" also "excellent"/"top rated"/"highly rated";
  "1 out of 5" also "low"/"poor"; "3 out of 5" also "average".
- ``familyFriendly``: a word about family/families/children/kids; no: such a word with a negation
  before it ("not", "n't", "no", "non", "never", "without"), "kid-free", or "adult(s)"; yes: such a
  word and no negation.

The rules were calibrated on the human references of the official training and development
splits (docs/quality.md reports the references' own rate, measured the same way): most remaining
reference "errors" are real omissions, which the E2E data is known to hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MR_SLOT = re.compile(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]\s*(?:,|$)")

# The E2E ontology's venue names (name and near values of the official training split).
VENUES = (
    "Alimentum", "Aromi", "Avalon", "Bibimbap House", "Blue Spice", "Browns Cambridge",
    "Burger King", "Café Adriatic", "Café Brazil", "Café Rouge", "Café Sicilia", "Clare Hall",
    "Clowns", "Cocum", "Cotto", "Crowne Plaza Hotel", "Express by Holiday Inn", "Fitzbillies",
    "Giraffe", "Green Man", "Loch Fyne", "Midsummer House", "Raja Indian Cuisine",
    "Rainbow Vegetarian Café", "Ranch", "Strada", "Taste of Cambridge", "The Bakers",
    "The Cambridge Blue", "The Cricketers", "The Dumpling Tree", "The Eagle", "The Golden Curry",
    "The Golden Palace", "The Mill", "The Olive Grove", "The Phoenix", "The Plough",
    "The Portland Arms", "The Punter", "The Rice Boat", "The Six Bells", "The Sorrento",
    "The Twenty Two", "The Vaults", "The Waterman", "The Wrestlers", "Travellers Rest Beefeater",
    "Wildwood", "Yippee Noodle Bar", "Zizzi", "All Bar One",
)

NEG = r"(?:not|n't|no|non|never|without|isn't|aren't|doesn't|don't|nor)"
FAMILY = r"(?:famil(?:y|ies)|child(?:ren)?|kids?|kid-friendly|toddlers?|youngsters?|babies)"
RATED = r"(?:rat(?:ed|ing|ings|e)|reviews?|reviewed|customers?|scores?|stars?|regarded|thought of)"


def _near(a: str, b: str, gap: int = 3) -> str:
    """``a`` then ``b`` (or ``b`` then ``a``) with at most ``gap`` words between them."""
    w = rf"(?:\W+\w+){{0,{gap}}}\W+"
    return rf"(?:\b{a}{w}{b}|\b{b}{w}{a})"


def _any(*patterns: str) -> str:
    return "(?:" + "|".join(patterns) + ")"


def _number(n: int) -> str:
    word = {1: "one", 3: "three", 5: "five"}[n]
    return _any(rf"\b(?:{n}|{word})\s*(?:out\s+of|/)\s*(?:5|five)\b", rf"\b(?:{n}|{word})[\s-]*stars?\b",
                rf"\b{word}\b(?=.*\b{RATED})", rf"\b{n}\b(?=.*\b{RATED})")


# slot -> value -> pattern realising it (searched in the lower-cased text, venue names removed)
RULES: dict[str, dict[str, str]] = {
    "eatType": {
        "pub": r"\b(?:pubs?|public\s+house|bar|inn|tavern)\b",
        "coffee shop": _any(r"\bcoffee[\s-]*(?:shops?|houses?|bars?|places?|spots?)\b", r"\bcaf[eé]s?\b",
                            r"\bcoffee\b"),
        "restaurant": r"\b(?:restaurants?|eatery|eateries|diner|bistro)\b",
    },
    "food": {
        "English": r"\b(?:english|british)\b(?!\s+(?:sterling|pounds?|currency))",
        "French": r"\bfrench\b",
        "Japanese": r"\b(?:japanese|sushi)\b",
        "Italian": r"\b(?:italian|pasta|pizzas?)\b",
        "Indian": r"\b(?:indian|curry|curries)\b",
        "Chinese": r"\bchinese\b",
        "Fast food": r"\b(?:fast[\s-]*food|burgers?|fries)\b",
    },
    "area": {
        "riverside": r"\b(?:river\w*|waterfront|water front)\b",
        "city centre": _any(r"\bcity[\s-]*cent(?:re|er|ral)\b", r"\bcent(?:re|er)\s+of\s+(?:the\s+)?(?:city|town)\b",
                            r"\btown[\s-]*cent(?:re|er)\b", r"\bdowntown\b", r"\bin\s+the\s+cent(?:re|er)\b",
                            r"\bcentral\b", r"\bcity\b"),
    },
    "priceRange": {
        "cheap": r"\b(?:cheap\w*|inexpensive|low[\s-]*(?:price\w*|cost)|affordabl\w*|budget|less\s+than|under|bargain)",
        "less than £20": _any(r"(?:£\s*20|\b20\b|\btwenty\b)", r"\bcheap\w*", r"\blow[\s-]*pric"),
        "£20-25": r"(?:\b25\b|£\s*25|twenty[\s-]*five|\b20\s*-\s*25)",
        "moderate": r"\b(?:moderat\w*|mid\w*|average|reasonabl\w*|affordabl\w*|medium|fair\w*|mod)\b",
        "high": r"\b(?:high\w*|expensive|pricey|pricy|costly|upscale|upmarket|premium|dear|£\s*30|luxury|luxurious)\b|£\s*30",
        "more than £30": _any(r"(?:£\s*30|\b30\b|\bthirty\b)", r"\b(?:expensive|high\w*|pricey|costly)\b"),
    },
    "customer rating": {
        "5 out of 5": _any(_number(5), r"\b(?:excellent|top|highly|outstanding|perfect|best|great)\b"),
        "3 out of 5": _any(_number(3), r"\b(?:average|middling|mediocre|ok|okay|decent)\b"),
        "1 out of 5": _any(_number(1), r"\b(?:low\w*|poor\w*|bad\w*|terrible|worst)\b"),
        "low": r"\b(?:low\w*|poor\w*|bad\w*|terrible|worst|negative|not\s+(?:well|highly|good))\b",
        "average": r"\b(?:average|mediocre|ok|okay|decent|middling|moderate\w*|fair\w*|mid\w*|satisfactory|3)\b",
        "high": r"\b(?:high\w*|well|good|great|excellent|top|positive|best|outstanding|5)\b",
    },
    "familyFriendly": {
        "yes": FAMILY,
        "no": _any(rf"\b{NEG}\W+(?:\w+\W+){{0,3}}?{FAMILY}", r"\badults?\b", r"\bnon[\s-]*family",
                   r"\b(?:kid|child|family)[\s-]*free\b",
                   rf"{FAMILY}\W+(?:\w+\W+){{0,2}}?(?:not|unfriendly|unwelcome)"),
    },
}
# values whose assertion in a text contradicts an MR that does not hold them
WRONG_RULES: dict[str, dict[str, str]] = {
    "eatType": {"pub": RULES["eatType"]["pub"],
                "coffee shop": r"\bcoffee[\s-]*(?:shops?|houses?)\b|\bcaf[eé]s?\b"},
    "food": {v: rf"\b{v.lower()}\b" if v != "Fast food" else r"\bfast[\s-]*food\b"
             for v in RULES["food"]} | {"English": RULES["food"]["English"]},
    "area": {"riverside": r"\briverside\b|\briver\b",
             "city centre": r"\bcity[\s-]*cent(?:re|er)\b|\bcent(?:re|er)\s+of\s+(?:the\s+)?(?:city|town)\b"},
}


@dataclass
class SlotErrors:
    """The slot errors of one text against its MR."""

    slots: int  # values in the MR
    missing: list[tuple[str, str]] = field(default_factory=list)  # (slot, value) not realised
    wrong: list[tuple[str, str]] = field(default_factory=list)  # (slot, value) asserted, not in the MR

    @property
    def errors(self) -> int:
        return len(self.missing) + len(self.wrong)


@dataclass
class SlotSummary:
    """Slot errors over a set of (MR, text) pairs."""

    texts: int
    slots: int
    missing: int
    wrong: int
    texts_with_errors: int

    @property
    def rate(self) -> float:
        """(missing + wrong) / slots, in percent."""
        return 100.0 * (self.missing + self.wrong) / self.slots if self.slots else float("nan")

    @property
    def texts_with_errors_pct(self) -> float:
        return 100.0 * self.texts_with_errors / self.texts if self.texts else float("nan")


def parse_mr(mr: str) -> dict[str, str] | None:
    """``slot[value], ...`` -> {slot: value}, or None when ``mr`` is not an E2E MR."""
    slots, pos = {}, 0
    for m in MR_SLOT.finditer(mr):
        if m.start() != pos:
            return None
        slots[m.group(1)] = m.group(2).strip()
        pos = m.end()
    return slots if slots and pos == len(mr) else None


def is_mr_list(prompts: list[str]) -> bool:
    """True when every prompt is an E2E MR: the slot error rate applies."""
    return bool(prompts) and all(parse_mr(p) is not None for p in prompts)


# other spellings of venue names that the references use
VENUE_ALIASES = {"Crowne Plaza Hotel": r"crowne?\s+plaza(?:\s+hotel)?"}


def venue_pattern(name: str) -> str:
    if name in VENUE_ALIASES:
        return rf"(?<!\w)(?:the\s+)?{VENUE_ALIASES[name]}(?!\w)"
    words = name.lower().split()
    if words[0] == "the" and len(words) > 1:
        words = ["(?:the\\s+)?" + re.escape(words[1])] + [re.escape(w) for w in words[2:]]
        body = r"\s+".join(words)
    else:
        body = r"\s+".join(re.escape(w) for w in words)
    return rf"(?<!\w){body}(?:'s|s')?(?!\w)"


_VENUE_RES = {v: re.compile(venue_pattern(v)) for v in sorted(VENUES, key=len, reverse=True)}


def _venue_re(name: str) -> re.Pattern:
    return _VENUE_RES.get(name) or re.compile(venue_pattern(name))


def _slots(mr: str | dict[str, str]) -> dict[str, str]:
    slots = parse_mr(mr) if isinstance(mr, str) else dict(mr)
    if slots is None:
        raise ValueError(f"not an E2E meaning representation: {mr!r}")
    return slots


def _blank_own_venues(slots: dict[str, str], low: str) -> str:
    """``low`` with the MR's own name and near blanked out (longest first), so that their words
    realise no other slot ("Café Rouge" is no coffee shop, "Burger King" no fast food)."""
    for venue in sorted({slots[s] for s in ("name", "near") if s in slots}, key=len, reverse=True):
        low = _venue_re(venue).sub(" ", low)
    return low


def slot_errors(mr: str | dict[str, str], text: str) -> SlotErrors:
    """The missing and wrong values of ``text`` against ``mr`` (see the module's rules)."""
    slots = _slots(mr)
    low = " ".join(text.lower().split())
    result = SlotErrors(len(slots))
    # venue names first; then they are blanked out so their words realise nothing else
    for slot in ("name", "near"):
        if slot in slots and not _venue_re(slots[slot]).search(low):
            result.missing.append((slot, slots[slot]))
    low = _blank_own_venues(slots, low)
    for venue, pattern in _VENUE_RES.items():  # longest first
        if pattern.search(low):
            result.wrong.append(("venue", venue))
            low = pattern.sub(" ", low)
    for slot, value in slots.items():
        if slot in ("name", "near"):
            continue
        pattern = RULES.get(slot, {}).get(value) or rf"\b{re.escape(value.lower())}\b"
        if not re.search(pattern, low):
            result.missing.append((slot, value))
    for slot, values in WRONG_RULES.items():
        for value, pattern in values.items():
            if slots.get(slot) != value and re.search(pattern, low):
                result.wrong.append((slot, value))
    return result


def repeated_values(mr: str | dict[str, str], text: str) -> list[tuple[str, str]]:
    """The (slot, value) pairs of ``mr`` that ``text`` states more than once, for the slots a
    description names once when it is well written: near, area and food ("... in the riverside area
    near Burger King. It is located near Burger King."). Not a slot error (nothing is missing or
    wrong), but a defect of a fine-tuning target: greedy decoding learns the repetition."""
    slots = _slots(mr)
    low = " ".join(text.lower().split())
    found = []
    if "near" in slots and len(_venue_re(slots["near"]).findall(low)) > 1:
        found.append(("near", slots["near"]))
    low = _blank_own_venues(slots, low)  # "Burger King" says nothing about fast food
    for slot in ("area", "food"):
        value = slots.get(slot)
        pattern = RULES.get(slot, {}).get(value) if value else None
        if pattern and len(re.findall(pattern, low)) > 1:
            found.append((slot, value))
    return found


def summarize(mrs: list[str], texts: list[str]) -> SlotSummary:
    if len(mrs) != len(texts):
        raise ValueError(f"{len(mrs)} MRs but {len(texts)} texts")
    per = [slot_errors(mr, text or "") for mr, text in zip(mrs, texts)]
    return SlotSummary(texts=len(per), slots=sum(e.slots for e in per),
                       missing=sum(len(e.missing) for e in per), wrong=sum(len(e.wrong) for e in per),
                       texts_with_errors=sum(1 for e in per if e.errors))
