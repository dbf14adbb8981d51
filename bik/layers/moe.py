"""Mixture-of-experts routing and expert combination, batch-invariant per token.

Routing (:func:`route`): the router's logits go through :func:`bik.log_softmax` (one fixed
order per row, fp32); experts are ranked by that log-probability, highest first, and equal
log-probabilities are ranked by expert index, lowest first (a stable sort: the documented
tie-break). The top-k weights are ``exp`` of the chosen log-probabilities; renormalised, they
are divided by their sum taken in ascending rank order.

Sigmoid routing with a score-correction bias and group-limited top-k (DeepSeek-V3, GLM-4.5;
:func:`route_grouped_sigmoid`): the scores are :func:`bik.sigmoid` of the fp32 logits; the
choice scores add the bias; a group's score is its two best choice scores added, the better
first; the ``topk_groups`` best groups are kept (ties to the lower group index), then the
``top_k`` best experts among them (ties to the lower expert index), each weighted by its score
without the bias; renormalised, the weights are divided by their sum in rank order plus
1e-20 (transformers' guard), then multiplied by the routed scaling factor.

Experts (:func:`expert_mlp`): each (token, rank) pair runs its expert's gated MLP (SiLU, or
gpt-oss's clamped SwiGLU with biases: :func:`clamped_swiglu`) through
:func:`bik.ops.grouped_linear.grouped_linear`, whose rows never depend on which or how many
other tokens chose the same expert. A token's k expert outputs are weighted and summed in fp32
in ascending rank order, then rounded once to the activations' dtype. Under tensor
parallelism the down projection is a row-parallel linear (K, the intermediate size, is split
across ranks): ``down_chunks`` computes it in bik's TP-invariant order
(:func:`expert_down_partial`, the order of bik.distributed.chunked), so TP 1, 2, 4 and 8 give
the same bits.

Every elementwise step (exp, division, SiLU) uses a function whose bits do not depend on the
tensor's layout (see bik.ops.activations), so the whole path is a function of the token alone.
"""

from collections.abc import Callable

import torch

from .. import _checks
from ..contract import tp_tree_sum
from ..ops.activations import sigmoid, silu_and_mul
from ..ops.grouped_linear import grouped_linear
from ..ops.log_softmax import log_softmax


@torch.compiler.disable
def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (fp32 weights ``[T, top_k]``, int64 experts ``[T, top_k]``), the
    experts in rank order (see the module docstring for the ranking and its tie-break). Eager
    under torch.compile: Inductor's own ``exp`` of the chosen log-probabilities differs from
    eager torch's in the last bit on an AVX2 CPU, so a compiled model would differ."""
    _checks.floating("logits", logits)
    _checks.rank("logits", logits, 2)
    experts = logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected an int in [1, {experts}] (the experts), got {top_k!r}")
    logp = log_softmax(logits, dtype=torch.float32)
    chosen = _ranked(logp, top_k)
    weights = logp.gather(1, chosen).exp()
    if normalize:
        weights = weights / _sum_in_rank_order(weights)[:, None]
    return weights, chosen


def _ranked(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` highest ``scores`` of each row, highest first, equal
    scores by index, lowest first (a stable sort: the documented tie-break)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]


def _sum_in_rank_order(weights: torch.Tensor) -> torch.Tensor:
    total = weights[:, 0]
    for rank in range(1, weights.shape[1]):  # a fixed order, not torch.sum's shape-dependent one
        total = total + weights[:, rank]
    return total


def route_grouped_sigmoid(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    groups: int,
    topk_groups: int,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` and the score-correction ``bias [E]`` -> (fp32 weights ``[T, top_k]``,
    int64 experts ``[T, top_k]``) in rank order (see the module docstring)."""
    _checks.floating("logits", logits)
    _checks.rank("logits", logits, 2)
    tokens, experts = logits.shape
    if bias.shape != (experts,):
        raise ValueError(f"bias: expected shape ({experts},), got {tuple(bias.shape)}")
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(
            f"groups, topk_groups: expected groups dividing the {experts} experts and "
            f"1 <= topk_groups <= groups, got {groups}, {topk_groups}"
        )
    allowed = topk_groups * (experts // groups)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= allowed:
        raise ValueError(
            f"top_k: expected an int in [1, {allowed}] (the experts of the kept groups), "
            f"got {top_k!r}"
        )
    scores = sigmoid(logits.float())
    choice = scores + bias.float()
    per_group = choice.view(tokens, groups, experts // groups)
    best_two = torch.sort(per_group, dim=-1, descending=True, stable=True).values[..., :2]
    group_scores = (
        best_two[..., 0] + best_two[..., 1] if best_two.shape[-1] > 1 else best_two[..., 0]
    )
    kept = torch.zeros(tokens, groups, dtype=torch.bool, device=logits.device)
    kept.scatter_(1, _ranked(group_scores, topk_groups), True)
    choice = choice.masked_fill(~kept.repeat_interleave(experts // groups, 1), float("-inf"))
    chosen = _ranked(choice, top_k)
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (_sum_in_rank_order(weights)[:, None] + 1e-20)
    return weights * scale, chosen


def expert_mlp(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    *,
    down_chunks: int | None = None,
) -> torch.Tensor:
    """The routed experts' gated MLPs, weighted and summed per token.

    ``x [T, H]``; ``experts [T, k]`` (int) and ``weights [T, k]`` from :func:`route`;
    ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` in nn.Linear layout (any strides), as
    transformers stores an experts module; ``activation`` maps the gate/up projection
    ``[R, 2I]`` to ``[R, I]`` (default: SiLU of the first half times the second). With biases
    (gpt-oss), each is added in fp32 to its projection's rounded output (``activation`` then
    gets fp32). ``down_chunks``: the down projection in the TP-invariant order
    (:func:`expert_down_partial` of that many chunks, rounded once), as tensor parallelism
    splits it; None: one grouped linear. Returns ``[T, H]`` in x's dtype.
    """
    _checks.rank("experts", experts, 2)
    _checks.dim_size("experts", experts, 0, x.shape[0], "T, the tokens of x")
    if weights.shape != experts.shape:
        raise ValueError(
            f"weights: expected the shape of experts {tuple(experts.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    pairs = experts.reshape(-1)  # pair t * k + r: token t's expert of rank r
    hidden = expert_hidden(x, pairs, experts.shape[1], gate_up, gate_up_bias, activation)
    if down_chunks is None:
        out = grouped_linear(hidden, down, pairs)
    else:
        out = expert_down_partial(hidden, down, pairs, down_chunks).to(x.dtype)
    return weigh_expert_outputs(out, pairs, weights, down_bias)


def expert_hidden(
    x: torch.Tensor,
    pairs: torch.Tensor,
    top_k: int,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """The experts' hidden activations ``[T * k, I]`` in x's dtype, pair ``t * k + r`` (token
    t's expert of rank r, ``pairs`` the experts flattened): each pair's gate/up projection
    (column-parallel: each output column reduces the whole H) and activation."""
    projected = grouped_linear(x.repeat_interleave(top_k, 0), gate_up, pairs)
    if gate_up_bias is not None:
        projected = projected.float() + gate_up_bias.float()[pairs]
    return activation(projected).to(x.dtype)


def expert_down_partial(
    hidden: torch.Tensor, down: torch.Tensor, pairs: torch.Tensor, chunks: int
) -> torch.Tensor:
    """The experts' down projection (``hidden [R, K] @ down[pairs].T``) as the fp32 tree sum
    of ``chunks`` equal K chunks, each one grouped linear from zero on the exact fp32 casts:
    the TP-invariant order of a row-parallel linear (bik.distributed.chunked) for the
    experts. A rank holding K slice r of T (``chunks`` = C / T) computes its subtree; the
    ranks' partials summed by ``bik.contract.tp_tree_sum`` give the C-chunk result at any T."""
    _checks.chunk_count("chunks", chunks, hidden.shape[-1], "K, the experts' intermediate size")
    step = hidden.shape[-1] // chunks
    hidden32, down32 = hidden.float(), down.float()
    parts = [
        grouped_linear(
            hidden32[:, i * step : (i + 1) * step], down32[:, :, i * step : (i + 1) * step], pairs
        )
        for i in range(chunks)
    ]
    return tp_tree_sum(parts)


def weigh_expert_outputs(
    out: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's k expert outputs (``out [T * k, H]``, rounded to the activations' dtype;
    the down bias added in fp32) weighted and summed in fp32 in ascending rank order, then
    rounded once to out's dtype."""
    tokens, top_k = weights.shape
    total32 = out.float()
    if down_bias is not None:
        total32 = total32 + down_bias.float()[pairs]
    total32 = total32.view(tokens, top_k, -1)
    weights = weights.float()
    total = total32[:, 0] * weights[:, :1]
    for rank in range(1, top_k):  # ascending rank order, in fp32
        total = total + total32[:, rank] * weights[:, rank : rank + 1]
    return total.to(out.dtype)


def clamped_swiglu(projected: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on ``projected [R, 2I]`` (gate and up interleaved: columns
    0, 2, 4... and 1, 3, 5...): ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``
    with ``g = min(gate, limit)``, elementwise in the input's dtype (fp32 from expert_mlp),
    the sigmoid through :func:`bik.sigmoid`."""
    gate = projected[:, ::2].clamp(max=limit)
    up = projected[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * sigmoid(gate * alpha))
