"""A plug-in task for the tests (task.module=rl_plugin_task): repeat a string of letters."""

import random

from rl_harness.tasks import Example


class Echo:
    """Prompt ``"e:abc="``, answer ``"abc"``; no long form."""

    def sample(self, rng: random.Random, min_size: int, max_size: int) -> Example:
        text = "".join(rng.choice("abc") for _ in range(rng.randint(min_size, max_size)))
        return Example(f"e:{text}=", text)

    def reward(self, example: Example, response: str, finished: bool) -> float:
        return float(finished and response == example.answer)

    def target(self, example: Example, long_form: bool) -> str:
        return example.answer

    def max_lengths(self, max_size: int) -> tuple[int, int]:
        return max_size + 3, max_size


TASK = Echo()
