"""Regenerate ``instructions.jsonl``: small synthetic instruction / response pairs (deterministic, no downloads).

    python -m padfree_plugins.data.make_instructions > padfree_plugins/data/instructions.jsonl

Every response follows from its instruction by a simple rule (arithmetic, sorting, counting, spelling, …), so a
tiny model's loss visibly falls within a minute; lengths vary from a few tokens to a few hundred, like real SFT
data, so that padding would waste a good share of every batch.
"""

from __future__ import annotations

import json
import random

WORDS = ("apple river stone cloud garden window silver forest candle mirror planet rocket winter summer orange "
         "yellow purple banana pencil ladder bridge castle dragon engine feather guitar harbor island jacket kettle "
         "lemon marble needle ocean pepper quartz rabbit saddle tiger umbrella violin walnut zebra anchor basket "
         "cactus dolphin").split()
COLORS = ("red", "green", "blue", "black", "white", "grey", "pink", "brown")
ANIMALS = ("cat", "dog", "horse", "owl", "fox", "bear", "wolf", "duck", "goat", "lion")


def add(r):
    a, b = r.randint(0, 999), r.randint(0, 999)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def multiply(r):
    a, b = r.randint(2, 99), r.randint(2, 12)
    return f"Multiply {a} by {b}.", f"{a} times {b} equals {a * b}."


def sort_numbers(r):
    values = [r.randint(0, 200) for _ in range(r.randint(3, 14))]
    return (f"Sort these numbers from smallest to largest: {', '.join(map(str, values))}.",
            f"Sorted: {', '.join(map(str, sorted(values)))}.")


def reverse_word(r):
    word = r.choice(WORDS)
    return f"Spell the word '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."


def count_letters(r):
    word = r.choice(WORDS)
    letter = r.choice(word)
    return (f"How many times does the letter '{letter}' appear in '{word}'?",
            f"The letter '{letter}' appears {word.count(letter)} time{'s' if word.count(letter) > 1 else ''} in "
            f"'{word}'.")


def count_up(r):
    start = r.randint(1, 60)
    stop = start + r.randint(3, 40)
    return f"Count from {start} to {stop}.", " ".join(str(i) for i in range(start, stop + 1)) + "."


def describe(r):
    n = r.randint(1, 6)
    items = [(r.choice(COLORS), r.choice(ANIMALS)) for _ in range(n)]
    listing = "; ".join(f"a {c} {a}" for c, a in items)
    sentences = " ".join(f"The {a} is {c}." for c, a in items)
    return f"Describe each animal in one sentence: {listing}.", sentences


def capitals(r):
    words = r.sample(WORDS, r.randint(2, 10))
    return (f"Write these words in capital letters: {' '.join(words)}.", " ".join(w.upper() for w in words) + ".")


def first_letters(r):
    words = r.sample(WORDS, r.randint(3, 12))
    return (f"Give the first letter of each word: {' '.join(words)}.", " ".join(w[0] for w in words) + ".")


def story(r):
    animal, color, word = r.choice(ANIMALS), r.choice(COLORS), r.choice(WORDS)
    days = r.randint(2, 9)
    lines = [f"Once upon a time a {color} {animal} found a {word}."]
    lines += [f"On day {d} the {animal} carried the {word} a little further." for d in range(1, days + 1)]
    lines.append(f"After {days} days the {animal} was home, and the {word} was safe.")
    return f"Tell a short story about a {color} {animal} and a {word}, lasting {days} days.", " ".join(lines)


TASKS = (add, multiply, sort_numbers, reverse_word, count_letters, count_up, describe, capitals, first_letters, story)


def examples(n: int = 640, seed: int = 0):
    r = random.Random(seed)
    for i in range(n):
        prompt, completion = TASKS[i % len(TASKS)](r)
        yield {"prompt": prompt, "completion": completion}


if __name__ == "__main__":
    for example in examples():
        print(json.dumps(example))
