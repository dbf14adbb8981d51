"""The forwards patch_model installs on the hybrid families (bik.families.Family.recurrent):
Qwen3-Next and Qwen3.5 (the Gated DeltaNet layer, its gated RMSNorm, the gated full
attention), Kimi Linear (Kimi Delta Attention, its gated RMSNorm) and Nemotron-H (the Mamba2
mixer).

Each follows transformers' forward step by step, with every computation that is not a
reshape or a cache call replaced by its bik counterpart: the projections are the layer's own
(patched) Linear modules, the short convolution and the recurrences are bik.layers'
fixed orders (delta_rule, mamba2), the decays and gates go through bik.softplus, bik.sigmoid
and bik.silu. The cache calls are transformers' own, so a patched model generates with the
cache it builds.
"""

import sys
from typing import Any

import torch

from ..layers.delta_rule import causal_conv1d, gated_delta_rule
from ..layers.mamba2 import selective_scan
from ..ops.activations import sigmoid, silu, softplus
from ..ops.rms_norm import gated_rms_norm, rms_norm
from .autocast import autocast_inputs, run
from .cache_keyword import pop_cache


def _modeling(module: torch.nn.Module) -> Any:
    """The transformers modeling module ``module``'s class comes from."""
    return sys.modules[type(module).__module__]


def convolve(module: Any, mixed: torch.Tensor, cache: Any) -> torch.Tensor:
    """The layer's short causal convolution over ``mixed [B, C, T]`` (bik.layers.delta_rule's
    order): from the cached inputs when a cache has them, through transformers' own cache
    calls (a decode step updates the cached window in place, as transformers' decode kernel
    does), else from zeros."""
    length = mixed.shape[-1]
    window = mixed
    if cache is not None:
        layer = cache.layers[module.layer_idx]
        decoding = cache.has_previous_state(module.layer_idx) and length == 1
        if decoding and not layer.record_past:  # the state holds the last inputs
            state = layer.conv_states[0]
            window = torch.cat([state, mixed.to(state.dtype)], dim=-1)
            state.copy_(window[:, :, -state.shape[-1] :])
        else:
            window = cache.update_conv_state(
                mixed, module.layer_idx, conv_kernel_size=module.conv_kernel_size
            )
    conv = module.conv1d
    return causal_conv1d(window, conv.weight.squeeze(1), conv.bias)[:, :, -length:].to(mixed.dtype)


class GatedRMSNorm:
    """transformers' ``RMSNormGated`` in its two forms: Qwen's ``rms_norm(x) * silu(gate)``
    (the norm as the family's RMSNorm, rounded to x's dtype, then the product in fp32) and
    Kimi's ``rms_norm(x) * sigmoid(gate)`` (the norm and its weight in fp32); the gate through
    bik.silu / bik.sigmoid, one rounding at the end."""

    def __init__(self, module: torch.nn.Module, backend: str):
        self.module, self.backend = module, backend
        activation = getattr(module, "activation", "silu")
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"bik: a gated RMSNorm with activation {activation!r}")
        self.activation = activation

    def __call__(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        m: Any = self.module
        autocast_on, _ = autocast_inputs(x.device.type)
        eps = m.variance_epsilon
        return run(
            self.backend, autocast_on, gated_rms_norm, x, gate, m.weight, eps, self.activation
        )


class RecurrentLayer:
    """A recurrent layer's forward, as transformers calls it: padded positions zeroed, then
    :meth:`forward`. Eager even inside torch.compile (one graph break per layer): inductor's
    ``exp`` and fused multiply-adds would change the recurrence's bits against an eager
    trainer."""

    def __init__(self, module: torch.nn.Module, backend: str = "auto"):
        self.module, self.backend = module, backend

    @torch.compiler.disable
    def __call__(
        self,
        hidden_states: torch.Tensor,
        cache_params: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("cu_seq_lens_q") is not None:
            raise NotImplementedError(
                f"bik: packed sequences (cu_seq_lens_q) in a {type(self.module).__name__}"
            )
        hidden_states = self.mask_padding(hidden_states, attention_mask)
        return self.forward(hidden_states, pop_cache(kwargs, cache_params), attention_mask)

    def mask_padding(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return _modeling(self.module).apply_mask_to_padding_states(x, attention_mask)

    def forward(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def cached_state(self, cache: Any) -> torch.Tensor | None:
        """The recurrent state the cache holds for this layer, or None (a first call)."""
        index = self.module.layer_idx
        if cache is None or not cache.has_previous_state(index):
            return None
        return cache.layers[index].recurrent_states[0]

    def store_state(self, cache: Any, state: torch.Tensor) -> None:
        if cache is not None:
            cache.update_recurrent_state(state, self.module.layer_idx)


class GatedDeltaNet(RecurrentLayer):
    """A Gated DeltaNet layer (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``: they
    differ in how the projections are laid out, nothing else)."""

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

    def forward(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        m: Any = self.module
        batch, length = hidden_states.shape[:2]
        state = self.cached_state(cache)
        mixed, z, b, a = self._projections(hidden_states)
        mixed = silu(convolve(m, mixed.transpose(1, 2), cache)).transpose(1, 2)
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
        out, state = gated_delta_rule(query, key, value, g, beta, state, use_qk_l2norm=True)
        self.store_state(cache, state)
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
        cache = pop_cache(kwargs, past_key_values)
        if cache is not None:
            key, value = cache.update(key, value, m.layer_idx)
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


class Mamba2Mixer(RecurrentLayer):
    """A Mamba2 mixer (``NemotronHMamba2Mixer``): transformers' steps with the convolution, its
    SiLU, the step's softplus and the scan in bik's orders, and the gated group RMSNorm
    (``x * silu(z)``, then an RMSNorm per group of channels, the weight in fp32) through
    bik.rms_norm and bik.silu."""

    def forward(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        m: Any = self.module
        if m.activation != "silu":
            raise NotImplementedError(f"bik: a Mamba2 mixer with activation {m.activation!r}")
        batch, length, _ = hidden_states.shape
        state = self.cached_state(cache)
        projected = m.in_proj(hidden_states)
        gate, mixed, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        # padding's projections are in_proj's bias (use_bias): zeroed before the convolution,
        # which would carry them into the row's first tokens, and after it
        mixed = self.mask_padding(mixed, attention_mask)
        mixed = silu(convolve(m, mixed.transpose(1, 2), cache)).transpose(1, 2)
        mixed = self.mask_padding(mixed, attention_mask)
        state_width = m.n_groups * m.ssm_state_size
        x, b, c = torch.split(mixed, [m.intermediate_size, state_width, state_width], dim=-1)
        low, high = m.time_step_limit
        step = softplus(dt.float() + m.dt_bias.float()).clamp(min=low, max=high)
        y, state = selective_scan(
            x.reshape(batch, length, m.num_heads, m.head_dim),
            step,
            -torch.exp(m.A_log.float()),
            b.reshape(batch, length, m.n_groups, m.ssm_state_size),
            c.reshape(batch, length, m.n_groups, m.ssm_state_size),
            m.D,
            state,
        )
        self.store_state(cache, state)
        y = self._gated_group_norm(y.reshape(batch, length, -1), gate)
        return m.out_proj(y.to(hidden_states.dtype))

    def _gated_group_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``weight * rms_norm_per_group(y * silu(gate))`` in fp32 (transformers'
        ``Zamba2RMSNormGated`` on the scan's fp32 output)."""
        norm: Any = self.module.norm
        gated = y * silu(gate.float())
        groups = gated.reshape(-1, norm.group_size)
        ones = torch.ones(norm.group_size, dtype=torch.float32, device=y.device)
        autocast_on, _ = autocast_inputs(y.device.type)
        normed = run(self.backend, autocast_on, rms_norm, groups, ones, norm.variance_epsilon)
        return norm.weight.float() * normed.reshape(y.shape)


class KimiDeltaAttention(RecurrentLayer):
    """Kimi Delta Attention (``KimiLinearDeltaAttention``): the Gated DeltaNet's steps with a
    decay per key channel: q, k, v through their own projections and the convolution, the
    forget gate's two projections then ``-exp(A_log) * softplus(. + dt_bias)`` through
    bik.softplus, beta through bik.sigmoid, the output through the gated (sigmoid) RMSNorm."""

    def forward(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        m: Any = self.module
        batch, length = hidden_states.shape[:2]
        heads = (batch, length, -1, m.head_dim)
        state = self.cached_state(cache)
        projections = (m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states))
        mixed = torch.cat(projections, dim=-1).transpose(1, 2)
        mixed = silu(convolve(m, mixed, cache)).transpose(1, 2)
        query, key, value = (t.reshape(heads) for t in torch.split(mixed, [m.qkv_dim] * 3, -1))
        forget = m.forget_gate
        raw = forget.f_b_proj(forget.f_a_proj(hidden_states)).float() + forget.dt_bias.float()
        g = -torch.exp(forget.A_log.float()) * softplus(raw.reshape(heads))
        beta = sigmoid(m.b_proj(hidden_states))
        out, state = gated_delta_rule(query, key, value, g, beta, state, use_qk_l2norm=True)
        self.store_state(cache, state)
        gate = m.g_b_proj(m.g_a_proj(hidden_states)).reshape(heads)
        return m.o_proj(m.o_norm(out, gate).reshape(batch, length, -1))
