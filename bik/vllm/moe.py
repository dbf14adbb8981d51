"""vLLM's mixture-of-experts layer routed to bik: the router, the experts and the shared
expert compute what the bik-patched Hugging Face model computes (bik.hf.moe), bit for bit.

vLLM builds every MoE layer as a ``MoERunner`` (router, ``RoutedExperts`` holding the
``w13_weight [E, 2I, H]`` (gate rows, then up rows) and ``w2_weight [E, H, I]`` parameters,
and perhaps a shared expert). bik replaces the runner's forward and the gate's: the router
logits through ``bik.linear``; bik's routing (bik.layers.moe.route: softmax, top-k with ties
to the lower expert, renormalised in rank order; or route_grouped_sigmoid, the sigmoid
group-limited top-k with a score-correction bias of DeepSeek-V3 and GLM-4.5); the experts
through bik.layers.moe.expert_mlp on the weights as loaded (vLLM's CPU method would prepack
them for its grouped GEMM; bik keeps them, so a weight update written into the parameters is
what the next step uses); a shared expert's gate through ``bik.sigmoid``. What the runner
supports beyond that (other routers, quantised experts, data parallelism, expert load
balancing) is refused when the engine starts (:func:`problems`), never run in vLLM's order.

Under tensor parallelism (``tp_invariant``), every rank holds the intermediate slice r of each
expert; the router runs whole on every rank (the same bits), each rank computes its slice's
down-projection partial in bik's TP-invariant order (bik.layers.moe.expert_down_partial), and
the partials are gathered and tree-summed in rank order, so each rank has the whole output and
vLLM's final all-reduce is not called; a shared expert's down projection is summed the same
way. Under expert parallelism (``enable_expert_parallel``) each rank computes its whole
experts' pairs in all the chunks and the ranks' rows are combined exactly
(:func:`_expert_parallel`). With ``tp_invariant`` on, TP 1 runs the same chunks: every
degree and layout gives the bits of ``bik.patch_model(model, tp_invariant=True)``.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from ..contract import TP_CHUNKS
from ..distributed import combine_partials
from ..families import FAMILIES
from ..layers.moe import (
    clamped_swiglu,
    expert_down_partial,
    expert_hidden,
    route,
    route_grouped_sigmoid,
    weigh_expert_outputs,
)
from ..ops.activations import sigmoid, silu_and_mul
from ..ops.grouped_linear import grouped_linear
from ..ops.matmul import linear
from . import routing as routing_record
from .ranks import gather_ep_ranks, gather_tp_ranks, row_parallel_in_order

Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits -> weights, experts
# gpt-oss's SwiGLU slope: a constant of transformers' GptOssExperts (``alpha``), not a config key
GPT_OSS_ALPHA = 1.702


def _softmax_top_k(
    logits: torch.Tensor, top_k: int, normalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """bik.hf.moe.Router's routing: the weights cast to the logits' dtype unless the family's
    router hands the experts fp32 ones (Mixtral), as transformers does."""
    weights, chosen = route(logits, top_k, normalize)
    return (weights if fp32_weights else weights.to(logits.dtype)), chosen


def _gate_forward(
    self: GateLinear, x: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, torch.nn.Parameter | None]:
    """GateLinear.forward through bik.linear, in the weight's dtype (an fp32 router, as
    DeepSeek-V3 and GLM-4.5 keep theirs, takes the activations in fp32, as transformers does):
    vLLM's specialised router GEMMs (fp32 out, bf16x3, cuBLAS tiers) reduce in their own
    order."""
    output = linear(x.to(self.weight.dtype), self.weight, None if self.skip_bias_add else self.bias)
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
    if self.gate is not None and self._bik_fp32_logits:
        # transformers' sigmoid routers take fp32 logits of fp32 activations and weights
        router_logits = linear(x.float(), self.gate.weight.float())
    elif self.gate is not None:
        router_logits, _ = self.gate(x)
    weights, chosen = routing(router_logits)
    capture = getattr(self.router, "capture_fn", None)
    if capture is not None:  # vLLM's enable_return_routed_experts: bik's choices, as computed
        capture(chosen)
    routing_record.capture(chosen)
    out = _routed_experts(self, x, chosen, weights)
    if self._shared_experts is None:
        return out
    # a gated MLP (gate_up_proj, act_fn, down_proj); Qwen2-MoE's has an expert_gate, whose
    # sigmoid its forward takes with torch: bik's is computed here instead
    shared: Any = self._shared_experts._layer
    hidden = shared.act_fn(shared.gate_up_proj(x)[0])
    if self._bik_down_chunks is None:
        mlp, _ = shared.down_proj(hidden)
    else:  # summed over the ranks here, as vLLM's final all-reduce would
        mlp = row_parallel_in_order(shared.down_proj, hidden)
    if getattr(shared, "expert_gate", None) is not None:
        mlp = sigmoid(shared.expert_gate(x)[0]) * mlp
    return out + mlp


def _routed_experts(
    self: MoERunner, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """bik.layers.moe.expert_mlp on this rank's experts: under tensor parallelism (rank r of
    T holds the intermediate slice r of every expert, ``w13 [E, 2I/T, H]``, ``w2 [E, H,
    I/T]``) the down projection's partials in the TP-invariant order, gathered from the
    ranks and tree-summed in rank order; every rank returns the whole output."""
    if self.moe_config.moe_parallel_config.ep_size > 1:
        return _expert_parallel(self, x, chosen, weights)
    experts: Any = self.routed_experts
    biased = self.moe_config.has_bias
    pairs = chosen.reshape(-1)
    hidden = expert_hidden(
        x,
        pairs,
        chosen.shape[1],
        experts.w13_weight,
        experts.w13_bias if biased else None,
        self._bik_activation,
    )
    chunks = self._bik_down_chunks
    if chunks is None:
        out = grouped_linear(hidden, experts.w2_weight, pairs)
    else:
        partial = expert_down_partial(hidden, experts.w2_weight, pairs, chunks)
        partials = gather_tp_ranks(self.moe_config.tp_size, partial)
        out = combine_partials(partials, None, x.dtype)
    return weigh_expert_outputs(out, pairs, weights, experts.w2_bias if biased else None)


def _expert_parallel(
    self: MoERunner, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The routed experts under expert parallelism: each rank holds whole experts (the
    runner's ``expert_map``: global index -> local, -1 for another rank's) and computes the
    (token, rank) pairs routed to them, the down projection in all of the TP-invariant order's
    chunks (a whole expert, as the trainer's); the other pairs' rows are -0.0, the identity
    of addition, so the rows gathered from every rank and added in rank order are exactly
    the owner's, whichever rank that is; then each token's experts are weighed in rank
    order, as at TP 1."""
    experts: Any = self.routed_experts
    pairs = chosen.reshape(-1)
    local = self.expert_map[pairs]
    mine = (local >= 0).nonzero().squeeze(1)
    rows = x.repeat_interleave(chosen.shape[1], 0)[mine]
    hidden = expert_hidden(rows, local[mine], 1, experts.w13_weight, None, self._bik_activation)
    computed = expert_down_partial(hidden, experts.w2_weight, local[mine], TP_CHUNKS)
    out = torch.full((pairs.shape[0], x.shape[1]), -0.0, dtype=x.dtype, device=x.device)
    out[mine] = computed.to(x.dtype)
    ranks = gather_ep_ranks(self.moe_config.moe_parallel_config.ep_size, out)
    total = ranks[0]
    for other in ranks[1:]:  # rank order; every row has one owner, the others add -0.0
        total = total + other
    return weigh_expert_outputs(total, pairs, weights)


def _keep_weights(self: Any, layer: Any) -> None:
    """bik reads ``w13_weight`` / ``w2_weight`` as loaded: nothing to prepack."""


PATCHED_METHODS = (
    (GateLinear, "forward", _gate_forward),
    (MoERunner, "forward", _runner_forward),
    (UnquantizedFusedMoEMethod, "process_weights_after_loading", _keep_weights),
)


def _routing(router: Any, output_scale: float, fp32_weights: bool) -> Routing | None:
    """bik's routing for vLLM's ``router``: a plain softmax top-k (the GPU platforms'
    FusedTopKRouter, the CPU platform's CPURouter) or a sigmoid group-limited top-k with a
    score-correction bias (GroupedTopKRouter, CPURouter); None for any other.
    ``output_scale``: the routed scaling factor vLLM applies to the experts' output instead
    of the router's weights; transformers scales the weights, and so does bik."""
    scale = router.routed_scaling_factor * output_scale  # one of the two is 1
    custom = any(
        getattr(router, name, None) is not None
        for name in ("custom_routing_function", "_hash_indices_table")
    )
    bias: Any = getattr(router, "e_score_correction_bias", None)
    grouped = isinstance(router, GroupedTopKRouter) or getattr(router, "use_grouped_topk", False)
    softmax = (
        isinstance(router, (FusedTopKRouter, CPURouter))
        and not grouped
        and router.scoring_func == "softmax"
        and bias is None
        and scale == 1.0
    )
    sigmoid_grouped = (
        isinstance(router, (GroupedTopKRouter, CPURouter))
        and grouped
        and router.scoring_func == "sigmoid"
        and bias is not None
    )
    if custom or not (softmax or sigmoid_grouped):
        return None
    if softmax:
        return functools.partial(
            _softmax_top_k,
            top_k=router.top_k,
            normalize=router.renormalize,
            fp32_weights=fp32_weights,
        )
    return functools.partial(
        route_grouped_sigmoid,
        bias=bias,  # the parameter itself: a weight sync writes into it
        top_k=router.top_k,
        groups=router.num_expert_group,
        topk_groups=router.topk_group,
        normalize=router.renormalize,
        scale=scale,
    )


def _activation(
    config: Any, model_type: str, swiglu_limit: float | None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The experts' activation as the trainer computes it: SiLU-and-multiply without biases,
    or gpt-oss's clamped SwiGLU with biases (gate and up interleaved, as vLLM keeps gpt-oss's
    ``w13``) at the config's ``swiglu_limit`` (vLLM's own kernel clamps at 7 whatever the
    config says); None for any other."""
    activation = config.activation.name
    if activation == "SILU" and not config.has_bias:
        return silu_and_mul
    if swiglu_limit is None or model_type != "gpt_oss":
        return None
    if activation == "SWIGLUOAI" and config.has_bias:
        return functools.partial(clamped_swiglu, alpha=GPT_OSS_ALPHA, limit=swiglu_limit)
    return None


def problems(
    name: str,
    runner: MoERunner,
    model_type: str,
    swiglu_limit: float | None = None,
    tp_invariant: bool = False,
) -> list[str]:
    """What bik cannot compute in ``runner`` (a MoE layer of a ``model_type`` model, with the
    config's ``swiglu_limit`` for gpt-oss) in the bik-patched trainer's order (with
    ``tp_invariant``, the trainer's TP-invariant one); with none, the runner is marked for
    bik's forward."""
    config: Any = runner.moe_config
    router: Any = runner.router
    experts: Any = runner.routed_experts
    family = FAMILIES.get(model_type)
    found = []
    if family is None or not family.moe:
        found.append(f"a {model_type!r} mixture-of-experts layer: no bik family routes it")
    fp32_weights = family is not None and family.fp32_router_weights
    routing = _routing(router, runner.routed_scaling_factor, fp32_weights)
    if routing is None:
        found.append(
            f"its router ({type(router).__name__}, scoring {getattr(router, 'scoring_func', '?')!r}"
            "): bik.vllm runs softmax top-k routers and sigmoid group-limited ones with a "
            "score-correction bias"
        )
    if not isinstance(experts.quant_method, UnquantizedFusedMoEMethod):
        found.append(f"quantized experts ({type(experts.quant_method).__name__})")
    activation = _activation(config, model_type, swiglu_limit)
    if activation is None:
        found.append(
            "experts with biases or an activation other than SiLU-and-multiply (gpt-oss's "
            "biased, clamped SwiGLU excepted)"
        )
    found.extend(_parallel_problems(config.moe_parallel_config, experts, tp_invariant))
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        found.append("latent (transformed) expert inputs or outputs")
    fp32_logits = isinstance(routing, functools.partial) and routing.func is route_grouped_sigmoid
    if fp32_logits and getattr(runner.gate, "bias", None) is not None:
        found.append("a sigmoid router with a bias (transformers' has none)")
    if found:
        return [f"{name} ({type(runner).__name__}): {problem}" for problem in found]
    runner._bik_routing, runner._bik_activation = routing, activation
    runner._bik_fp32_logits = fp32_logits
    tp = config.moe_parallel_config.tp_size
    runner._bik_down_chunks = TP_CHUNKS // tp if tp_invariant else None
    return []


def _parallel_problems(parallel: Any, experts: Any, tp_invariant: bool) -> list[str]:
    """What bik cannot order in the experts' parallel layout: data or context parallelism,
    expert-parallel load balancing (redundant copies of an expert); tensor or expert
    parallelism without the TP-invariant order (bik.vllm.config refuses the engine first),
    biased experts above one process (vLLM loads gpt-oss's down bias on rank 0 only), an
    intermediate slice not divisible into its rank's chunks."""
    found = []
    if parallel.dp_size * parallel.pcp_size != 1:
        found.append(
            "data or context parallelism of the experts (bik.vllm shards experts by tensor or "
            "expert parallelism: data_parallel_size=1)"
        )
    if parallel.enable_eplb:
        found.append("expert-parallel load balancing (enable_eplb: redundant expert copies)")
    ranks = parallel.tp_size * parallel.ep_size
    if ranks == 1:
        return found
    if not tp_invariant:
        found.append("tensor or expert parallelism of the experts without tp_invariant")
    if getattr(experts, "w2_bias", None) is not None:
        found.append("biased experts above tensor_parallel_size=1 (gpt-oss): run them at TP 1")
    inner, chunks = experts.w2_weight.shape[-1], TP_CHUNKS // parallel.tp_size
    if inner % chunks:
        found.append(
            f"an intermediate slice of {inner} per rank, not divisible into its {chunks} "
            f"chunks (bik.contract.TP_CHUNKS = {TP_CHUNKS})"
        )
    return found
