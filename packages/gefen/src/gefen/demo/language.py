"""Tinylang: a small synthetic language with learnable structure, generated on the fly.

The demo and the quality benchmark train on it, so nothing is downloaded and nothing
licensed is shipped. It mixes what a small decoder can learn at different speeds:
spelling of a fixed lexicon (fast), article and number agreement with irregular plurals,
subject-verb agreement, in-context recall of who owns what (needs attention across the
line), counting sequences and small additions (arithmetic), and word reversal (copying
with a permutation). The remaining entropy comes only from the random choices, so the loss
of a good model falls far below the unigram entropy of the characters.

Generation is deterministic for a seed (``random.Random``) and versioned by
:data:`TINYLANG_VERSION`; a golden digest in the tests catches drift.
"""

from __future__ import annotations

import random

__all__ = ["TINYLANG_VERSION", "generate_text"]

TINYLANG_VERSION = 1

_NOUNS: dict[str, str] = {
    "cat": "cats",
    "dog": "dogs",
    "bird": "birds",
    "fox": "foxes",
    "horse": "horses",
    "mouse": "mice",
    "frog": "frogs",
    "wolf": "wolves",
    "fish": "fish",
    "goat": "goats",
    "owl": "owls",
    "eagle": "eagles",
    "sheep": "sheep",
    "child": "children",
    "box": "boxes",
    "apple": "apples",
}
_ADJECTIVES = (
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "young",
    "quick",
    "lazy",
    "happy",
    "angry",
    "quiet",
    "brave",
    "odd",
)
_VERBS: dict[str, str] = {
    "see": "sees",
    "like": "likes",
    "chase": "chases",
    "find": "finds",
    "follow": "follows",
    "watch": "watches",
    "help": "helps",
    "carry": "carries",
    "fear": "fears",
}
_NAMES = (
    "anna",
    "ben",
    "carl",
    "dina",
    "eli",
    "fay",
    "gus",
    "hana",
    "ivan",
    "june",
    "kim",
    "leo",
    "mia",
    "nora",
    "omar",
    "pia",
)
_PLACES = ("park", "river", "house", "forest", "hill", "garden", "town", "lake")
_NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun_phrase(rng: random.Random, *, plural: bool) -> str:
    noun = rng.choice(list(_NOUNS))
    form = _NOUNS[noun] if plural else noun
    if rng.random() < 0.5:
        return f"the {rng.choice(_ADJECTIVES)} {form}"
    return f"the {form}"


def _agreement(rng: random.Random) -> str:
    plural = rng.random() < 0.5
    subject = _noun_phrase(rng, plural=plural)
    verb = rng.choice(list(_VERBS))
    obj = _noun_phrase(rng, plural=rng.random() < 0.5)
    return f"{subject} {verb if plural else _VERBS[verb]} {obj}."


def _counting_nouns(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    count = rng.randrange(1, len(_NUMBER_WORDS))
    noun = rng.choice(list(_NOUNS))
    adjective = rng.choice(_ADJECTIVES)
    if count == 1:
        return f"{name} has {_article(adjective)} {adjective} {noun}."
    return f"{name} has {_NUMBER_WORDS[count]} {adjective} {_NOUNS[noun]}."


def _recall(rng: random.Random) -> str:
    owners = rng.sample(_NAMES, 3)
    things = rng.sample(list(_NOUNS), 3)
    facts = " ".join(f"{o} owns {_article(t)} {t}." for o, t in zip(owners, things))
    asked = rng.randrange(3)
    return f"{facts} who owns the {things[asked]}? {owners[asked]}."


def _travel(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    place = rng.choice(_PLACES)
    adjective = rng.choice(_ADJECTIVES)
    noun = rng.choice(list(_NOUNS))
    return f"{name} went to the {place} and saw {_article(adjective)} {adjective} {noun} there."


def _sequence(rng: random.Random) -> str:
    start = rng.randrange(0, 40)
    stride = rng.randrange(1, 6)
    length = rng.randrange(4, 8)
    return "count " + " ".join(str(start + stride * i) for i in range(length)) + "."


def _addition(rng: random.Random) -> str:
    a = rng.randrange(0, 20)
    b = rng.randrange(0, 20)
    return f"{a} + {b} = {a + b}."


def _reversal(rng: random.Random) -> str:
    word = rng.choice(list(_NOUNS) + list(_ADJECTIVES) + list(_NAMES))
    return f"reverse {word} is {word[::-1]}."


_SENTENCES = (
    (_agreement, 4),
    (_counting_nouns, 3),
    (_recall, 2),
    (_travel, 2),
    (_sequence, 2),
    (_addition, 2),
    (_reversal, 1),
)
_KINDS = tuple(kind for kind, _ in _SENTENCES)
_WEIGHTS = tuple(weight for _, weight in _SENTENCES)


def generate_text(num_chars: int, seed: int) -> str:
    """At least ``num_chars`` characters of tinylang (whole lines of 1 to 3 sentences), deterministic in ``seed``."""
    if type(num_chars) is not int or num_chars <= 0:
        raise ValueError(f"num_chars must be a positive int, got {num_chars!r}")
    rng = random.Random(f"tinylang-v{TINYLANG_VERSION}-{seed}")
    lines: list[str] = []
    total = 0
    while total < num_chars:
        count = rng.randrange(1, 4)
        line = " ".join(rng.choices(_KINDS, _WEIGHTS)[0](rng) for _ in range(count))
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"
