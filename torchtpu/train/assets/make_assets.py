"""Regenerate the bundled training corpus and tokenizer.

    .venv/bin/python -m torchtpu.train.assets.make_assets           # rewrite corpus.txt, tokenizer.json
    .venv/bin/python -m torchtpu.train.assets.make_assets --check   # verify the committed files match

corpus.txt is produced by a seeded generator of short, simple English stories written for this
project (no third-party text), so it may be redistributed under the project's license. The
stories have structure a small model can learn quickly: a fixed cast whose names, pronouns and
pets stay consistent within a story, fixed facts (what each animal says, the colour of each fruit),
counting and week-day sequences, and small sums. Documents are separated by one blank line.

tokenizer.json is a byte-level BPE tokenizer (vocabulary 2,000 < torchtitan debugmodel's 2,048)
trained on corpus.txt with the `tokenizers` library; ids 0 and 1 are <|begin_of_text|> and
<|end_of_text|>. Byte-level means any UTF-8 text encodes, not only the corpus's words.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS_FILE = os.path.join(HERE, "corpus.txt")
TOKENIZER_FILE = os.path.join(HERE, "tokenizer.json")

SEED = 20261129
NUM_DOCS = 2600
VOCAB_SIZE = 2000
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"

PEOPLE = [
    ("Anna", "she", "her"),
    ("Ben", "he", "his"),
    ("Clara", "she", "her"),
    ("David", "he", "his"),
    ("Emma", "she", "her"),
    ("Felix", "he", "his"),
    ("Grace", "she", "her"),
    ("Henry", "he", "his"),
    ("Iris", "she", "her"),
    ("Jack", "he", "his"),
    ("Lena", "she", "her"),
    ("Max", "he", "his"),
    ("Nora", "she", "her"),
    ("Oscar", "he", "his"),
    ("Paula", "she", "her"),
    ("Sam", "he", "his"),
    ("Tara", "she", "her"),
    ("Victor", "he", "his"),
    ("Wendy", "she", "her"),
    ("Leo", "he", "his"),
]
ANIMALS = {
    "cat": "meow",
    "dog": "woof",
    "cow": "moo",
    "duck": "quack",
    "sheep": "baa",
    "owl": "hoot",
    "frog": "ribbit",
    "horse": "neigh",
    "pig": "oink",
    "lion": "roar",
    "goat": "maa",
    "mouse": "squeak",
    "bee": "buzz",
    "hen": "cluck",
    "crow": "caw",
    "snake": "hiss",
}
FRUITS = {
    "apple": "red",
    "banana": "yellow",
    "lime": "green",
    "orange": "orange",
    "plum": "purple",
    "cherry": "red",
    "lemon": "yellow",
    "pear": "green",
    "grape": "purple",
    "peach": "pink",
}
PLACES = [
    "park",
    "garden",
    "market",
    "river",
    "forest",
    "library",
    "school",
    "beach",
    "farm",
    "hill",
    "village",
    "kitchen",
    "bakery",
    "station",
    "lake",
    "field",
]
ADJS = [
    "big",
    "small",
    "happy",
    "quiet",
    "brave",
    "sleepy",
    "clever",
    "kind",
    "fast",
    "slow",
    "funny",
    "gentle",
    "busy",
    "shy",
    "proud",
    "calm",
]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple", "pink", "grey"]
OBJECTS = [
    "ball",
    "kite",
    "book",
    "hat",
    "box",
    "cup",
    "bell",
    "map",
    "key",
    "drum",
    "boat",
    "lamp",
    "basket",
    "coat",
    "bike",
    "clock",
]
VERBS_PLACE = ["play", "run", "sleep", "read", "sing", "walk", "dance", "rest", "draw", "swim"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy", "bright"]
FEELINGS = ["happy", "tired", "hungry", "glad", "excited", "calm", "proud", "surprised"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = [
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
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _story(rng: random.Random) -> str:
    name, subj, poss = rng.choice(PEOPLE)
    friend, fsubj, _ = rng.choice([p for p in PEOPLE if p[0] != name])
    pet = rng.choice(sorted(ANIMALS))
    pet_adj = rng.choice(ADJS)
    place = rng.choice(PLACES)
    day_i = rng.randrange(7)
    day = DAYS[day_i]
    fruit = rng.choice(sorted(FRUITS))
    obj, color = rng.choice(OBJECTS), rng.choice(COLORS)
    out = [f"On {day}, {name} went to the {place} with {poss} {pet_adj} {pet}."]
    menu = list(range(12))
    rng.shuffle(menu)
    for kind in menu[: rng.randint(4, 8)]:
        if kind == 0:
            out.append(f"The {pet} said {ANIMALS[pet]}, {ANIMALS[pet]}.")
        elif kind == 1:
            out.append(f"{_cap(subj)} ate a {fruit}. The {fruit} was {FRUITS[fruit]}.")
        elif kind == 2:
            a, b = rng.randrange(11), rng.randrange(11)
            out.append(
                f"{name} counted {a} {pet}s and {b} more. {_cap(NUMBERS[a])} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
            )
        elif kind == 3:
            n = rng.randint(3, 8)
            out.append(f"{_cap(subj)} counted to {NUMBERS[n]}: " + ", ".join(NUMBERS[1 : n + 1]) + ".")
        elif kind == 4:
            out.append(f"The next day was {DAYS[(day_i + 1) % 7]}, and the day after that was {DAYS[(day_i + 2) % 7]}.")
        elif kind == 5:
            out.append(f"{name} met {friend} at the {place}. {_cap(fsubj)} had a {color} {obj}.")
        elif kind == 6:
            verb = rng.choice(VERBS_PLACE)
            out.append(f"They liked to {verb} in the {place} when it was {rng.choice(WEATHER)}.")
        elif kind == 7:
            other = rng.choice(sorted(ANIMALS))
            out.append(f"A {other} came by. The {other} said {ANIMALS[other]}, and the {pet} said {ANIMALS[pet]}.")
        elif kind == 8:
            out.append(f"{name} felt {rng.choice(FEELINGS)}, so {subj} gave {poss} {pet} a {color} {obj}.")
        elif kind == 9:
            m = rng.randrange(12)
            out.append(f"It was the month of {MONTHS[m]}. After {MONTHS[m]} comes {MONTHS[(m + 1) % 12]}.")
        elif kind == 10:
            a = rng.randint(2, 20)
            b = rng.randint(1, a)
            left = "was" if a - b == 1 else "were"
            out.append(f"There were {NUMBERS[a]} {fruit}s. {name} took {NUMBERS[b]}, so {NUMBERS[a - b]} {left} left.")
        else:
            out.append(f"The {pet} was {pet_adj}, and {name} was {rng.choice(FEELINGS)}.")
    out.append(f"In the evening, {name} and the {pet} went home. The end.")
    return " ".join(out)


def _facts(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        animals = sorted(ANIMALS)
        rng.shuffle(animals)
        return " ".join(f"The {a} says {ANIMALS[a]}." for a in animals[: rng.randint(5, 10)])
    if kind == 1:
        fruits = sorted(FRUITS)
        rng.shuffle(fruits)
        return " ".join(f"A {f} is {FRUITS[f]}." for f in fruits[: rng.randint(4, 8)])
    start = rng.randrange(7)
    return "The days of the week: " + ", ".join(DAYS[(start + i) % 7] for i in range(7)) + "."


def generate_documents(seed: int = SEED, num_docs: int = NUM_DOCS) -> list[str]:
    rng = random.Random(seed)
    return [_facts(rng) if rng.random() < 0.15 else _story(rng) for _ in range(num_docs)]


def corpus_text(docs: list[str]) -> str:
    return "\n\n".join(docs) + "\n"


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify the committed files instead of writing")
    args = ap.parse_args(argv)
    docs = generate_documents()
    text = corpus_text(docs)
    tok = train_tokenizer(docs)
    tok_json = tok.to_str(pretty=True)
    if args.check:
        ok = True
        for path, want in ((CORPUS_FILE, text), (TOKENIZER_FILE, tok_json)):
            with open(path, encoding="utf-8") as f:
                same = f.read() == want
            print(f"{os.path.basename(path)}: {'matches' if same else 'DIFFERS from'} the generator")
            ok &= same
        return 0 if ok else 1
    with open(CORPUS_FILE, "w", encoding="utf-8") as f:
        f.write(text)
    with open(TOKENIZER_FILE, "w", encoding="utf-8") as f:
        f.write(tok_json)
    print(f"wrote {CORPUS_FILE} ({len(text.encode()):,} bytes, {len(docs)} documents)")
    print(f"wrote {TOKENIZER_FILE} (vocab {tok.get_vocab_size()}, at most {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
