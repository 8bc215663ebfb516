"""Preference pairs on the addition task a tiny reward model can learn: for each prompt of the
task (``12+34=``, the character tokenizer's alphabet), ``chosen`` is the correct sum and
``rejected`` a wrong one — the sum with its units digit changed, off by one or two, or off by
ten: the mistakes a tiny policy makes.

The prompts are the addition task's own splits (``rl.tasks.make_splits`` of ``min_len=1,
max_len=2, seed=0``, the task block of ``configs/ppo_tiny.yaml``): ``train.jsonl`` pairs the train
prompts, ``heldout.jsonl`` the held-out ones, so no held-out pair's prompt is trained on. Each
record is ``{"prompt", "chosen", "rejected"}``. The shipped files are made by

    python -m rlhf_switch.testing.prefs_tiny data/prefs_tiny

and a test regenerates them byte for byte (``write_splits`` with the defaults below).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from ..rl.tasks import build_task, make_splits

NUM_TRAIN, NUM_HELDOUT, SEED = 2000, 200, 0


def wrong_sum(total: int, rng: random.Random) -> int:
    """A non-negative integer other than ``total``: its units digit changed, ±1, ±2 or ±10."""
    while True:
        kind = rng.choice(("units", "near", "near", "tens"))
        if kind == "units":
            other = total - total % 10 + rng.choice([d for d in range(10) if d != total % 10])
        elif kind == "near":
            other = total + rng.choice((-2, -1, 1, 2))
        else:
            other = total + rng.choice((-10, 10))
        if other >= 0 and other != total:
            return other


def make_pairs(samples, rng: random.Random) -> list[dict]:
    return [{"prompt": s.prompt, "chosen": s.answer, "rejected": str(wrong_sum(int(s.answer), rng))}
            for s in samples]


def make_splits_of_pairs(num_train: int = NUM_TRAIN, num_heldout: int = NUM_HELDOUT,
                         seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train, held-out) pairs over the addition task's (train, held-out) prompts."""
    splits = make_splits(build_task("addition", 1, 2), num_train, num_heldout, seed)
    rng = random.Random(f"prefs_tiny:{seed}")
    heldout = make_pairs(splits.heldout, rng)
    return make_pairs(splits.train, rng), heldout


def write_splits(out_dir: str | Path, num_train: int = NUM_TRAIN, num_heldout: int = NUM_HELDOUT,
                 seed: int = SEED) -> tuple[Path, Path]:
    """``train.jsonl`` and ``heldout.jsonl`` in ``out_dir`` (one JSON object a line, keys sorted)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in zip(("train", "heldout"), make_splits_of_pairs(num_train, num_heldout, seed)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1]


if __name__ == "__main__":
    print(*write_splits(sys.argv[1] if len(sys.argv) > 1 else "data/prefs_tiny"))
