"""The Mamba2 selective scan (the state-space layers of Nemotron-H) in one fixed order, so that
a prompt, a chunked prefill and token-by-token decode reach the same state bits at every
position.

Order (bik.contract, "Mamba2 selective scan"): the state ``S [B, H, P, N]`` is fp32 and runs
token by token in position order; for token t of a row, with the step ``dt_t`` per head,

    S   <- S * exp(dt_t * A) + ((dt_t * x_t) (x) B_t)
    y_t  = tree_N(S * C_t) + D * x_t

where ``tree_N`` sums over the state dimension by the delta rule's fixed pairwise tree
(:func:`bik.layers.delta_rule.tree_sum`) and B_t, C_t are shared by the heads of a group.
Every step is elementwise on one row's tensors (multiplication, addition, ``exp``), so a
row's bits depend on its own tokens only. transformers' chunked scan (prefill) and its
recurrent update (decode) sum in other orders, and disagree with each other.

:func:`recurrence` is the order's torch composition; a backend may run it in one kernel
(``Backend.selective_scan``: cpu, triton) with the same bits, taking ``exp(dt A)`` and
``dt x`` from torch, as the delta rule's kernels do (bik.layers.delta_rule).
"""

import torch

from .. import _checks, backends
from ..ops._dispatch import needs_custom_op
from .delta_rule import tree_sum


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over ``T`` tokens from ``initial_state`` (zeros when None).

    ``x [B, T, H, P]``; ``dt [B, T, H]`` (the step, after its softplus and clamp); ``a [H]``
    (negative: ``-exp(A_log)``); ``b``, ``c`` ``[B, T, G, N]`` with G dividing H; ``d [H]``;
    the state ``[B, H, P, N]``. Returns fp32 ``y [B, T, H, P]`` and the fp32 final state, which
    a later call continues from bit for bit."""
    for name, t in (("x", x), ("dt", dt), ("a", a), ("b", b), ("c", c), ("d", d)):
        _checks.floating(name, t)
    _checks.rank("x", x, 4)
    batch, tokens, heads, head_dim = x.shape
    groups, state_dim = b.shape[2], b.shape[3]
    if dt.shape != (batch, tokens, heads):
        raise ValueError(f"dt: expected shape ({batch}, {tokens}, {heads}), got {tuple(dt.shape)}")
    for name, t in (("b", b), ("c", c)):
        if t.dim() != 4 or t.shape[:2] != (batch, tokens) or t.shape[2:] != (groups, state_dim):
            raise ValueError(
                f"{name}: expected [B, T, G, N] = [{batch}, {tokens}, {groups}, {state_dim}], "
                f"got {tuple(t.shape)}"
            )
    if groups == 0 or heads % groups:
        raise ValueError(f"b: {groups} groups do not divide the {heads} heads of x")
    for name, t in (("a", a), ("d", d)):
        if t.shape != (heads,):
            raise ValueError(f"{name}: expected shape ({heads},), got {tuple(t.shape)}")
    state_shape = (batch, heads, head_dim, state_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(
            f"initial_state: expected shape {state_shape}, got {tuple(initial_state.shape)}"
        )
    state = (
        torch.zeros(state_shape, dtype=torch.float32, device=x.device)
        if initial_state is None
        else initial_state.float()
    )
    if tokens == 0:
        return x.new_zeros(x.shape, dtype=torch.float32), state
    xs, steps = x.float().transpose(1, 2), dt.float().transpose(1, 2)  # [B, H, T, P], [B, H, T]
    inputs = (
        torch.exp(steps * a.float()[:, None]),  # the decay, every token at once
        steps[..., None] * xs,  # the write's scale dt x
        *(t.float().transpose(1, 2) for t in (b, c)),  # [B, G, T, N]
        state,
    )
    accelerator = None if needs_custom_op(inputs) else _accelerator(x.device)
    read, state = (accelerator or recurrence)(*inputs)
    out = read + d.float()[:, None, None] * xs  # the skip D x
    return out.transpose(1, 2).contiguous(), state


def _accelerator(device: torch.device):
    """The selective_scan kernel of the backend running matmul on ``device``, or None."""
    return backends.resolve(device, "matmul").selective_scan


def recurrence(
    decay: torch.Tensor, dtx: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan's torch composition over fp32 ``decay [B, H, T]`` (``exp(dt A)``), ``dtx
    [B, H, T, P]`` (``dt x``), ``b``, ``c`` ``[B, G, T, N]``: (read ``tree_N(S * C)``
    ``[B, H, T, P]``, final state). Backends' ``selective_scan`` kernels compute these bits
    in one call; autograd, tracing and fake tensors run this."""
    per_group = dtx.shape[1] // b.shape[1]
    bs, cs = (t.repeat_interleave(per_group, dim=1) for t in (b, c))  # [B, H, T, N]
    reads = []
    for position in range(dtx.shape[2]):  # position order: the recurrence's only order
        write = dtx[:, :, position, :, None] * bs[:, :, position, None, :]
        state = state * decay[:, :, position, None, None] + write
        reads.append(tree_sum(state * cs[:, :, position, None, :], -1)[..., 0])  # [B, H, P]
    return torch.stack(reads, dim=2), state
