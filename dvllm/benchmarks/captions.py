"""A caption set with COCO-like lengths, generated here (no download).

MLPerf's text-to-image benchmark prompts with 5,000 captions of COCO 2014 validation. Those captions are one
plain sentence each, 8 words at least (the collection's instructions), about 10.5 words on average, rarely
past 20. These are made the same way from a small vocabulary with a seeded generator: the same seed gives the
same set, and the prompt lengths a text encoder sees are COCO's. They say nothing of image quality: a run
with them has no accuracy gate.
"""
from __future__ import annotations

import random

_SUBJECTS = ["man", "woman", "child", "dog", "cat", "horse", "bus", "train", "plate of food", "group of people",
             "bird", "skateboarder", "giraffe", "kitchen", "bathroom", "street sign", "pizza", "motorcycle"]
_ADJECTIVES = ["small", "large", "red", "white", "black", "young", "old", "wooden", "crowded", "empty", "blue",
               "green", "tall", "brown"]
_ACTIONS = ["sitting on", "standing next to", "walking down", "riding", "looking at", "parked in front of",
            "holding", "lying on", "flying over", "eating"]
_PLACES = ["table", "city street", "beach", "grassy field", "counter", "bench", "snowy hill", "road", "fence",
           "window", "wall", "river"]
_TAILS = ["on a sunny day", "at night", "in the rain", "near some trees", "with a few people around",
          "in a busy city", "next to a parked car", "under a cloudy sky", "in the background", "by the water"]

MIN_WORDS, TARGET_MEAN, TARGET_SD = 8, 8.5, 2.6  # whole phrases overshoot the drawn length: 10.5 on average


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def caption(rng: random.Random) -> str:
    """One sentence of whole phrases, at least as long as a length drawn around COCO's (8 words at least)."""
    target = max(MIN_WORDS, round(rng.gauss(TARGET_MEAN, TARGET_SD)))
    words = f"{_a(rng.choice(_ADJECTIVES))} {rng.choice(_SUBJECTS)} {rng.choice(_ACTIONS)} {_a(rng.choice(_PLACES))}"
    tails = rng.sample(_TAILS, len(_TAILS))
    while len(words.split()) < target and tails:
        words += " " + tails.pop()
    return words


def captions(count: int, seed: int = 0) -> list[str]:
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    rng = random.Random(seed)
    return [caption(rng) for _ in range(count)]
