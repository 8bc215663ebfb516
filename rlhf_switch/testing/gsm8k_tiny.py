"""GSM8K-format word problems a tiny model can learn: one- or two-step addition, subtraction and
multiplication with small numbers, from a few templates, drawn from a seed.

Each record is ``{"question": ..., "answer": "<short reasoning> #### <int>"}`` — GSM8K's own
format, so ``rlhf_switch.rl.rewards:math_answer`` scores it. The shipped files are made by

    python -m rlhf_switch.testing.gsm8k_tiny data/gsm8k_tiny

and a test regenerates them byte for byte (``write_splits`` with the defaults below).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
THINGS = ("apples", "books", "coins", "eggs", "pens", "shells", "cards", "stamps")
NUM_TRAIN, NUM_TEST, SEED = 2000, 200, 0


def _add(rng: random.Random) -> tuple[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (f"{who} has {a} {what}. {who} gets {b} more. How many {what} does {who} have now?",
            f"{a} + {b} = {a + b}. #### {a + b}")


def _subtract(rng: random.Random) -> tuple[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(2, 30)
    b = rng.randint(1, a - 1)
    return (f"{who} had {a} {what} and gave away {b}. How many {what} are left?",
            f"{a} - {b} = {a - b}. #### {a - b}")


def _multiply(rng: random.Random) -> tuple[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"{who} has {a} bags with {b} {what} in each bag. How many {what} is that?",
            f"{a} * {b} = {a * b}. #### {a * b}")


def _two_steps(rng: random.Random) -> tuple[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(5, 20), rng.randint(1, 10)
    c = rng.randint(1, a + b - 1)
    return (f"{who} has {a} {what}, buys {b} more and then gives {c} away. How many {what} are left?",
            f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}. #### {a + b - c}")


TEMPLATES = (_add, _subtract, _multiply, _two_steps)


def make_records(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict]:
    """``n`` records with distinct questions, none in ``exclude``."""
    out, seen = [], set(exclude)
    while len(out) < n:
        question, answer = rng.choice(TEMPLATES)(rng)
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": answer})
    return out


def make_splits(num_train: int = NUM_TRAIN, num_test: int = NUM_TEST, seed: int = SEED) -> tuple[list, list]:
    """Disjoint (train, test) records; test is drawn first, so it does not depend on ``num_train``."""
    rng = random.Random(f"gsm8k_tiny:{seed}")
    test = make_records(num_test, rng)
    train = make_records(num_train, rng, exclude={r["question"] for r in test})
    return train, test


def write_splits(out_dir: str | Path, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST,
                 seed: int = SEED) -> tuple[Path, Path]:
    """``train.jsonl`` and ``test.jsonl`` in ``out_dir`` (one JSON object a line, keys sorted)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in zip(("train", "test"), make_splits(num_train, num_test, seed)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    print(*write_splits(sys.argv[1] if len(sys.argv) > 1 else "data/gsm8k_tiny"))
