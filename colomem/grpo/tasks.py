"""Built-in tasks: prompts from a seeded RNG, answers known, so rewards are exact.

successor (the default job)  count on: ">345" -> "67". The answer continues the counting sequence of the
    prompt in base `base` (wrapping 9 -> 0). Each answer symbol is the successor of the symbol before it,
    a rule a 4-layer model picks up from random initialisation in a few dozen GRPO steps. Reward:
    char_match (per-position partial credit, extra characters count as wrong: only the exact answer
    followed by EOS scores 1); exact_match is logged as `accuracy`.
copy                          "3907>" -> "3907": needs attention to the matching prompt position; slower to learn.

Prompts for a step depend only on (seed, step), so every rank draws the same prompts (vLLM tensor parallel
needs identical requests on all ranks; each rank then trains on its share of the groups).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from colomem.errors import InvalidArgumentError

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyz"
SEP = ">"


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)   # passed to reward fns as keywords (answer= included)


class Task:
    name = "task"
    rewards: tuple[str, ...] = ("exact_match",)     # summed into the reward
    metrics: dict[str, str] = {}                   # logged only: metric name -> reward fn name

    def __init__(self, **options):
        if options:
            raise InvalidArgumentError(f"task {self.name!r} has no options {sorted(options)}")

    @property
    def alphabet(self) -> str:
        raise NotImplementedError

    @property
    def max_prompt_chars(self) -> int:
        raise NotImplementedError

    @property
    def max_new_tokens(self) -> int:
        """A good default: the longest answer plus one token for EOS."""
        raise NotImplementedError

    @property
    def longest_prompt_tokens(self) -> int:
        """A bound on a prompt's tokens: its characters, each a token at most (the built-in tasks write ASCII
        symbols, which no tokenizer splits)."""
        return self.max_prompt_chars

    def sample(self, rng: random.Random) -> Sample:
        raise NotImplementedError

    def samples(self, n: int, *, seed: int, step: int) -> list[Sample]:
        rng = random.Random(f"{self.name}:{seed}:{step}")     # same prompts on every rank
        return [self.sample(rng) for _ in range(n)]


class SuccessorTask(Task):
    name = "successor"
    rewards = ("char_match",)
    metrics = {"accuracy": "exact_match"}

    def __init__(self, base: int = 10, prompt_len: int = 3, answer_len: int = 2):
        if not 2 <= base <= len(SYMBOLS):
            raise InvalidArgumentError(f"successor: base must be in [2, {len(SYMBOLS)}], got {base}")
        if prompt_len < 1 or answer_len < 1:
            raise InvalidArgumentError("successor: prompt_len and answer_len must be >= 1")
        self.base, self.prompt_len, self.answer_len = base, prompt_len, answer_len

    @property
    def alphabet(self) -> str:
        return SYMBOLS[:self.base] + SEP

    @property
    def max_prompt_chars(self) -> int:
        return self.prompt_len + 1

    @property
    def max_new_tokens(self) -> int:
        return self.answer_len + 1

    def sample(self, rng: random.Random) -> Sample:
        start = rng.randrange(self.base)
        seq = "".join(SYMBOLS[(start + i) % self.base] for i in range(self.prompt_len + self.answer_len))
        # the separator leads, so every answer symbol is the successor of the token right before it
        prompt, answer = SEP + seq[:self.prompt_len], seq[self.prompt_len:]
        return Sample(prompt, answer, {"answer": answer, "format": f"[{SYMBOLS[:self.base]}]+"})


class CopyTask(Task):
    name = "copy"
    rewards = ("char_match",)
    metrics = {"accuracy": "exact_match"}

    def __init__(self, base: int = 10, length: int = 3):
        if not 2 <= base <= len(SYMBOLS) or length < 1:
            raise InvalidArgumentError("copy: base must be in [2, 36] and length >= 1")
        self.base, self.length = base, length

    @property
    def alphabet(self) -> str:
        return SYMBOLS[:self.base] + SEP

    @property
    def max_prompt_chars(self) -> int:
        return self.length + 1

    @property
    def max_new_tokens(self) -> int:
        return self.length + 1

    def sample(self, rng: random.Random) -> Sample:
        s = "".join(rng.choice(SYMBOLS[:self.base]) for _ in range(self.length))
        return Sample(s + SEP, s, {"answer": s, "format": f"[{SYMBOLS[:self.base]}]+"})


TASKS: dict[str, type[Task]] = {"successor": SuccessorTask, "copy": CopyTask}


def make_task(name: str, options: dict | None = None) -> Task:
    if name not in TASKS:
        raise InvalidArgumentError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    try:
        return TASKS[name](**(options or {}))
    except TypeError as e:
        raise InvalidArgumentError(f"task {name!r}: bad task_options {options!r} ({e})") from None
