"""What bik's recurrent layers in vLLM share (Gated DeltaNet: bik.vllm.gdn; Mamba2:
bik.vllm.mamba2): vLLM's pooled per-sequence states read as bik keeps them, and the short
causal convolution advanced over a sequence's cached inputs.

vLLM keeps each running sequence's states in a slot of two pools per layer: the last ``W - 1``
inputs of the convolution (in the model's dtype) and the recurrent state. bik reads and writes
the slot of each sequence itself, one sequence at a time, so where a step cuts a sequence
(chunked prefill, a decode step, a prefix-cache hit resuming from a cached state) never
changes a bit: the orders count tokens from the sequence's first.
"""

from typing import Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from ..layers.delta_rule import causal_conv1d


def state_pools(layer: Any, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s pools: the convolution's cached inputs as ``[slots, C, W - 1]`` (channels
    first, a view of vLLM's cache whatever its layout) and the fp32 recurrent states as vLLM
    shapes them. NotImplementedError for a conv pool wider than the window (vLLM widens it for
    speculative decoding) or a state pool narrower than fp32 (``kind`` names the layer)."""
    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv = conv.transpose(1, 2)
    if conv.shape[-1] != layer.conv1d.weight.shape[-1] - 1:
        raise NotImplementedError(
            f"bik.vllm: a {kind} conv state wider than the convolution's window (vLLM widens "
            "it for speculative decoding)"
        )
    if ssm.dtype != torch.float32:
        raise NotImplementedError(
            f"bik.vllm: the {kind} state is kept in {ssm.dtype}; bik runs it in fp32, as the "
            "trainer keeps it: pass mamba_ssm_cache_dtype='float32' (bik.vllm.LLM's default)"
        )
    return conv, ssm


def slots(indices: torch.Tensor) -> list[int]:
    """The state slot of each sequence: one per sequence (vLLM's prefix caching of recurrent
    states keeps a slot per block, which bik does not read)."""
    if indices.dim() != 1:
        raise NotImplementedError(
            "bik.vllm: prefix caching of recurrent states (a state slot per block); pass "
            "enable_prefix_caching=False"
        )
    return indices.tolist()


def convolve(
    layer: Any, mixed: torch.Tensor, conv_state: torch.Tensor, resume: bool
) -> torch.Tensor:
    """The layer's causal convolution over one sequence's new inputs ``mixed [L, C]`` after its
    cached ones (exact zeros for a new sequence, ``resume`` False), as the trainer convolves
    the whole sequence from zeros (bik.layers.delta_rule.causal_conv1d); the cached window
    advanced in place. Returns ``[L, C]`` in mixed's dtype, before the activation."""
    if not resume:
        conv_state.zero_()
    length = mixed.shape[0]
    window = torch.cat([conv_state, mixed.t().to(conv_state.dtype)], dim=-1)  # [C, W-1+L]
    conv_state.copy_(window[:, window.shape[-1] - conv_state.shape[-1] :])
    weight, bias = layer.conv1d.weight, layer.conv1d.bias
    convolved = causal_conv1d(window[None], weight.reshape(weight.shape[0], -1), bias)
    return convolved[0, :, -length:].t().to(mixed.dtype)
