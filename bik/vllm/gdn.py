"""vLLM's Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) routed to bik: the short
causal convolution and the gated delta rule in bik.layers.delta_rule's fixed orders, the
state kept in vLLM's pooled state cache, so a prompt, a chunked prefill, a prefix-cache hit
and a decode step reach the bits of the bik-patched trainer (bik.hf.linear_attention).

vLLM's CPU layer calls one op (``cpu_gdn_attention_core``), a chunked prefill and a separate
recurrent decode kernel: two orders, neither the trainer's. bik replaces the layer's
``forward_cpu`` (the projections stay vLLM's linears, bik's here, and its output stays the
layer's gated RMSNorm, bik's, and output projection). Each sequence of a step, in vLLM's
order (decodes first, then prefills), runs on its own:

* the convolution over the sequence's cached inputs (its last ``W - 1`` inputs, in the
  model's dtype; exact zeros for a new sequence) followed by its new ones, as the trainer
  convolves the whole sequence from zeros, and the cached window is advanced in place;
* the recurrence from the sequence's fp32 state slot (zeros for a new sequence), one token
  after another, the final state written back. bik needs that slot in fp32 (the trainer's
  precision): ``bik.vllm.LLM`` asks vLLM for ``mamba_ssm_cache_dtype="float32"``, and a
  narrower pool is refused at the first step.

The order counts tokens one by one from the sequence's first, so where a step cuts the
sequence (chunked prefill, a prefix-cache hit resuming from a cached state) does not change
a bit.
"""

from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    ChunkGatedDeltaRule,
    QwenGatedDeltaNetAttention,
)

from ..layers.delta_rule import gated_delta_rule
from ..ops.activations import sigmoid, silu, softplus
from .recurrent import convolve, slots, state_pools


def _forward_cpu(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """QwenGatedDeltaNetAttention.forward_cpu with bik's convolution and recurrence."""
    mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
    ba, _ = self.in_proj_ba(hidden_states)
    if self.gqa_interleaved_layout:  # Qwen3-Next: unpack the interleaved GQA layout
        query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
        flat = (t.reshape(t.shape[0], -1) for t in (query, key, value))
        mixed_qkv = torch.cat(tuple(flat), dim=-1)
    else:  # Qwen3.5: [q, k, v, z] and [b, a]
        mixed_qkv, z = mixed_qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        z = z.reshape(z.shape[0], -1, self.head_v_dim)
        b, a = ba.chunk(2, dim=-1)
    out = torch.zeros(
        (hidden_states.shape[0], self.num_v_heads, self.head_v_dim),
        dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    metadata = get_forward_context().attn_metadata
    if metadata is not None:  # None: vLLM's warm-up run
        _core(self, metadata[self.prefix], mixed_qkv, b, a, out)
    return self._output_projection(out, z)


def _core(
    layer: Any,
    metadata: Any,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Each sequence of the step through the convolution and the rule, written into ``out``."""
    if metadata.spec_sequence_masks is not None:
        raise NotImplementedError("bik.vllm: speculative decoding in a Gated DeltaNet layer")
    conv_states, ssm_states = state_pools(layer, "Gated DeltaNet")
    slots_, heads = ssm_states.shape[:2]
    ssm_states = ssm_states.view(slots_, heads, layer.head_k_dim, layer.head_v_dim)
    starts = metadata.non_spec_query_start_loc.tolist()
    indices = slots(metadata.non_spec_state_indices_tensor)
    decodes, prefills = metadata.num_decodes, metadata.num_prefills
    resumes = [True] * decodes  # a decoding sequence has its state
    if prefills:
        resumes += metadata.has_initial_state[decodes : decodes + prefills].tolist()
    for i, resume in enumerate(resumes):
        lo, hi = starts[i], starts[i + 1]
        mixed = silu(convolve(layer, mixed_qkv[lo:hi], conv_states[indices[i]], resume))
        out[lo:hi] = _rule(layer, mixed, b[lo:hi], a[lo:hi], ssm_states[indices[i]], resume)


def _rule(
    layer: Any,
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    ssm_state: torch.Tensor,
    resume: bool,
) -> torch.Tensor:
    """One sequence's convolved tokens ``mixed [L, C]`` through the gated delta rule from its
    state (zeros for a new sequence), as bik.hf.linear_attention.GatedDeltaNet computes them
    -> ``[L, Hv, V]``; the state advanced in place."""
    if not resume:
        ssm_state.zero_()
    length = mixed.shape[0]
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(1, length, -1, layer.head_k_dim)
    key = key.reshape(1, length, -1, layer.head_k_dim)
    value = value.reshape(1, length, -1, layer.head_v_dim)
    beta = sigmoid(b)[None]
    # A_log in the model's dtype, as transformers keeps it (vLLM keeps an fp32 copy)
    a_log = layer.A_log.to(mixed.dtype).float()
    g = (-a_log.exp() * softplus(a.float() + layer.dt_bias))[None]
    heads_per_key = layer.num_v_heads // layer.num_k_heads
    if heads_per_key > 1:
        query = query.repeat_interleave(heads_per_key, dim=2)
        key = key.repeat_interleave(heads_per_key, dim=2)
    out, state = gated_delta_rule(query, key, value, g, beta, ssm_state[None], use_qk_l2norm=True)
    ssm_state.copy_(state[0])
    return out[0]


PATCHED_METHODS = ((QwenGatedDeltaNetAttention, "forward_cpu", _forward_cpu),)
UNCALLED = (ChunkGatedDeltaRule,)  # the layer's GPU prefill op, which bik's forward never calls


def problem(name: str, layer: QwenGatedDeltaNetAttention) -> str | None:
    """Why ``layer`` would not run bik's forward: vLLM picks a platform's forward when it
    builds the layer, and bik replaces the CPU one only."""
    forward = getattr(layer._forward_method, "__func__", None)
    if forward is _forward_cpu:
        return None
    return f"{name} (Gated DeltaNet): vLLM's forward for this platform (bik replaces the CPU one)"
