"""vLLM's mixture-of-experts layer routed to bik: the router, the experts and the shared
expert compute what the bik-patched Hugging Face model computes (bik.hf.moe), bit for bit.

vLLM builds every MoE layer as a ``MoERunner`` (router, ``RoutedExperts`` holding the
``w13_weight [E, 2I, H]`` (gate rows, then up rows) and ``w2_weight [E, H, I]`` parameters,
and perhaps a shared expert). bik replaces the runner's forward: the router logits through
``bik.linear``, bik's routing (bik.layers.moe.route: softmax, top-k with ties to the lower
expert, renormalised in rank order), the experts through bik.layers.moe.expert_mlp on the
weights as loaded (vLLM's CPU method would prepack them for its grouped GEMM; bik keeps them,
so a weight update written into the parameters is what the next step uses), and a shared
expert's gate through ``bik.sigmoid``. What the runner supports beyond that (other routers,
biased or quantised experts, expert or data parallelism, tensor parallelism) is refused when
the engine starts (:func:`problems`), never run in vLLM's order.
"""

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from ..families import FAMILIES
from ..layers.moe import expert_mlp, route
from ..ops.activations import sigmoid
from ..ops.matmul import linear


@dataclass(frozen=True)
class Routing:
    """What bik's forward needs of a runner's router, read once when the engine starts."""

    top_k: int
    normalize: bool
    fp32_weights: bool  # the family's router hands the experts fp32 weights (Mixtral)


def _gate_forward(
    self: GateLinear, x: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, torch.nn.Parameter | None]:
    """GateLinear.forward through bik.linear: vLLM's specialised router GEMMs (fp32 out,
    bf16x3, cuBLAS tiers) would reduce in their own order."""
    output = linear(x, self.weight, None if self.skip_bias_add else self.bias)
    if not self.return_bias:
        return output
    return output, self.bias if self.skip_bias_add else None


def _runner_forward(
    self: MoERunner,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    shared_experts_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoERunner.forward as bik.hf.moe's MoeBlock computes it (``router_logits`` is the
    model's gate output, or the hidden states when the runner holds the gate)."""
    routing: Routing = self._bik_routing  # set by problems()
    x = hidden_states
    if self.gate is not None:
        router_logits, _ = self.gate(x)
    weights, chosen = route(router_logits, routing.top_k, routing.normalize)
    if not routing.fp32_weights:  # as transformers casts them for these families
        weights = weights.to(router_logits.dtype)
    experts: Any = self.routed_experts
    out = expert_mlp(x, chosen, weights, experts.w13_weight, experts.w2_weight)
    if self._shared_experts is None:
        return out
    shared: Any = self._shared_experts._layer  # gate_up_proj, act_fn, down_proj, expert_gate
    mlp, _ = shared.down_proj(shared.act_fn(shared.gate_up_proj(x)[0]))
    if shared.expert_gate is not None:
        mlp = sigmoid(shared.expert_gate(x)[0]) * mlp
    return out + mlp


def _keep_weights(self: Any, layer: Any) -> None:
    """bik reads ``w13_weight`` / ``w2_weight`` as loaded: nothing to prepack."""


PATCHED_METHODS = (
    (GateLinear, "forward", _gate_forward),
    (MoERunner, "forward", _runner_forward),
    (UnquantizedFusedMoEMethod, "process_weights_after_loading", _keep_weights),
)


def _plain_softmax_top_k(router: Any) -> bool:
    """Whether ``router`` (the GPU platforms' FusedTopKRouter or the CPU platform's
    CPURouter) routes by a plain softmax top-k."""
    return (
        isinstance(router, (FusedTopKRouter, CPURouter))
        and router.scoring_func == "softmax"
        and not getattr(router, "use_grouped_topk", False)
        and getattr(router, "custom_routing_function", None) is None
        and getattr(router, "e_score_correction_bias", None) is None
        and getattr(router, "_hash_indices_table", None) is None
    )


def problems(name: str, runner: MoERunner, model_type: str) -> list[str]:
    """What bik cannot compute in ``runner`` (a MoE layer of a ``model_type`` model) in the
    bik-patched trainer's order; with none, the runner is marked for bik's forward."""
    config: Any = runner.moe_config
    router: Any = runner.router
    experts: Any = runner.routed_experts
    family = FAMILIES.get(model_type)
    found = []
    if family is None or not family.moe:
        found.append(f"a {model_type!r} mixture-of-experts layer: no bik family routes it")
    if not _plain_softmax_top_k(router):
        found.append(
            f"its router ({type(router).__name__}, scoring {getattr(router, 'scoring_func', '?')!r}"
            "): bik.vllm runs softmax top-k routers (no groups, bias or custom function)"
        )
    if not isinstance(experts.quant_method, UnquantizedFusedMoEMethod):
        found.append(f"quantized experts ({type(experts.quant_method).__name__})")
    if config.has_bias or config.activation.name != "SILU":
        found.append("experts with biases or an activation other than SiLU-and-multiply")
    parallel = config.moe_parallel_config
    if parallel.tp_size * parallel.dp_size * parallel.ep_size * parallel.pcp_size != 1:
        found.append(
            "tensor, data or expert parallelism of the experts (bik.vllm runs mixture-of-"
            "experts models at tensor_parallel_size=1)"
        )
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        found.append("latent (transformed) expert inputs or outputs")
    if runner.routed_scaling_factor != 1.0 or getattr(router, "routed_scaling_factor", 1.0) != 1:
        found.append("a routed scaling factor")
    if found:
        return [f"{name} ({type(runner).__name__}): {problem}" for problem in found]
    runner._bik_routing = Routing(
        top_k=router.top_k,
        normalize=router.renormalize,
        fp32_weights=family is not None and family.fp32_router_weights,
    )
    return []
