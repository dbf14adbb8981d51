"""Settings a verl run cannot be exact under, refused when the trainer is built, each named."""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from .settings import ROLLOUT_NAME

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def dtype(setting: str, value: Any) -> torch.dtype:
    """A dtype from a verl config value, or ValueError naming the setting."""
    if str(value) not in _DTYPES:
        raise ValueError(f"{setting}: expected one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[str(value)]


def check_sampling(top_p: float, top_k: int, repetition_penalty: float = 1.0) -> None:
    """Refuse sampling settings that change the distribution the trainer scores against."""
    if float(top_p) != 1.0:
        raise ValueError(
            f"rollout.top_p: expected 1.0 (the trainer scores the full vocabulary), got {top_p}"
        )
    if int(top_k) not in (-1, 0):
        raise ValueError(
            f"rollout.top_k: expected -1 (the trainer scores the full vocabulary), got {top_k}"
        )
    if float(repetition_penalty) != 1.0:
        raise ValueError(
            "repetition_penalty: expected 1.0 (the trainer does not apply it), "
            f"got {repetition_penalty}"
        )


def check_version(version: str, tested: str) -> None:
    """Refuse a verl whose hooks may differ from the ones the plug-ins were written against."""
    if version not in SpecifierSet(tested):
        raise RuntimeError(
            f"verl {version}: bik.verl plugs into verl{tested} (its registries, the engine's "
            "_build_module, the trainer's old-log-prob step); install that version "
            "(make install-verl)"
        )


def check_settings(config: Any) -> None:
    """Refuse a verl config whose rollout and update cannot agree bit for bit.

    The rollout must be bik's and sample the full distribution in the dtype the update's
    forward computes in; the update must score with the model's own LM head (no fused
    log-prob kernel) on whole sequences (no Ulysses split of a sequence across ranks)."""
    model = config.actor_rollout_ref.model
    actor = config.actor_rollout_ref.actor
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != ROLLOUT_NAME:
        raise ValueError(
            f"actor_rollout_ref.rollout.name: expected {ROLLOUT_NAME!r} (bik.verl patches the "
            f"trainer; a {rollout.name!r} rollout computes in its own order), got {rollout.name!r}"
        )
    check_sampling(rollout.top_p, rollout.top_k)
    compute = dtype("actor_rollout_ref.actor.fsdp_config.dtype", actor.fsdp_config.dtype)
    if dtype("actor_rollout_ref.rollout.dtype", rollout.dtype) != compute:
        raise ValueError(
            f"actor_rollout_ref.rollout.dtype: expected the update's compute dtype "
            f"({actor.fsdp_config.dtype}, actor.fsdp_config.dtype), got {rollout.dtype!r}"
        )
    if actor.fsdp_config.ulysses_sequence_parallel_size != 1:
        raise ValueError(
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size: expected 1 "
            "(Ulysses splits a sequence's attention across ranks in another order), got "
            f"{actor.fsdp_config.ulysses_sequence_parallel_size}"
        )
    if model.get("use_fused_kernels", False):
        raise ValueError(
            "actor_rollout_ref.model.use_fused_kernels: expected False (verl's fused kernel "
            "computes the log-probs in its own order), got True"
        )
    correction = config.algorithm.get("rollout_correction", None)
    if correction and correction.get("bypass_mode", False) and not rollout.calculate_log_probs:
        raise ValueError(
            "actor_rollout_ref.rollout.calculate_log_probs: expected True with "
            "algorithm.rollout_correction.bypass_mode=true (pi_old is the rollout's log-probs)"
        )


def install() -> None:
    """Check the settings when verl's trainer is built (in the process that drives the run)."""
    from verl.trainer.ppo.v1 import trainer_base

    build = trainer_base.PPOTrainer.__init__

    def checked_init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        check_settings(config)
        build(self, config, *args, **kwargs)

    trainer_base.PPOTrainer.__init__ = checked_init
