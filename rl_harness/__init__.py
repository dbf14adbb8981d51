"""RL harness: rollout and policy update through identical bik kernels (to be built)."""
