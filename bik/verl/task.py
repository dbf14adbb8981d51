"""The demo's task: short chat prompts and a reward that varies between samples.

verl reads a parquet of rows (a chat ``prompt``, a ``data_source``, the ground truth under
``reward_model``) and scores each response with ``compute_score`` from a file it is given
(``reward.custom_reward_function.path``: this file).
"""

from __future__ import annotations

from typing import Any

WORDS = ("apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon")


def rows(count: int) -> list[dict[str, Any]]:
    """``count`` prompts "Say <word>.", the word cycling through :data:`WORDS`."""
    if count < 1:
        raise ValueError(f"count: expected at least 1 row, got {count}")
    return [
        {
            "data_source": "bik_say",
            "prompt": [{"role": "user", "content": f"Say {WORDS[i % len(WORDS)]}."}],
            "ability": "say",
            "reward_model": {"style": "rule", "ground_truth": WORDS[i % len(WORDS)]},
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any
) -> float:
    """1 when the answer says the word; else the share of its characters that are vowels, a
    signal that differs between a group's samples even before the policy learns the task."""
    if ground_truth in solution_str:
        return 1.0
    return 0.5 * sum(c in "aeiou" for c in solution_str) / max(len(solution_str), 1)
