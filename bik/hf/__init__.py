"""Hugging Face integration: patch_model / unpatch_model and the trainer-side log-prob helper.

After ``bik.patch_model(model)`` every reduction of the forward runs through bik: Linear
layers (lm_head included) through ``bik.linear``, RMSNorm through ``bik.rms_norm``, and
attention through ``bik.attention``, registered in transformers' attention-function registry
as "bik". Then the log-probs of tokens sampled by ``model.generate`` (KV cache, left-padded
batches) equal those of one full forward of the finished sequences, bit for bit.

What bik cannot compute is never ignored: attention keywords it does not implement
(dropout, non-causal attention...) raise when the model runs. Under
``torch.autocast`` each patched module returns the dtype the unpatched one would, and the
kernels run on the cast inputs with autocast off, so results stay batch-invariant.

Modules: ``patch`` (patch_model: check, classify, patch, report), ``kinds`` (the layer
kinds, one record each: how a module is recognised, its new forward, its report line),
``forwards``, ``moe`` and ``linear_attention`` (the installed forwards), ``attention`` (the
registered attention function and its mask analysis), ``autocast`` (how a patched forward runs
its op), ``logprobs`` (the trainer side). The families are records in ``bik.families``.
"""

from ..families import MOE_FAMILIES, SUPPORTED_FAMILIES
from .attention import ATTENTION_NAME
from .cache_keyword import cache_argument
from .logprobs import generation_position_ids, left_pad, sequence_logprobs
from .patch import PatchReport, patch_model, unpatch_model
from .static_decode import StaticDecoder

__all__ = [
    "ATTENTION_NAME",
    "MOE_FAMILIES",
    "SUPPORTED_FAMILIES",
    "PatchReport",
    "StaticDecoder",
    "cache_argument",
    "generation_position_ids",
    "left_pad",
    "patch_model",
    "sequence_logprobs",
    "unpatch_model",
]
