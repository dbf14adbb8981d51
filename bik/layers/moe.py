"""Mixture-of-experts routing and expert combination, batch-invariant per token.

Routing (:func:`route`): the router's logits go through :func:`bik.log_softmax` (one fixed
order per row, fp32); experts are ranked by that log-probability, highest first, and equal
log-probabilities are ranked by expert index, lowest first (a stable sort: the documented
tie-break). The top-k weights are ``exp`` of the chosen log-probabilities; renormalised, they
are divided by their sum taken in ascending rank order.

Experts (:func:`expert_mlp`): each (token, rank) pair runs its expert's gated SiLU MLP through
:func:`bik.ops.grouped_linear.grouped_linear`, whose rows never depend on which or how many
other tokens chose the same expert. A token's k expert outputs are weighted and summed in fp32
in ascending rank order, then rounded once to the activations' dtype.

Every elementwise step (exp, division, SiLU) uses a function whose bits do not depend on the
tensor's layout (see bik.ops.activations), so the whole path is a function of the token alone.
"""

import torch

from .. import _checks
from ..ops.activations import silu_and_mul
from ..ops.grouped_linear import grouped_linear
from ..ops.log_softmax import log_softmax


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (fp32 weights ``[T, top_k]``, int64 experts ``[T, top_k]``), the
    experts in rank order (see the module docstring for the ranking and its tie-break)."""
    _checks.floating("logits", logits)
    _checks.rank("logits", logits, 2)
    experts = logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected an int in [1, {experts}] (the experts), got {top_k!r}")
    logp = log_softmax(logits, dtype=torch.float32)
    chosen = torch.sort(logp, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = logp.gather(1, chosen).exp()
    if normalize:
        total = weights[:, 0]
        for rank in range(1, top_k):  # a fixed order, not torch.sum's shape-dependent one
            total = total + weights[:, rank]
        weights = weights / total[:, None]
    return weights, chosen


def expert_mlp(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token.

    ``x [T, H]``; ``experts [T, k]`` (int) and ``weights [T, k]`` from :func:`route`;
    ``gate_up [E, 2I, H]`` (gate rows first, then up) and ``down [E, H, I]`` in nn.Linear
    layout, as transformers stores an experts module. Returns ``[T, H]`` in x's dtype.
    """
    _checks.rank("experts", experts, 2)
    _checks.dim_size("experts", experts, 0, x.shape[0], "T, the tokens of x")
    if weights.shape != experts.shape:
        raise ValueError(
            f"weights: expected the shape of experts {tuple(experts.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    tokens, top_k = experts.shape
    pairs = experts.reshape(-1)  # pair t * k + r: token t's expert of rank r
    hidden = silu_and_mul(grouped_linear(x.repeat_interleave(top_k, 0), gate_up, pairs))
    out = grouped_linear(hidden, down, pairs).view(tokens, top_k, -1).float()
    weights = weights.float()
    total = out[:, 0] * weights[:, :1]
    for rank in range(1, top_k):  # ascending rank order, in fp32
        total = total + out[:, rank] * weights[:, rank : rank + 1]
    return total.to(x.dtype)
