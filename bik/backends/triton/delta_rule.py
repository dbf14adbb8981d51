"""The gated delta rule's recurrence (bik.layers.delta_rule) in the order of its torch
composition, hence its bits: one program per (row, head, block of value columns) carries
its fp32 state tile ``[W, BLOCK_V]`` in registers through the tokens in position order.

Each token decays the tile, reads it at the key, writes the correction and reads it at the
query. Every product and sum is its own fp32 rounding (``enable_fp_fusion`` is off, see
_common), and each read is :func:`~._tree.tree_over_last` over the transposed tile: the K
products zero-padded to the power of two ``W``, first half plus second half until one is
left, as ``tree_sum`` in torch. Value columns are independent, so ``BLOCK_V`` decides who
computes a column, never how.
"""

import torch
import triton
import triton.language as tl

from ._common import Launch, aligned, cdiv, next_power_of_2
from ._tree import tree_over_last

BLOCK_V_CAP = 64
"""Value columns per program at most: a 128 x 64 fp32 state tile is 32 registers a thread at
four warps."""


@triton.jit(do_not_specialize=["T"])
def _delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    T,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DECAY_PER_KEY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (batch, head), flattened
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, W)
    key_ok, col_ok = keys < K, cols < V
    tile = key_ok[:, None] & col_ok[None, :]
    tile_offsets = keys[:, None] * V + cols[None, :]
    state = tl.load(state_ptr + row * K * V + tile_offsets, mask=tile, other=0.0)
    for t in range(T):
        token = row * T + t
        k = tl.load(k_ptr + token * K + keys, mask=key_ok, other=0.0)
        q = tl.load(q_ptr + token * K + keys, mask=key_ok, other=0.0)
        v = tl.load(v_ptr + token * V + cols, mask=col_ok, other=0.0)
        beta = tl.load(beta_ptr + token)
        if DECAY_PER_KEY:
            decay = tl.load(decay_ptr + token * K + keys, mask=key_ok, other=1.0)
            state = state * decay[:, None]
        else:
            state = state * tl.load(decay_ptr + token)
        read = tree_over_last(tl.trans(state * k[:, None]), BLOCK_V, W, LEVELS)
        delta = (v - read) * beta
        state = state + k[:, None] * delta[None, :]
        out = tree_over_last(tl.trans(state * q[:, None]), BLOCK_V, W, LEVELS)
        tl.store(out_ptr + token * V + cols, out, mask=col_ok)
    tl.store(state_ptr + row * K * V + tile_offsets, state, mask=tile)


def delta_rule_launch(q, k, v, decay, beta, state, out) -> Launch:
    """The launch running the recurrence over contiguous fp32 tensors (layouts as
    bik.backends.base); ``state`` is overwritten by the final state. Works on meta tensors."""
    batch, heads, tokens, k_dim = q.shape
    v_dim = v.shape[-1]
    block_v, width = min(BLOCK_V_CAP, next_power_of_2(v_dim)), next_power_of_2(k_dim)
    return Launch(
        _delta_rule_kernel,
        (batch * heads, cdiv(v_dim, block_v)),
        dict(
            q_ptr=q,
            k_ptr=k,
            v_ptr=v,
            decay_ptr=decay,
            beta_ptr=beta,
            state_ptr=state,
            out_ptr=out,
            T=tokens,
            K=k_dim,
            V=v_dim,
            W=width,
            LEVELS=width.bit_length() - 1,
            BLOCK_V=block_v,
            DECAY_PER_KEY=decay.dim() == 4,
        ),
        num_warps=4,
        num_stages=1,
    )


def delta_rule(q, k, v, decay, beta, state):
    """(fp32 out [B, H, T, V], the final fp32 state): the recurrence from ``state``."""
    q, k, v, decay, beta = (aligned(t.contiguous()) for t in (q, k, v, decay, beta))
    state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes it
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    delta_rule_launch(q, k, v, decay, beta, state, out)()
    return out, state
