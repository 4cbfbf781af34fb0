"""Invented venue names for E2E pairs: ``name``/``near`` values the data never contains, put in
place of the originals consistently in the MR and its descriptions (``python -m tools.e2e rename``).

Why: every E2E split reuses the same ~50 venue names, so a model tuned on them is judged on names it
memorised; real users' venues are new. Training on renamed copies teaches the layers a shallow budget
keeps to copy a name from the MR instead of recalling one, and a renamed development split measures it.

Two pools with no word in common: ``train`` for fine-tuning data, ``dev`` for the renamed development
split, so that the dev split's names are unseen by a model trained on renamed data too.
"""

from __future__ import annotations

import random
import re

from tools.evaluate.slots import VENUES, venue_pattern

# (adjectives, nouns, syllables) per pool: disjoint from each other and from the E2E venue names' words
POOLS = {
    "train": (
        ("Amber", "Copper", "Silver", "Crimson", "Velvet", "Hidden", "Lucky", "Quiet", "Rusty", "Oaken",
         "Northern", "Little", "Painted", "Wandering", "Sleepy", "Brass", "Scarlet", "Misty", "Jolly", "Hollow"),
        ("Lantern", "Anchor", "Harbour", "Orchard", "Kettle", "Meadow", "Compass", "Falcon", "Willow", "Barrel",
         "Teapot", "Saddle", "Quarry", "Pelican", "Bramble", "Chimney", "Fountain", "Sparrow", "Thistle", "Wharf"),
        ("ka", "lo", "mi", "ren", "ta", "vo", "zu", "bel", "dra", "fen", "gor", "hal", "jin", "ko", "lys", "mar",
         "nox", "pel", "quin", "sar"),
    ),
    "dev": (
        ("Azure", "Emerald", "Gentle", "Humble", "Ivory", "Jade", "Lonely", "Merry", "Noble", "Silent",
         "Proud", "Royal", "Sunny", "Tiny", "Upper", "Wild", "Wooden", "Young", "Broken", "Dancing"),
        ("Lotus", "Quay", "Beacon", "Cellar", "Dovecote", "Ember", "Ferry", "Garden", "Heron", "Inkwell",
         "Juniper", "Kiln", "Lighthouse", "Pond", "Nest", "Otter", "Pavilion", "Robin", "Stable", "Tavern"),
        ("ae", "bri", "cor", "dun", "eth", "fio", "gla", "hex", "ilo", "jor", "kai", "lum", "mor", "nia", "osk",
         "pra", "rho", "sel", "tov", "wyn"),
    ),
}
FORMS = ("The {adj} {noun}", "{noun} {noun2}", "{word}", "The {noun}", "{word} {noun}", "Café {word}",
         "{adj} {noun}", "{word}'s")


def invent(rng: random.Random, pool: str) -> str:
    """One invented venue name of ``pool`` (see POOLS)."""
    adjectives, nouns, syllables = POOLS[pool]
    word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize()
    noun, noun2 = rng.sample(nouns, 2)
    return rng.choice(FORMS).format(adj=rng.choice(adjectives), noun=noun, noun2=noun2, word=word)


def venue_regex(name: str) -> re.Pattern:
    """A venue name as the slot rules find it in text (an optional leading "The", an apostrophe-s),
    case-insensitive, on the original text."""
    return re.compile(venue_pattern(name), re.IGNORECASE)


def rename_text(text: str, mapping: dict[str, str]) -> str:
    """``text`` with each venue of ``mapping`` (old -> new, longest first) replaced by its new name,
    keeping a possessive ("Eagle's" -> "Lantern Quay's")."""
    for old in sorted(mapping, key=len, reverse=True):
        new = mapping[old]

        def put(match: re.Match, new=new) -> str:
            found = match.group(0)
            suffix = "'s" if found.lower().endswith("'s") else "s'" if found.lower().endswith("s'") else ""
            return new + suffix if not new.endswith("'s") else new

        text = venue_regex(old).sub(put, text)
    return text


def mapping_for(slots: dict[str, str], rng: random.Random, pool: str) -> dict[str, str]:
    """New names for the MR's ``name`` and ``near`` values, different from each other and from every
    E2E venue."""
    mapping: dict[str, str] = {}
    for slot in ("name", "near"):
        old = slots.get(slot)
        if old is None or old in mapping:
            continue
        new = invent(rng, pool)
        while new in mapping.values() or new in VENUES:
            new = invent(rng, pool)
        mapping[old] = new
    return mapping


__all__ = ["FORMS", "POOLS", "invent", "mapping_for", "rename_text", "venue_regex"]
