"""The forwards patch_model installs on a mixture-of-experts family's router, experts and
sparse MoE block (bik.families.MOE_FAMILIES)."""

import functools
from typing import Any, cast

import torch

from ..distributed.experts import expert_group, expert_parallel_mlp
from ..distributed.sharded import local_weight
from ..families import Family
from ..layers.moe import clamped_swiglu, expert_mlp, route, route_grouped_sigmoid
from ..ops.activations import sigmoid, silu_and_mul
from ..ops.matmul import linear
from .autocast import autocast_inputs, run


class Router:
    """A top-k router's forward: logits through bik.linear (with the router's bias, gpt-oss),
    then bik.layers.moe.route (softmax, top-k with ties to the lower expert index,
    renormalisation in rank order). gpt-oss takes the softmax of the top-k logits instead:
    the same weights in exact arithmetic, renormalised ones here."""

    def __init__(self, module: torch.nn.Module, backend: str, family: Family):
        self.module, self.backend = module, backend
        self.normalize = getattr(module, "norm_topk_prob", True)  # Mixtral always normalises
        # transformers casts the weights to the logits' dtype except where the family keeps
        # them in fp32; patched and unpatched models weigh experts alike.
        self.fp32_weights = family.fp32_router_weights

    def __call__(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m: Any = self.module  # a family's router: its weight, top_k and perhaps a bias
        x = hidden_states.reshape(-1, m.weight.shape[1])
        bias = getattr(m, "bias", None)
        autocast_on, (x, weight) = autocast_inputs(x.device.type, x, m.weight)
        if bias is not None and autocast_on:
            bias = bias.to(weight.dtype)
        logits = run(self.backend, autocast_on, linear, x, weight, bias)
        weights, experts = run(self.backend, autocast_on, route, logits, m.top_k, self.normalize)
        return logits, weights if self.fp32_weights else weights.to(logits.dtype), experts


class GroupedSigmoidRouter:
    """A sigmoid router with a score-correction bias and group-limited top-k (DeepSeek-V3,
    GLM-4.5): fp32 logits through bik.linear, as transformers computes them in fp32, then
    bik.layers.moe.route_grouped_sigmoid."""

    def __init__(self, module: torch.nn.Module, backend: str):
        self.module, self.backend = module, backend

    def __call__(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m: Any = self.module  # the router: weight, bias buffer, top_k and the group settings
        x = hidden_states.reshape(-1, m.weight.shape[1]).float()
        autocast_on, (x, weight) = autocast_inputs(x.device.type, x, m.weight.float())
        logits = run(self.backend, autocast_on, linear, x, weight)
        weights, experts = route_grouped_sigmoid(
            logits,
            m.e_score_correction_bias,
            m.top_k,
            m.num_group,
            m.topk_group,
            m.norm_topk_prob,
            m.routed_scaling_factor,
        )
        return logits, weights, experts


class Experts:
    """An experts module's forward (3-D gate_up_proj / down_proj weights): bik.layers.moe's
    expert_mlp, whose rows do not depend on which other tokens chose the same expert;
    ``down_chunks``: the down projection in the TP-invariant order of that many chunks. A
    module sharded by bik.distributed.expert_parallel computes its rank's experts
    (bik.distributed.experts.expert_parallel_mlp: the same bits)."""

    shardable_experts = True  # how bik.distributed.expert_parallel finds it (no import of bik.hf)

    def __init__(self, module: torch.nn.Module, backend: str, down_chunks: int | None = None):
        self.module, self.backend, self.down_chunks = module, backend, down_chunks

    @staticmethod
    def intermediate_size(module: torch.nn.Module) -> int:
        """K of the module's down projection (``down_proj [E, H, I]``)."""
        return cast(torch.Tensor, module.down_proj).shape[2]

    def weights(self) -> tuple[Any, ...]:
        """(gate_up [E, 2I, H], down [E, H, I] in nn.Linear layout, their biases or None,
        the activation), the weights as this rank holds them."""
        gate_up, down = (
            local_weight(self.module, "gate_up_proj"),
            local_weight(self.module, "down_proj"),
        )
        return gate_up, down, None, None, silu_and_mul

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down, gate_up_bias, down_bias, activation = self.weights()
        autocast_on, (x, gate_up, down) = autocast_inputs(
            hidden_states.device.type, hidden_states, gate_up, down
        )
        group = expert_group(self.module)
        if group is None:
            fn: Any = functools.partial(expert_mlp, down_chunks=self.down_chunks)
        else:
            fn = functools.partial(expert_parallel_mlp, down_chunks=self.down_chunks, group=group)
        out = run(
            self.backend,
            autocast_on,
            fn,
            x,
            top_k_index,
            top_k_weights,
            gate_up,
            down,
            gate_up_bias,
            down_bias,
            activation,
        )
        return out.to(hidden_states.dtype)


class ClampedSwigluExperts(Experts):
    """gpt-oss's experts' forward: weights stored transposed (``gate_up_proj [E, H, 2I]``,
    gate and up interleaved; ``down_proj [E, I, H]``), each projection with a bias, the
    clamped SwiGLU between them: bik.layers.moe's expert_mlp with clamped_swiglu."""

    @staticmethod
    def intermediate_size(module: torch.nn.Module) -> int:
        """K of the module's down projection (``down_proj [E, I, H]``)."""
        return cast(torch.Tensor, module.down_proj).shape[1]

    def weights(self) -> tuple[Any, ...]:
        m: Any = self.module  # gpt-oss's experts: the transposed weights, biases, alpha, limit
        gate_up, down = local_weight(m, "gate_up_proj"), local_weight(m, "down_proj")
        assert gate_up is not None and down is not None  # classify found both
        biases = (local_weight(m, "gate_up_proj_bias"), local_weight(m, "down_proj_bias"))
        activation = functools.partial(clamped_swiglu, alpha=m.alpha, limit=m.limit)
        # nn.Linear layout: views
        return gate_up.transpose(1, 2), down.transpose(1, 2), *biases, activation


class MoeBlock:
    """A sparse MoE block's forward: router, experts and (Qwen2-MoE) the shared expert, whose
    gate goes through bik.sigmoid (torch's fp32 sigmoid depends on the tensor's layout)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        m: Any = self.module  # a family's sparse MoE block: gate, experts, shared expert
        if m.training and getattr(m, "jitter_noise", 0):
            raise NotImplementedError(
                f"bik: {type(m).__name__} multiplies its input by random router jitter "
                f"(router_jitter_noise={m.jitter_noise}) in training mode, which makes a "
                "token's routing depend on a random draw; call model.eval() or set "
                "config.router_jitter_noise = 0.0"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weights, experts = m.gate(x)
        out = m.experts(x, experts, weights)
        shared = getattr(m, "shared_expert", None)
        if shared is not None:
            out = out + sigmoid(m.shared_expert_gate(x)) * shared(x)
        return out.reshape(hidden_states.shape)
