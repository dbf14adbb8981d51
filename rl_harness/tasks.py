"""Synthetic, verifiable tasks with a character vocabulary, shipped with the code.

Each task draws (prompt, answer) pairs; the reward is 1 for an exact answer followed by EOS,
else 0. Answers have variable length, so response length can move during training.
"""

from __future__ import annotations

import random
from collections.abc import Callable

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+=,:abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 3 + len(CHARS)
_IDS = {c: i + 3 for i, c in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    return [_IDS[c] for c in text]


def decode(ids: list[int]) -> str:
    """Text of ``ids`` up to the first EOS (special tokens dropped)."""
    out = []
    for i in ids:
        if i == EOS:
            break
        if i >= 3:
            out.append(CHARS[i - 3])
    return "".join(out)


def _number(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def addition(rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    a, b = (_number(rng, rng.randint(min_digits, max_digits)) for _ in range(2))
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


TASKS: dict[str, Callable[[random.Random, int, int], tuple[str, str]]] = {
    "addition": addition,
    "sorting": sorting,
    "counting": counting,
}


def sample(name: str, rng: random.Random, min_digits: int, max_digits: int) -> tuple[str, str]:
    """A (prompt, answer) pair of task ``name``."""
    return TASKS[name](rng, min_digits, max_digits)


def reward(answer: str, response_ids: list[int]) -> float:
    """1.0 if the response is exactly ``answer`` then EOS, else 0.0."""
    return 1.0 if EOS in response_ids and decode(response_ids) == answer else 0.0
