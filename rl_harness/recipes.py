"""Named recipes: a description and config overrides on top of rl_harness.config.DEFAULTS."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

# A run that mismatch visibly hurts: a strong biased rollout-side logit drift at a high LR.
_DRIFTING = {"train.lr": 1e-3, "rollout.logit_noise_bias": 2.0}
# Rollout in an in-process vLLM engine; head size 32, as vLLM's native CPU attention has no 16.
_VLLM = {"rollout.engine": "vllm", "model.head_dim": 32}
# A tiny Qwen3-MoE policy: 8 experts, 2 per token (model.experts, model.experts_per_token).
_MOE = {"model.family": "qwen3_moe"}
# A tiny Qwen3.5 policy: Gated DeltaNet layers beside a gated full-attention one.
_HYBRID = {"model.family": "qwen3_5_text"}

# The real model (bik.testing.models, SmolLM2-135M-Instruct) on a task it can partly do, asked
# through its chat template; no warm-up (it is pretrained); bf16 on both sides, as trainers run it.
# remedy.bypass takes the rollout's log-probs as pi_old (one forward less, as verl's bypass
# mode), so the PPO ratio at the first update is pi_train / pi_rollout: exactly 1 under bik,
# and where the kernels make it differ PPO clips tokens whose policy has not moved (clip 0.1).
_SMOLLM2 = {
    "model.path": "smollm2",
    "model.chat_template": True,
    "task.name": "chat_addition",
    "task.max_digits": 1,
    "warmup.steps": 0,
    "steps": 3,
    "rollout.prompts": 4,
    "rollout.samples_per_prompt": 2,
    "rollout.max_new_tokens": 8,
    "rollout.temperature": 0.7,
    "rollout.dtype": "bfloat16",
    "train.dtype": "bfloat16",
    "train.lr": 1e-6,
    "train.clip_low": 0.1,
    "train.clip_high": 0.1,
    "remedy.bypass": True,
}

# The pre-registered collapse experiment (results/rl/RESULTS.md section 8): a growable task
# (iterate, long forms up to 74 tokens) warmed up with 30 % long-form targets, a hot sampler,
# a high LR, and an fp8-like native bf16 rollout against bik's fp32 trainer. Every arm shares
# one warm-up (warmup.seed 0); the RL seed alone changes between seeds.
_COLLAPSE = {
    "steps": 100,
    "task.name": "iterate",
    "task.min_digits": 4,
    "task.max_digits": 12,
    "warmup.seed": 0,
    "warmup.steps": 1000,
    "warmup.long_form_share": 0.3,
    "rollout.prompts": 16,
    "rollout.max_new_tokens": 96,
    "rollout.temperature": 1.2,
    "rollout.kernels": "native",
    "rollout.dtype": "bfloat16",
    "rollout.weight_round_bits": 3,
    "train.lr": 2e-3,
    "eval.every": 10,
}
# Its registered follow-up (RESULTS.md section 9): longer chains (10-20 steps, long forms up
# to 123 tokens), an LR between the one where both sides collapsed (2e-3) and the one where
# neither did (1e-3), and an evaluation before the first update.
_COLLAPSE_LONG = {
    **_COLLAPSE,
    "task.min_digits": 10,
    "task.max_digits": 20,
    "rollout.max_new_tokens": 128,
    "train.lr": 1.5e-3,
    "eval.at_start": True,
}
# The stability-edge experiment (RESULTS.md section 13; rl_harness.studies.edge): section 9's task,
# 150 steps, 128 held-out prompts, the trainer in bf16 so that a dose and its zero-mismatch
# twin both sample at bf16 precision, and response digests for the pair's agreement. This is
# the grid's "bf16" dose (native kernels in the rollout); rl_harness.studies.edge.DOSES adds the
# others.
_EDGE = {
    **_COLLAPSE_LONG,
    "steps": 150,
    "train.dtype": "bfloat16",
    "rollout.weight_round_bits": 0,
    "eval.prompts": 128,
    "rollout.digests": True,
}
COLLAPSE_ARMS = (
    "collapse_constant",
    "collapse_surge_decay",
    "collapse_fixed_decay",
    "collapse_token_tis",
)

RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero_mismatch": ("bik kernels on both sides: every mismatch metric is exactly 0", {}),
    "kernel_swap": (
        "rollout on native torch kernels, trainer on bik",
        {"rollout.kernels": "native"},
    ),
    "dtype_swap": ("rollout in bfloat16, trainer in float32", {"rollout.dtype": "bfloat16"}),
    "split_swap": (
        "rollout attention with another fixed split size (needs sequences > 32 tokens)",
        {
            "task.name": "sorting",
            "task.max_digits": 4,
            "rollout.max_new_tokens": 28,
            "rollout.split_size": 32,
        },
    ),
    "microbatch_native": (
        "native kernels on both sides, trainer micro-batches of 8 rows",
        {"rollout.kernels": "native", "train.kernels": "native", "train.micro_batch_size": 8},
    ),
    "noise_random": ("unbiased rollout logit noise (std 0.1)", {"rollout.logit_noise_std": 0.1}),
    "noise_biased": (
        "biased rollout logit drift (0.5 x a fixed random direction)",
        {"rollout.logit_noise_bias": 0.5},
    ),
    "logit_rounding": (
        "rollout logits rounded to 7 mantissa bits (bf16-like)",
        {"rollout.logit_round_bits": 7},
    ),
    "fp8_weights": (
        "rollout copy's linear weights rounded to 3 mantissa bits (fp8 e4m3-like)",
        {"rollout.weight_round_bits": 3},
    ),
    "bf16_autocast": (
        "trainer forward under bf16 autocast over fp32 weights, rollout in fp32 (both on bik)",
        {"train.autocast": "bfloat16"},
    ),
    "high_lr": ("zero mismatch at the drifting runs' LR (their baseline)", {"train.lr": 1e-3}),
    "drifting": ("a drifting run for the remedies: biased drift 2.0, LR 1e-3", _DRIFTING),
    "drifting_token_tis": ("drifting + token TIS (C=2)", {**_DRIFTING, "remedy.name": "token_tis"}),
    "drifting_token_mis": (
        "drifting + token MIS / IcePop [0.5, 2]",
        {**_DRIFTING, "remedy.name": "token_mis"},
    ),
    "drifting_geo_rs": (
        "drifting + geometric-mean rejection [0.999, 1.001]",
        {**_DRIFTING, "remedy.name": "geo_rs"},
    ),
    "drifting_lr_decay": (
        "drifting + LR decay on response-length surge",
        {**_DRIFTING, "lr_schedule.name": "length_surge"},
    ),
    "drifting_fp16": ("drifting + float16 on both sides", {**_DRIFTING, "remedy.name": "fp16"}),
    "ppo_minibatch": (
        "zero mismatch, PPO: 2 epochs x 4 mini-batches per step (8 updates; the ratio moves)",
        {"train.ppo_epochs": 2, "train.mini_batches": 4},
    ),
    "vllm_zero_mismatch": (
        "rollout in vLLM with bik (bik.vllm), trainer on bik: every mismatch metric is exactly 0",
        _VLLM,
    ),
    "vllm_native": (
        "rollout in vLLM with its own kernels, trainer on bik: the real engine-vs-trainer mismatch",
        {**_VLLM, "rollout.kernels": "native"},
    ),
    "vllm_tp2_zero_mismatch": (
        "rollout in vLLM at tensor parallelism 2 with bik's TP-invariant order, trainer in one "
        "process: every mismatch metric is exactly 0",
        {**_VLLM, "rollout.tensor_parallel": 2},
    ),
    "vllm_tp2_native": (
        "rollout in vLLM at tensor parallelism 2 with its own kernels, trainer on bik",
        {**_VLLM, "rollout.tensor_parallel": 2, "rollout.kernels": "native"},
    ),
    "moe_zero_mismatch": (
        "Qwen3-MoE policy, bik on both sides: every mismatch metric and routing flip is 0",
        _MOE,
    ),
    "moe_kernel_swap": (
        "Qwen3-MoE policy, rollout on native torch kernels, trainer on bik",
        {**_MOE, "rollout.kernels": "native"},
    ),
    "moe_dtype_swap": (
        "Qwen3-MoE policy, rollout in bfloat16, trainer in float32",
        {**_MOE, "rollout.dtype": "bfloat16"},
    ),
    "hybrid_zero_mismatch": (
        "Qwen3.5 hybrid policy (Gated DeltaNet + attention), bik on both sides: every mismatch "
        "metric is exactly 0",
        _HYBRID,
    ),
    "hybrid_kernel_swap": (
        "Qwen3.5 hybrid policy, rollout on transformers' own kernels (chunked prefill, "
        "recurrent decode), trainer on bik",
        {**_HYBRID, "rollout.kernels": "native"},
    ),
    "smollm2": (
        "SmolLM2-135M-Instruct, chat addition, bf16, bik on both sides: the PPO ratio is 1",
        _SMOLLM2,
    ),
    "collapse_constant": (
        "collapse experiment: fp8-like native bf16 rollout vs bik fp32 trainer, constant LR 2e-3",
        _COLLAPSE,
    ),
    "collapse_surge_decay": (
        "collapse experiment + LR halved every 1.8 x surge step once length surges 2x",
        {**_COLLAPSE, "lr_schedule.name": "length_surge", "lr_schedule.surge_ratio": 2.0},
    ),
    "collapse_fixed_decay": (
        "collapse experiment + LR halved every 20 steps from the start",
        {**_COLLAPSE, "lr_schedule.name": "length_surge", "lr_schedule.decay_period": 20},
    ),
    "collapse_token_tis": (
        "collapse experiment + token TIS (C=2)",
        {**_COLLAPSE, "remedy.name": "token_tis"},
    ),
    "collapse_long_constant": (
        "collapse follow-up: iterate 10-20 steps, fp8-like native bf16 rollout, LR 1.5e-3",
        _COLLAPSE_LONG,
    ),
    "edge": (
        "stability edge (rl_harness.studies.edge): native bf16 rollout vs bik bf16 trainer, "
        "150 steps",
        _EDGE,
    ),
}
for _scale in (0.25, 0.5, 1.0, 2.0, 4.0):  # dose-response: injected biased drift
    RECIPES[f"dose_bias_{_scale}"] = (
        f"dose-response: biased drift {_scale}, LR 1e-3",
        {"rollout.logit_noise_bias": _scale, "train.lr": 1e-3},
    )
DEFAULT = "zero_mismatch"


# Every recipe's committed runs (results/rl) were warmed up in plain torch, before
# warmup.kernels existed: a recipe reruns them.
RECIPE_WARMUP = {"warmup.kernels": "torch"}


def overrides(name: str) -> dict[str, Any]:
    """The config overrides of recipe ``name``."""
    if name not in RECIPES:
        raise ConfigError(f"--recipe: unknown recipe {name!r}; see `python -m rl_harness recipes`")
    return {**RECIPE_WARMUP, **RECIPES[name][1]}
