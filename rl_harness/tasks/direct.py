"""The tasks answered directly (addition, sorting, counting): exact-match reward, no long form.

Their draws are fixed: every shipped result in results/rl depends on the prompts and answers
a seed gives.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .base import Example, target_of


def number(rng: random.Random, digits: int) -> int:
    """A number of exactly ``digits`` digits (0-9 for one digit)."""
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def addition(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    a, b = (number(rng, rng.randint(min_digits, max_digits)) for _ in range(2))
    return f"{a}+{b}=", str(a + b)


def sorting(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """Sort a list of single digits; ``*_digits`` bound the list length (times 3)."""
    items = [str(rng.randrange(10)) for _ in range(rng.randint(3 * min_digits, 3 * max_digits))]
    return f"s:{','.join(items)}=", ",".join(sorted(items))


def counting(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """How many times a letter occurs in a string of ``3 * digits`` letters from 'abcd'."""
    letter = rng.choice("abcd")
    text = "".join(rng.choice("abcd") for _ in range(rng.randint(3 * min_digits, 3 * max_digits)))
    return f"c{letter}:{text}=", str(text.count(letter))


@dataclass(frozen=True)
class DirectTask:
    """A :class:`~rl_harness.tasks.Task` from a ``draw(rng, min_size, max_size) -> (prompt,
    answer)`` function and its ``lengths(max_size) -> (prompt, answer)`` bounds; reward 1.0
    for exactly the answer followed by EOS."""

    draw: Callable[[random.Random, int, int], tuple[str, str]]
    lengths: Callable[[int], tuple[int, int]]

    def sample(self, rng: random.Random, min_size: int, max_size: int) -> Example:
        return Example(*self.draw(rng, min_size, max_size))

    def reward(self, example: Example, response: str, finished: bool) -> float:
        return 1.0 if finished and response == example.answer else 0.0

    def target(self, example: Example, long_form: bool) -> str:
        return target_of(example, long_form)

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        return self.lengths(max_size)


ADDITION = DirectTask(addition, lambda n: (2 * n + 2, n + 1))
SORTING = DirectTask(sorting, lambda n: (6 * n + 2, 6 * n - 1))
COUNTING = DirectTask(counting, lambda n: (3 * n + 4, len(str(3 * n))))
