"""The task plug-in interface (see rl_harness.tasks): an example and what a task provides."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Example:
    """One drawn problem: the prompt text, the answer text, and the long-form warm-up target
    (a scratchpad, ``':'``, the answer), or None for a task that has no long form."""

    prompt: str
    answer: str
    long_form: str | None = None


@runtime_checkable
class Task(Protocol):
    """What the harness asks of a task. Texts use the run's vocabulary (for the character
    vocabulary: characters of rl_harness.vocab.CHARS only)."""

    def sample(self, rng: random.Random, min_size: int, max_size: int) -> Example:
        """A problem of a size in ``[min_size, max_size]`` (task.min_digits / max_digits),
        drawn from ``rng`` alone, so a seed fixes the data."""
        ...

    def reward(self, example: Example, response: str, finished: bool) -> float:
        """The reward of ``response`` (decoded, up to EOS); ``finished``: it ended with EOS."""
        ...

    def target(self, example: Example, long_form: bool) -> str:
        """The supervised warm-up target: the long form when ``long_form`` and the task has
        one, else the direct answer (EOS is appended by the harness)."""
        ...

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        """Upper bounds, in characters, on a prompt and on a warm-up target (the long form
        where the task has one) at size ``max_size``; the harness refuses a config whose
        sequences could exceed the policy's positions."""
        ...


def target_of(example: Example, long_form: bool) -> str:
    """:meth:`Task.target` for a task whose examples carry their long form."""
    return example.long_form if long_form and example.long_form is not None else example.answer


def final_answer(response: str) -> str:
    """The text after the last ``':'`` of ``response`` (all of it when there is none)."""
    return response.rpartition(":")[2]
