"""The forwards patch_model installs on the hybrid linear-attention families (Qwen3-Next,
Qwen3.5): the Gated DeltaNet layer, its gated RMSNorm, and the gated full attention.

Each follows transformers' forward step by step, with every computation that is not a
reshape or a cache call replaced by its bik counterpart: the projections are the layer's own
(patched) Linear modules, the short convolution and the recurrence are
bik.layers.delta_rule's fixed orders, ``g`` and ``beta`` go through bik.softplus and
bik.sigmoid, the gate of the attention output through bik.sigmoid. The cache calls are
transformers' own, so a patched model generates with the cache it builds.
"""

import sys
from typing import Any

import torch

from ..layers.delta_rule import causal_conv1d, gated_delta_rule
from ..ops.activations import sigmoid, silu, softplus
from ..ops.rms_norm import rms_norm_like_transformers
from .autocast import autocast_inputs, run


def _modeling(module: torch.nn.Module) -> Any:
    """The transformers modeling module ``module``'s class comes from."""
    return sys.modules[type(module).__module__]


class GatedRMSNorm:
    """``rms_norm(x) * silu(gate)`` (transformers' ``RMSNormGated``): the norm as the
    family's RMSNorm (bik.rms_norm, rounded to x's dtype), then bik.silu of the fp32 gate,
    the product in fp32, rounded once."""

    def __init__(self, module: torch.nn.Module, backend: str):
        self.module, self.backend = module, backend

    def __call__(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        m: Any = self.module
        autocast_on, _ = autocast_inputs(x.device.type)
        normed = run(
            self.backend, autocast_on, rms_norm_like_transformers, x, m.weight, m.variance_epsilon
        )
        return (normed.float() * silu(gate.float())).to(x.dtype)


class GatedDeltaNet:
    """A Gated DeltaNet layer's forward (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``:
    they differ in how the projections are laid out, nothing else)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def _projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed q/k/v channels-last ``[B, T, C]``, z ``[B, T, Hv, V]``, b, a ``[B, T, Hv]``)."""
        m: Any = self.module
        batch, length = hidden_states.shape[:2]
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: two fused projections, interleaved heads
            parts = m.fix_query_key_value_ordering(
                m.in_proj_qkvz(hidden_states), m.in_proj_ba(hidden_states)
            )
            query, key, value, z, b, a = parts
            flat = (t.reshape(batch, length, -1) for t in (query, key, value))
            return torch.cat(tuple(flat), dim=-1), z, b, a
        z = m.in_proj_z(hidden_states).reshape(batch, length, -1, m.head_v_dim)
        return (
            m.in_proj_qkv(hidden_states),
            z,
            m.in_proj_b(hidden_states),
            m.in_proj_a(hidden_states),
        )

    def _convolve(self, mixed: torch.Tensor, cache: Any) -> torch.Tensor:
        """The short causal convolution and its activation over ``mixed [B, C, T]``: from the
        cached inputs when a cache has them (transformers' cache calls), else from zeros."""
        m: Any = self.module
        length = mixed.shape[-1]
        window = mixed
        if cache is not None:
            layer = cache.layers[m.layer_idx]
            decoding = cache.has_previous_state(m.layer_idx) and length == 1
            if decoding and not layer.record_past:  # the state holds the last inputs
                state = layer.conv_states[0]
                window = torch.cat([state, mixed.to(state.dtype)], dim=-1)
                state.copy_(window[:, :, -state.shape[-1] :])
            else:
                window = cache.update_conv_state(
                    mixed, m.layer_idx, conv_kernel_size=m.conv_kernel_size
                )
        out = causal_conv1d(window, m.conv1d.weight.squeeze(1))[:, :, -length:]
        if m.conv1d.bias is not None:
            raise NotImplementedError("bik: a Gated DeltaNet convolution with a bias")
        return silu(out).to(mixed.dtype)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        cache_params: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        m: Any = self.module
        if kwargs.get("cu_seq_lens_q") is not None:
            raise NotImplementedError("bik: packed sequences (cu_seq_lens_q) in a Gated DeltaNet")
        hidden_states = _modeling(m).apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, length = hidden_states.shape[:2]
        previous = cache_params is not None and cache_params.has_previous_state(m.layer_idx)
        mixed, z, b, a = self._projections(hidden_states)
        mixed = self._convolve(mixed.transpose(1, 2), cache_params).transpose(1, 2)
        query, key, value = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        query = query.reshape(batch, length, -1, m.head_k_dim)
        key = key.reshape(batch, length, -1, m.head_k_dim)
        value = value.reshape(batch, length, -1, m.head_v_dim)
        beta = sigmoid(b)
        g = -m.A_log.float().exp() * softplus(a.float() + m.dt_bias)
        heads_per_key = m.num_v_heads // m.num_k_heads
        if heads_per_key > 1:
            query = query.repeat_interleave(heads_per_key, dim=2)
            key = key.repeat_interleave(heads_per_key, dim=2)
        state = cache_params.layers[m.layer_idx].recurrent_states[0] if previous else None
        out, state = gated_delta_rule(query, key, value, g, beta, state, use_qk_l2norm=True)
        if cache_params is not None:
            cache_params.update_recurrent_state(state, m.layer_idx)
        out = m.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
        return m.out_proj(out.reshape(batch, length, -1))


class GatedAttention:
    """The full-attention layer of Qwen3-Next / Qwen3.5: transformers' forward (the query
    projection holds the query and a per-head gate; q/k RMSNorm; RoPE; attention through the
    registered implementation, bik's once patched), with the output's gate through
    bik.sigmoid (torch's fp32 sigmoid depends on the tensor's layout on a CPU)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m: Any = self.module
        modeling = _modeling(m)
        shape = hidden_states.shape[:-1]
        heads = (*shape, -1, m.head_dim)
        projected = m.q_proj(hidden_states).view(*shape, -1, m.head_dim * 2)
        query, gate = torch.chunk(projected, 2, dim=-1)
        query = m.q_norm(query.reshape(heads)).transpose(1, 2)
        key = m.k_norm(m.k_proj(hidden_states).view(heads)).transpose(1, 2)
        value = m.v_proj(hidden_states).view(heads).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, m.layer_idx)
        attend = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            m.config._attn_implementation, modeling.eager_attention_forward
        )
        out, weights = attend(
            m,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not m.training else m.attention_dropout,
            scaling=m.scaling,
            **kwargs,
        )
        out = out.reshape(*shape, -1).contiguous() * sigmoid(gate.reshape(*shape, -1))
        return m.o_proj(out), weights
