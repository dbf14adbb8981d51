"""Batch-invariant matmul: fixed tiles, ascending BLOCK_K loop, one fp32 accumulator.

The plain and the grouped (mixture-of-experts) kernel share one tile loop,
:func:`_tile_product`, so an output element gets the same instructions in the same order in
both: only where a tile's rows and weight matrix come from differs.
"""

import torch
import triton
import triton.language as tl

from ...contract import MATMUL_BLOCK_K
from ._common import Launch, aligned, dot_acc, upcast_dot_operands

# One configuration for every M: a row's K-order can never depend on the batch size.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, MATMUL_BLOCK_K


@triton.jit
def _tile_product(
    a_ptr,
    b_ptr,
    rows,
    rows_ok,
    cols,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 ``a[rows, :] @ b[:, cols]``. The only reduction: over K, in ascending BLOCK_K
    tiles into one fp32 accumulator. Out-of-range K entries load as 0 and add exact zeros at
    the same place for every row."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc = dot_acc(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["M", "stride_ab", "stride_cb"])
def _matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(
        a_ptr + batch * stride_ab,
        b_ptr + batch * stride_bb,
        rows,
        rows < M,
        cols,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        UPCAST,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if HAS_BIAS:  # epilogue in fp32, then the one rounding to the output dtype
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul_launch(a, b, bias, out) -> Launch:
    """The launch computing ``out [B, M, N] = a [B, M, K] @ b [B or 1, K, N] (+ bias [N])``."""
    batch, m, k = a.shape
    n = b.shape[2]
    return Launch(
        _matmul_kernel,
        (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), batch),
        dict(
            a_ptr=a,
            b_ptr=b,
            bias_ptr=bias if bias is not None else a,
            c_ptr=out,
            M=m,
            N=n,
            K=k,
            stride_ab=a.stride(0),
            stride_am=a.stride(1),
            stride_ak=a.stride(2),
            stride_bb=b.stride(0) if b.shape[0] > 1 else 0,
            stride_bk=b.stride(1),
            stride_bn=b.stride(2),
            stride_cb=out.stride(0),
            stride_cm=out.stride(1),
            stride_cn=out.stride(2),
            HAS_BIAS=bias is not None,
            UPCAST=upcast_dot_operands(a.dtype),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        ),
    )


def matmul(a, b, bias):
    """``a [B, M, K] @ b [B or 1, K, N] (+ bias [N])`` -> ``[B, M, N]`` in a's dtype."""
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    matmul_launch(aligned(a), aligned(b), bias if bias is None else aligned(bias), out)()
    return out


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    tile_group_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One launch for every group: each row tile lies inside one group's rows, a spare tile
    # (the grid is an upper bound, so the host never waits for the tile count) exits at once.
    tile = tl.program_id(0)
    group = tl.load(tile_group_ptr + tile).to(tl.int64)
    if group < 0:
        return
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    end = tl.load(tile_end_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _tile_product(
        a_ptr,
        b_ptr + group * stride_bg,
        rows,
        rows < end,
        cols,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        UPCAST,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N)
    )


def _row_tiles(offsets, rows):
    """Tiles of BLOCK_M rows that never straddle two groups, as (group, first row, end row)
    per tile, padded with group -1 up to a bound known without reading ``offsets`` on the
    host: sum(ceil(count / BLOCK_M)) <= ceil(rows / BLOCK_M) + groups."""
    groups = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tiles.cumsum(0)
    index = torch.arange(triton.cdiv(rows, BLOCK_M) + groups, device=offsets.device)
    group = torch.searchsorted(tile_end, index, right=True)
    used = group < groups
    group = group.clamp(max=groups - 1)
    start = offsets[group] + (index - (tile_end[group] - tiles[group])) * BLOCK_M
    end = offsets[group + 1]
    return torch.where(used, group, -1), start, end


def grouped_matmul(a, b, offsets):
    """Rows ``offsets[g]:offsets[g+1]`` of ``a [R, K]`` times ``b[g] [K, N]`` (``b [G, K, N]``,
    any strides) -> ``[R, N]`` in a's dtype."""
    rows, k = a.shape
    n = b.shape[2]
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    tile_group, tile_start, tile_end = _row_tiles(offsets, rows)
    grid = (tile_group.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_matmul_kernel[grid](
        a,
        b,
        out,
        tile_group,
        tile_start,
        tile_end,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        UPCAST=upcast_dot_operands(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
