"""The Mamba2 selective scan's recurrence (bik.layers.mamba2) in the order of its torch
composition, hence its bits: one program per (row, head, block of state rows) carries its fp32
state tile ``[BLOCK_P, W]`` in registers through the tokens in position order.

Each token decays the tile and writes ``dt x (x) B`` (two roundings, ``enable_fp_fusion``
off), then reads it against ``C`` by :func:`~._tree.tree_over_last`: the N products
zero-padded to the power of two ``W``, first half plus second half until one column is left,
as ``tree_sum``.
State rows are independent, so ``BLOCK_P`` decides who computes a row, never how.
"""

import torch
import triton
import triton.language as tl

from ._common import Launch, aligned, cdiv, next_power_of_2
from ._tree import tree_over_last

BLOCK_P_CAP = 32
"""State rows per program at most: a 32 x 128 fp32 tile is 32 registers a thread at four
warps."""


@triton.jit(do_not_specialize=["T"])
def _selective_scan_kernel(
    decay_ptr,
    dtx_ptr,
    b_ptr,
    c_ptr,
    state_ptr,
    out_ptr,
    T,
    H: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    W: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (batch, head), flattened
    group_row = (row // H) * (H // HEADS_PER_GROUP) + (row % H) // HEADS_PER_GROUP
    rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, W)
    row_ok, col_ok = rows < P, cols < N
    tile = row_ok[:, None] & col_ok[None, :]
    tile_offsets = rows[:, None] * N + cols[None, :]
    state = tl.load(state_ptr + row * P * N + tile_offsets, mask=tile, other=0.0)
    for t in range(T):
        token, shared = row * T + t, (group_row * T + t) * N
        decay = tl.load(decay_ptr + token)
        dtx = tl.load(dtx_ptr + token * P + rows, mask=row_ok, other=0.0)
        b = tl.load(b_ptr + shared + cols, mask=col_ok, other=0.0)
        c = tl.load(c_ptr + shared + cols, mask=col_ok, other=0.0)
        state = state * decay + dtx[:, None] * b[None, :]
        read = tree_over_last(state * c[None, :], BLOCK_P, W, LEVELS)
        tl.store(out_ptr + token * P + rows, read, mask=row_ok)
    tl.store(state_ptr + row * P * N + tile_offsets, state, mask=tile)


def selective_scan_launch(decay, dtx, b, c, state, out) -> Launch:
    """The launch running the scan over contiguous fp32 tensors (layouts as
    bik.backends.base); ``state`` is overwritten by the final state. Works on meta tensors."""
    (batch, heads, tokens, head_dim), (groups, state_dim) = dtx.shape, b.shape[1::2]
    block_p, width = min(BLOCK_P_CAP, next_power_of_2(head_dim)), next_power_of_2(state_dim)
    return Launch(
        _selective_scan_kernel,
        (batch * heads, cdiv(head_dim, block_p)),
        dict(
            decay_ptr=decay,
            dtx_ptr=dtx,
            b_ptr=b,
            c_ptr=c,
            state_ptr=state,
            out_ptr=out,
            T=tokens,
            H=heads,
            HEADS_PER_GROUP=heads // groups,
            P=head_dim,
            N=state_dim,
            W=width,
            LEVELS=width.bit_length() - 1,
            BLOCK_P=block_p,
        ),
        num_warps=4,
        num_stages=1,
    )


def selective_scan(decay, dtx, b, c, state):
    """(fp32 read [B, H, T, P], the final fp32 state): the scan from ``state``."""
    decay, dtx, b, c = (aligned(t.contiguous()) for t in (decay, dtx, b, c))
    state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes it
    out = torch.empty(dtx.shape, dtype=torch.float32, device=dtx.device)
    selective_scan_launch(decay, dtx, b, c, state, out)()
    return out, state
