"""The gated delta rule (Gated DeltaNet: the linear-attention layers of Qwen3.5 and Qwen3-Next)
in one fixed order, so that a prompt, a chunked prefill and token-by-token decode reach the
same recurrent state bits at every position.

Order (bik.contract, "gated delta rule"): the state ``S [B, H, K, V]`` is fp32 and runs token
by token in position order; for token t of a row,

    S  <- S * exp(g_t)
    kv <- tree_K(S * k_t)          (the state's read-out at the key, one value vector)
    S  <- S + k_t (x) ((v_t - kv) * beta_t)
    o_t = tree_K(S * q_t)          (q_t scaled by 1 / sqrt(K), after the optional L2 norm)

where ``tree_K`` sums over the key dimension by one fixed pairwise tree (:func:`tree_sum`:
the dimension zero-padded to a power of two, then halved, each half added to the other, until
one entry is left). Every step is elementwise on one row's tensors, and the elementwise ops
used (multiplication, addition, ``exp``, ``sqrt``, division) give the same bits in torch's
vector and scalar loops, so a row's bits depend on its own tokens only: not on the batch,
not on where a call cuts the sequence (the state is carried exactly), not on the thread
count. A prefill is this recurrence over the prompt, a decode step one token of it: the same
function, hence the same bits. The chunked parallel form (fast on a GPU) sums in another
order and is not used.

:func:`recurrence` is the order's torch composition. A backend may run it in one kernel
(``Backend.delta_rule``: the cpu backend's C++ loop, the triton backend's register-resident
state tile) with the same bits; the decay factors ``exp(g)`` are computed once by torch for
both, so no kernel's own ``exp`` enters. Gradients differentiate the composition (autograd
runs it whenever an input requires grad): deterministic, and the forward bits do not change.
"""

import torch

from .. import _checks, backends
from ..ops._dispatch import needs_custom_op


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The depthwise causal convolution before the rule: ``x [B, C, L]`` (channels first, as
    transformers' ``causal_conv1d_fn``), ``weight [C, W]`` -> ``[B, C, L]`` in x's dtype.

    Output ``t`` of channel ``c`` is ``sum_j weight[c, j] * x[c, t - W + 1 + j]`` over the taps
    ``j = 0 .. W - 1`` in ascending order, in fp32, with inputs before the first as exact
    zeros, then ``+ bias[c]`` (Mamba2's), rounded once. Elementwise per (row, channel,
    position): a decode step that convolves its cached window gets the bits of the same
    position in a prompt."""
    _checks.floating("x", x)
    _checks.rank("x", x, 3)
    _checks.rank("weight", weight, 2)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"weight: expected {x.shape[1]} channels (x's dim 1), got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(
            f"bias: expected shape ({weight.shape[0]},), one per channel, got {tuple(bias.shape)}"
        )
    width, length = weight.shape[1], x.shape[2]
    padded = torch.nn.functional.pad(x.float(), (width - 1, 0))
    taps = weight.float()[:, :, None]  # [C, W, 1]
    out = padded[:, :, 0:length] * taps[:, 0]
    for j in range(1, width):  # ascending taps: the order's one reduction
        out = out + padded[:, :, j : j + length] * taps[:, j]
    if bias is not None:
        out = out + bias.float()[:, None]
    return out.to(x.dtype)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` summed over ``dim`` by a fixed pairwise tree (see the module docstring); the
    dimension is kept, of size 1."""
    dim = dim % x.dim()
    size = x.shape[dim]
    width = 1 << max(size - 1, 0).bit_length()
    if width != size:  # zeros to a power of two: +0.0 leaves every partial sum as it is
        pad = list(x.shape)
        pad[dim] = width - size
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    return x


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(tree_sum(x * x) + eps)`` over the last dimension (transformers' ``l2norm``
    multiplies by ``rsqrt`` of a torch sum: the same value to fp32 rounding)."""
    return x / torch.sqrt(tree_sum(x * x, -1) + eps)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``T`` tokens from ``initial_state`` (zeros when None).

    Shapes as transformers' ``torch_recurrent_gated_delta_rule``: ``query``, ``key``
    ``[B, T, H, K]``; ``value`` ``[B, T, H, V]``; ``g`` (the log decay) ``[B, T, H]``, or
    ``[B, T, H, K]`` for a decay per key channel (Kimi Delta Attention: the state's row k decays
    by ``exp(g[..., k])``); ``beta`` ``[B, T, H]``; the state ``[B, H, K, V]``. Returns the
    output ``[B, T, H, V]`` in the query's dtype and the fp32 final state, which a later call
    continues from bit for bit.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        _checks.floating(name, t)
    _checks.rank("query", query, 4)
    if key.shape != query.shape:
        raise ValueError(
            f"key: expected the shape of query {tuple(query.shape)}, got {tuple(key.shape)}"
        )
    batch, tokens, heads, k_dim = query.shape
    if value.dim() != 4 or value.shape[:3] != (batch, tokens, heads):
        raise ValueError(
            f"value: expected [B, T, H, V] = [{batch}, {tokens}, {heads}, V], got "
            f"{tuple(value.shape)}"
        )
    if beta.shape != (batch, tokens, heads):
        raise ValueError(
            f"beta: expected shape ({batch}, {tokens}, {heads}), got {tuple(beta.shape)}"
        )
    if g.shape not in ((batch, tokens, heads), (batch, tokens, heads, k_dim)):
        raise ValueError(
            f"g: expected shape ({batch}, {tokens}, {heads}) or ({batch}, {tokens}, {heads}, "
            f"{k_dim}), got {tuple(g.shape)}"
        )
    v_dim = value.shape[-1]
    state_shape = (batch, heads, k_dim, v_dim)
    if initial_state is None:
        state = torch.zeros(state_shape, dtype=torch.float32, device=query.device)
    elif initial_state.shape != state_shape:
        raise ValueError(
            f"initial_state: expected shape {state_shape}, got {tuple(initial_state.shape)}"
        )
    else:
        state = initial_state.float()
    if tokens == 0:
        return value.new_zeros(value.shape), state
    q, k, v, decay, b = (t.float().transpose(1, 2) for t in (query, key, value, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    inputs = (q / (k_dim**0.5), k, v, decay.exp(), b, state)
    accelerator = None if needs_custom_op(inputs) else _accelerator(query.device)
    out, state = (accelerator or recurrence)(*inputs)
    return out.transpose(1, 2).to(query.dtype, memory_format=torch.contiguous_format), state


def _accelerator(device: torch.device):
    """The delta_rule kernel of the backend running matmul on ``device``, or None."""
    return backends.resolve(device, "matmul").delta_rule


def recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's torch composition over fp32 ``[B, H, T, *]`` tensors (``q`` scaled,
    ``decay = exp(g)``, ``[B, H, T]`` or ``[B, H, T, K]``): (out ``[B, H, T, V]``, final
    state). Backends' ``delta_rule`` kernels compute these bits in one call; autograd,
    tracing and fake tensors run this."""
    per_key = decay.dim() == 4
    out = []
    for step in range(q.shape[2]):  # position order: the recurrence's only order
        factor = decay[:, :, step]
        state = state * (factor[..., None] if per_key else factor[..., None, None])
        k_t = k[:, :, step, :, None]
        read = tree_sum(state * k_t, -2)  # [B, H, 1, V]
        delta = (v[:, :, step, None, :] - read) * beta[:, :, step, None, None]
        state = state + k_t * delta
        out.append(tree_sum(state * q[:, :, step, :, None], -2)[:, :, 0])
    return torch.stack(out, dim=2), state
