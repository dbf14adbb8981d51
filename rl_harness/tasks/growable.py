"""Tasks with a long form: a scratchpad of easy local steps, ``':'``, then the answer.

The short form answers directly (a few tokens); the long form (tens to ~200 tokens) breaks
the problem into steps a tiny policy can learn, so after a warm-up with a small long-form
share (warmup.long_form_share) RL can find that long responses pay. Either form earns the
reward: 1.0 iff the response ended with EOS and its final answer (the text after its last
``':'``, or all of it) is the answer.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from .base import Example, final_answer, target_of
from .direct import number


class ScratchpadTask(ABC):
    """A :class:`~rl_harness.tasks.Task` whose problems of size ``size`` come with a
    scratchpad (:meth:`draw`)."""

    @abstractmethod
    def draw(self, rng: random.Random, size: int) -> tuple[str, str, str]:
        """(prompt, scratchpad, answer) of a problem of size ``size``."""

    @abstractmethod
    def max_lengths(self, max_size: int) -> tuple[int, int]:
        """Bounds on the prompt and the long form (see Task.max_lengths)."""

    def sample(self, rng: random.Random, min_size: int, max_size: int) -> Example:
        prompt, scratchpad, answer = self.draw(rng, rng.randint(min_size, max_size))
        return Example(prompt, answer, f"{scratchpad}:{answer}")

    def reward(self, example: Example, response: str, finished: bool) -> float:
        return 1.0 if finished and final_answer(response) == example.answer else 0.0

    def target(self, example: Example, long_form: bool) -> str:
        return target_of(example, long_form)


class ScratchAddition(ScratchpadTask):
    """Addition of two ``size``-digit numbers: ``"587+792="``; long form column by column
    from the units, each ``digit+digit+carry=sum``:
    ``"7+2+0=9,8+9+0=17,5+7+1=13:1379"``; short form ``"1379"``."""

    def draw(self, rng: random.Random, size: int) -> tuple[str, str, str]:
        a, b = number(rng, size), number(rng, size)
        columns, carry = [], 0
        for x, y in zip(reversed(f"{a:0{size}d}"), reversed(f"{b:0{size}d}")):
            total = int(x) + int(y) + carry
            columns.append(f"{x}+{y}+{carry}={total}")
            carry = total // 10
        return f"{a}+{b}=", ",".join(columns), str(a + b)

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        # a column is at most "9+9+1=19," (9 characters); then ':' and max_size + 1 digits
        return 2 * max_size + 2, 9 * max_size + max_size + 1


class Iterate(ScratchpadTask):
    """``size`` steps of ``x -> (3 x + 7) mod 100`` from a start value, every number two
    digits: ``"i37n03="`` (start 37, 3 steps); long form counts the steps left down to 00,
    each ``left=value``: ``"02=18,01=61,00=90:90"``; short form ``"90"``.

    One step is a fixed two-digit map (its units digit depends on the units digit alone)
    and the countdown says when to stop, so the long form is easy; the direct answer needs
    the composition of ``size`` steps (3 has order 20 mod 100: no short cycle to exploit)."""

    MULTIPLIER, INCREMENT, MODULUS = 3, 7, 100

    def draw(self, rng: random.Random, size: int) -> tuple[str, str, str]:
        start = value = rng.randrange(self.MODULUS)
        steps = []
        for left in reversed(range(size)):
            value = (self.MULTIPLIER * value + self.INCREMENT) % self.MODULUS
            steps.append(f"{left:02d}={value:02d}")
        return f"i{start:02d}n{size:02d}=", ",".join(steps), f"{value:02d}"

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        # a step is "left=value," (6 characters); then ':' and two digits
        return 7, 6 * max_size + 2


SCRATCH_ADDITION = ScratchAddition()
ITERATE = Iterate()
