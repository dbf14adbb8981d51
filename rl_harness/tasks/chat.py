"""A task for a pretrained chat model: addition asked in words, answered in its own words.

``chat_addition`` (with ``model.chat_template=true`` and a ``model.path`` tokenizer, such as
``model.path=smollm2``): "What is 3 + 5? Reply with the number only." earns 1.0 when the last
number in the response is the sum, however the model phrases it ("8", "3 + 5 = 8."). A small
instruct model gets some of these right, so the reward has room to move.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .base import Example
from .direct import number

QUESTION = "What is {a} + {b}? Reply with the number only."


@dataclass(frozen=True)
class ChatAddition:
    """:class:`~rl_harness.tasks.Task` of the module docstring; ``*_digits`` bound each term."""

    def sample(self, rng: random.Random, min_size: int, max_size: int) -> Example:
        a, b = (number(rng, rng.randint(min_size, max_size)) for _ in range(2))
        return Example(QUESTION.format(a=a, b=b), str(a + b))

    def reward(self, example: Example, response: str, finished: bool) -> float:
        numbers = re.findall(r"\d+", response)
        return 1.0 if numbers and numbers[-1] == example.answer else 0.0

    def target(self, example: Example, long_form: bool) -> str:
        return example.answer

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        return len(QUESTION) + 2 * max_size, max_size + 1


CHAT_ADDITION = ChatAddition()
