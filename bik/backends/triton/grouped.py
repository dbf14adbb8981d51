"""Grouped (mixture-of-experts) matmul: rows ``offsets[g]:offsets[g+1]`` through group g's
weight, one launch for every group, each row tile inside one group's rows.

The kernels reuse the plain matmul's tile products, so a row gets the bits it would get
through its group's weight alone: ``_grouped_linear_kernel`` runs ``_linear_kernel``'s
(:func:`~bik.backends.triton.matmul._swapped_tile`) for 16-bit experts that TMA can
describe, ``_grouped_matmul_kernel`` the tile kernel's
(:func:`~bik.backends.triton.matmul._tile_product`) otherwise.
"""

import itertools

import torch
import triton
import triton.language as tl

from ._common import Launch, SelfCheck, aligned, cdiv, tma_descriptor, upcast_dot_operands
from .matmul import (
    ALL_BUCKETS,
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    LINEAR_BLOCK_K,
    TOKEN_BUCKETS,
    TokenBucket,
    _swapped_tile,
    _tile_product,
    bucket_for,
    run_linear,
    takes_tma,
)


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


def _row_tiles(offsets, rows, block):
    """Tiles of ``block`` rows that never straddle two groups, as (group, first row, end row)
    per tile, padded with group -1 up to a bound known without reading ``offsets`` on the
    host: sum(ceil(count / block)) <= ceil(rows / block) + groups."""
    groups = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block - 1) // block
    tile_end = tiles.cumsum(0)
    index = torch.arange(cdiv(rows, block) + groups, device=offsets.device)
    group = torch.searchsorted(tile_end, index, right=True)
    used = group < groups
    group = group.clamp(max=groups - 1)
    start = offsets[group] + (index - (tile_end[group] - tiles[group])) * block
    end = offsets[group + 1]
    return torch.where(used, group, -1), start, end


def grouped_matmul_launch(a, b, offsets, out) -> Launch:
    """The launch computing rows ``offsets[g]:offsets[g+1]`` of ``out [R, N]`` as those rows of
    ``a [R, K]`` times ``b[g] [K, N]`` (``b [G, K, N]``, any strides)."""
    rows, k = a.shape
    n = b.shape[2]
    tile_group, tile_start, tile_end = _row_tiles(offsets, rows, BLOCK_M)
    return Launch(
        _grouped_matmul_kernel,
        (tile_group.numel(), cdiv(n, BLOCK_N)),
        dict(
            a_ptr=a,
            b_ptr=b,
            c_ptr=out,
            tile_group_ptr=tile_group,
            tile_start_ptr=tile_start,
            tile_end_ptr=tile_end,
            N=n,
            K=k,
            stride_am=a.stride(0),
            stride_ak=a.stride(1),
            stride_bg=b.stride(0),
            stride_bk=b.stride(1),
            stride_bn=b.stride(2),
            stride_cm=out.stride(0),
            stride_cn=out.stride(1),
            UPCAST=upcast_dot_operands(a.dtype),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        ),
    )


@triton.jit
def _grouped_linear_kernel(
    w_desc,
    x_desc,
    out_ptr,
    tile_group_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    K,
    stride_om,
    UPCAST: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row tile i (inside one group's rows, as in _grouped_matmul_kernel) times feature tile j
    of its group's weight, by _linear_kernel's own tile product: the weight is ``[G * N, K]``,
    group g's features rows ``g * N ..``. A tile that runs past the group's rows (or past its
    N features into the next group's) computes values that are never stored: every output
    element is its own accumulator."""
    tile = tl.program_id(0)
    group = tl.load(tile_group_ptr + tile)
    if group < 0:
        return
    start = tl.load(tile_start_ptr + tile).to(tl.int32)
    end = tl.load(tile_end_ptr + tile).to(tl.int32)
    w0 = tl.program_id(1) * BLOCK_W
    acc = _swapped_tile(
        w_desc, x_desc, group.to(tl.int32) * N + w0, start, K, UPCAST, BLOCK_W, BLOCK_T, BLOCK_K
    )
    features = w0 + tl.arange(0, BLOCK_W)
    rows = start + tl.arange(0, BLOCK_T)
    ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_om + features[:, None]
    mask = (features[:, None] < N) & (rows[None, :] < end)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def grouped_takes_tma(weight: torch.Tensor) -> bool:
    """Whether ``weight [G, N, K]`` suits ``_grouped_linear_kernel``: each group's weight suits
    ``_linear_kernel`` (:func:`takes_tma`) and the groups lie one after another (one ``[G * N,
    K]`` descriptor)."""
    return takes_tma(weight[0]) and weight.stride(0) == weight.shape[1] * weight.stride(1)


def grouped_linear_launch(x, weight, offsets, out, bucket: TokenBucket) -> Launch:
    """The launch computing rows ``offsets[g]:offsets[g+1]`` of ``out [R, N]`` as those rows of
    ``x [R, K]`` times ``weight[g] [N, K]^T`` (``weight [G, N, K]`` with
    :func:`grouped_takes_tma`), in ``bucket``'s tile."""
    rows, k = x.shape
    groups, n = weight.shape[:2]
    stacked = weight.as_strided((groups * n, k), (weight.stride(1), 1))
    tile_group, tile_start, tile_end = _row_tiles(offsets, rows, bucket.block_t)
    return Launch(
        _grouped_linear_kernel,
        (tile_group.numel(), cdiv(n, bucket.block_w)),
        dict(
            w_desc=tma_descriptor(stacked, [bucket.block_w, LINEAR_BLOCK_K]),
            x_desc=tma_descriptor(x, [bucket.block_t, LINEAR_BLOCK_K]),
            out_ptr=out,
            tile_group_ptr=tile_group,
            tile_start_ptr=tile_start,
            tile_end_ptr=tile_end,
            N=n,
            K=k,
            stride_om=out.stride(0),
            UPCAST=upcast_dot_operands(x.dtype),
            BLOCK_W=bucket.block_w,
            BLOCK_T=bucket.block_t,
            BLOCK_K=LINEAR_BLOCK_K,
        ),
        num_warps=bucket.num_warps,
        num_stages=bucket.num_stages,
    )


def grouped_agrees(weight: torch.Tensor) -> bool:
    """Whether ``_grouped_linear_kernel`` gives rows of up to three of ``weight``'s groups, in
    every token bucket, the bits the single-row linear bucket gives them through their
    group's weight alone (rows split unevenly: one, a third, the rest)."""
    weight = weight[:3]
    rows = max(b.max_rows for b in ALL_BUCKETS if b.max_rows is not None) + 1
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(rows, weight.shape[2], generator=generator, device=weight.device)
    x = x.to(weight.dtype)
    bounds = [0, 1, rows // 3, rows][: weight.shape[0]] + [rows]
    offsets = torch.tensor(bounds, dtype=torch.int64, device=weight.device)
    expected = _per_group_linear(x, weight, bounds)
    for bucket in ALL_BUCKETS:
        got = torch.empty_like(expected)
        grouped_linear_launch(x, weight, offsets, got, bucket)()
        if not torch.equal(got, expected):
            return False
    return True


def _per_group_linear(x, weight, bounds: list[int]) -> torch.Tensor:
    """The plain launch of the grouped linear: each group's rows through the single-row linear
    bucket with its weight, one launch per group (``bounds`` read on the host)."""
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    for group, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[start:end] = run_linear(x[start:end], weight[group], None, TOKEN_BUCKETS[0])
    return out


GROUPED_CHECK = SelfCheck("the grouped linear kernel", capturable=False)


def grouped_matmul(a, b, offsets):
    """Rows ``offsets[g]:offsets[g+1]`` of ``a [R, K]`` times ``b[g] [K, N]`` (``b [G, K, N]``,
    any strides) -> ``[R, N]`` in a's dtype.

    A ``b`` that is the transpose of a 16-bit ``[G, N, K]`` weight TMA can read (the
    nn.Linear layout per expert, as transformers and vLLM keep experts) runs
    ``_grouped_linear_kernel``: each row gets the bits :func:`matmul` gives it through its
    group's weight alone (``_linear_kernel``), in the token bucket of the mean rows per group
    (any bucket gives the same bits: :func:`buckets_agree`, checked once per shape as for a
    linear); on a GPU :func:`grouped_agrees` checks that once per (N, K, dtype) before first
    use, and if it fails the groups run one linear each. Other layouts and fp32 run the tile
    kernel's 64 x 64 tiles."""
    rows, n = a.shape[0], b.shape[2]
    weight = b.transpose(1, 2)
    if not grouped_takes_tma(weight):
        out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
        grouped_matmul_launch(aligned(a), aligned(b), offsets, out)()
        return out
    x, weight = aligned(a.contiguous()), aligned(weight)
    key = (*weight.shape[1:], weight.dtype)
    if not GROUPED_CHECK.allows(key, weight.device, lambda: grouped_agrees(weight)):
        return _per_group_linear(x, weight, offsets.tolist())
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    bucket = bucket_for(cdiv(rows, weight.shape[0]), weight[0], None)
    grouped_linear_launch(x, weight, offsets, out, bucket)()
    return out
