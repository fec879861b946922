"""Write the small example datasets (JSONL, a train and an eval split each) into a folder.

    python examples/data/make_datasets.py [OUT] [--seed 0] [--train 512] [--eval 64]

OUT (default examples/data/out, git-ignored) receives:

count-chat/{train,eval}.jsonl  chat prompts (TRL's conversational format: a system and a user message) and an
    `answer` column. The user gives a few digits counting up (wrapping 9 -> 0), the answer is the next two:
    "345" -> "67". A tiny config-built model learns it on the CPU in a few dozen steps (examples/chat/).
math/{train,eval}.jsonl  plain-string arithmetic prompts asking for a \\boxed{} answer, and the exact
    `answer` (an integer or a reduced fraction such as "3/4"), for the math_answer reward.

The rows depend only on the seed (train and eval are drawn from one stream, so they are i.i.d. but do not
overlap by position); nothing is downloaded. `--dataset` reads the files with the `datasets` library.
"""
from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

SYSTEM = "Count on: the next two digits."


def count_row(rng: random.Random) -> dict:
    start, length = rng.randrange(10), rng.randint(3, 5)
    seq = "".join(str((start + i) % 10) for i in range(length + 2))
    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": seq[:length]}],
            "answer": seq[length:]}


def _fmt(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def math_row(rng: random.Random) -> dict:
    kind = rng.choice(["add", "sub", "mul", "frac_add", "simplify"])
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == "add":
        question, value = f"What is {a} + {b}?", Fraction(a + b)
    elif kind == "sub":
        question, value = f"What is {a} - {b}?", Fraction(a - b)
    elif kind == "mul":
        a, b = a % 20 + 2, b % 20 + 2
        question, value = f"What is {a} * {b}?", Fraction(a * b)
    elif kind == "frac_add":
        p, q, r, s = rng.randint(1, 9), rng.randint(2, 9), rng.randint(1, 9), rng.randint(2, 9)
        question, value = f"What is {p}/{q} + {r}/{s}?", Fraction(p, q) + Fraction(r, s)
    else:
        k, p, q = rng.randint(2, 9), rng.randint(1, 9), rng.randint(2, 9)
        question, value = f"Simplify the fraction {k * p}/{k * q}.", Fraction(p, q)
    return {"prompt": question + " Put the final answer in \\boxed{}.", "answer": _fmt(value), "kind": kind}


MAKERS = {"count-chat": count_row, "math": math_row}


def splits(name: str, seed: int = 0, n_train: int = 512, n_eval: int = 64) -> tuple[list[dict], list[dict]]:
    """Dataset `name`'s (train rows, eval rows), as write() writes them."""
    rng = random.Random(f"{name}:{seed}")            # one stream per dataset: adding one leaves the others
    rows = [MAKERS[name](rng) for _ in range(n_train + n_eval)]
    return rows[:n_train], rows[n_train:]


def write(out: Path, seed: int, n_train: int, n_eval: int) -> dict[str, Path]:
    """Every dataset's train.jsonl and eval.jsonl under `out`; returns {name: folder}."""
    folders = {}
    for name in MAKERS:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in zip(("train", "eval"), splits(name, seed, n_train, n_eval)):
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        folders[name] = folder
    return folders


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=str(Path(__file__).parent / "out"), help="folder to write into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=512, help="rows in each train split")
    p.add_argument("--eval", type=int, default=64, help="rows in each eval split")
    a = p.parse_args(argv)
    if a.train < 1 or a.eval < 1:
        p.error("--train and --eval must be at least 1")
    for name, folder in write(Path(a.out), a.seed, a.train, a.eval).items():
        print(f"{name}: {folder / 'train.jsonl'} ({a.train} rows), {folder / 'eval.jsonl'} ({a.eval} rows)")


if __name__ == "__main__":
    main()
