"""Invented venue names for E2E pairs: ``name``/``near`` values the data never contains, put in
place of the originals consistently in the MR and its descriptions (``python -m tools.e2e rename``).

Why: every E2E split reuses the same ~50 venue names, so a model tuned on them is judged on names it
memorised; real users' venues are new. Training on renamed copies teaches the layers a shallow budget
keeps to copy a name from the MR instead of recalling one, and a renamed development split measures it.

Pools: ``train`` (20 adjectives, 20 nouns, 20 syllables) and ``wide`` (6,062 words, ~1,500
syllables, and names that put a word of an E2E venue beside a new one, "Golden Marrow") for fine-tuning
data, ``dev`` for the renamed development split. ``dev`` shares no word with the others or with E2E, so
that the dev split's names are unseen by a model trained on renamed data too. Why ``wide``: a model
tuned on the ``train`` pool's few words learnt them, not copying: at 5x it still cut new names short
or finished them as a training name ("Blue Lotus" -> "Blue Spice"), so a name's words must rarely repeat.
"""

from __future__ import annotations

import random
import re
from functools import cache
from itertools import product
from pathlib import Path

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
# The wide pool's forms beside FORMS: a word of an E2E venue (SHARED) next to a new one, so that the
# model learns to copy "Blue Lotus" rather than finish it as "Blue Spice".
SHARED_FORMS = ("{shared} {noun}", "The {shared} {noun}", "{noun} {shared}")
# Words of E2E venue names that new names plausibly reuse; not those the slot rules read as an eatType,
# a cuisine or a place (Café, Inn, Indian, Cambridge...).
SHARED = ("Blue", "Golden", "Green", "Eagle", "Phoenix", "Olive", "Mill", "Grove", "Palace", "Giraffe",
          "Boat", "Bells", "Plough", "Rainbow", "Spice", "Tree", "Rice", "Noodle", "Dumpling", "Express",
          "Twenty", "Two", "Six", "One", "Arms", "Plaza", "Ranch", "Taste", "Vaults", "Midsummer", "Wildwood")
WIDE_WORDS = Path(__file__).with_name("wide_words.txt")


def wide_words() -> tuple[str, ...]:
    """The words of tools/e2e/wide_words.txt (one a line, after its # comment lines)."""
    lines = WIDE_WORDS.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


@cache
def _wide() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The wide pool: its words (tools/e2e/wide_words.txt) as adjectives and nouns alike, and every
    onset-vowel-coda syllable but the dev pool's."""
    words = wide_words()
    onsets = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "dr", "gr", "kr", "pl", "st", "th", "ch", "sh", "")
    vowels = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
    codas = ("", "n", "r", "l", "s", "k", "m")
    dev = set(POOLS["dev"][2])
    syllables = tuple(s for s in ("".join(p) for p in product(onsets, vowels, codas)) if s not in dev)
    return words, words, syllables


def invent(rng: random.Random, pool: str) -> str:
    """One invented venue name of ``pool`` (see POOLS; ``wide``: see _wide)."""
    adjectives, nouns, syllables = _wide() if pool == "wide" else POOLS[pool]
    word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))).capitalize()
    noun, noun2 = rng.sample(nouns, 2)
    forms = FORMS + SHARED_FORMS if pool == "wide" else FORMS
    return rng.choice(forms).format(adj=rng.choice(adjectives), noun=noun, noun2=noun2, word=word,
                                    shared=rng.choice(SHARED))


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


__all__ = ["FORMS", "POOLS", "SHARED", "SHARED_FORMS", "WIDE_WORDS", "wide_words",
           "invent", "mapping_for", "rename_text", "venue_regex"]
