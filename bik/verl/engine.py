"""verl's FSDP2 training engine on CPU with the model patched by bik.

verl builds the policy in ``FSDPEngine._build_module`` (``from_pretrained`` and verl's own
monkey patches), then shards it with FSDP2. bik patches the model between the two, so every
forward of the trainer (the old-log-prob pass, the update's micro-batches, packed or padded)
runs bik's kernels; FSDP2 all-gathers each weight before a layer runs, so the sharding changes
no reduction a row sees. The per-token log-probs go through bik's formula
(:func:`bik.token_logprobs`), the one the rollout server samples with.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl

from ..hf.patch import patch_model
from ..ops.log_softmax import token_logprobs
from .settings import native


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` through bik: fp32 log-softmax in a fixed order.

    verl has already divided ``logits`` by the temperature (in the logits' dtype), as the
    rollout server does before it calls the same function.
    """
    return token_logprobs(logits, labels)


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")
class BikFSDPEngine(transformer_impl.FSDPEngineWithLMHead):
    """verl's FSDP(2) language-model engine, its module patched by bik before sharding."""

    def _build_module(self) -> Any:
        module = super()._build_module()
        if not native():
            patch_model(module)
        return module


def logprobs_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The formula the engine's forward uses now: bik's, or verl's in the native control."""
    return transformer_impl.logprobs_from_logits(logits, labels)


def install() -> None:
    """bik's log-prob formula in the engine's forward (unless the run is the native control).

    The engine module imported verl's function by name: its global is the one it calls."""
    if not native():
        transformer_impl.logprobs_from_logits = logprobs_from_logits
