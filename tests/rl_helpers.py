"""Shared settings of the rl_harness tests: a tiny policy and task that run in seconds."""

TINY = [
    "model.hidden_size=32",
    "model.head_dim=8",
    "warmup.steps=20",
    "rollout.prompts=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint_every=2",
]
