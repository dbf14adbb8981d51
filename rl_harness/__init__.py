"""RL harness: rollout and policy update through identical bik kernels, with the mismatch
between the two sides measured every step (see README, "RL harness").

Modules: config (frozen per-section configs), tasks (shipped and plug-in), vocab (characters
or a local tokenizer), policy, logits (the logits processing both sides share), rollout,
trainer, metrics, remedies (IS weights, rejection, fp16), schedule (LR), collapse, rundir (run
directory files), runner, distributed (data parallelism under torchrun), report (summary,
compare, plots), recipes, world_size (world size 1 vs N, step by step).
"""

import bik  # noqa: F401  (first: where torch is missing, it says how to run the harness)
