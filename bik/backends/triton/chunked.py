"""The tensor-parallel-invariant matmul order on the GPU (``bik.contract.TP_CHUNKS``): K in
C equal chunks, each one chain from zero by the tile kernel's product
(:func:`~bik.backends.triton.matmul._tile_product`), the chunks summed by the balanced
pairwise tree, so a row-parallel layer's result is the same whether its K is split over 1 or
C ranks. One kernel runs the tree in registers; for few output tiles (decode) the chunks run
as programs of their own into fp32 planes, and a second kernel sums the planes by the same
tree (the same additions of the same values).
"""

import torch
import triton
import triton.language as tl

from ...contract import tp_tree_sum
from ._common import Launch, aligned, cdiv, upcast_dot_operands
from .matmul import BLOCK_K, BLOCK_M, BLOCK_N, _tile_product, matmul, multiprocessors


@triton.jit
def _chunk_tree(
    a_ptr,
    b_ptr,
    rows,
    rows_ok,
    cols,
    N,
    chunk_k,
    first,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    COUNT: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 sum of chunks ``first .. first + COUNT - 1`` (``chunk_k`` columns of K each)
    by the balanced pairwise tree: the left half's sum + the right half's. A chunk is one
    :func:`_tile_product` from zero over its own columns (its K tail masked to exact zeros).
    Left before right keeps at most log2(COUNT) + 1 accumulators live."""
    if COUNT == 1:
        offset = (chunk_k * first).to(tl.int64)
        return _tile_product(
            a_ptr + offset * stride_ak,
            b_ptr + offset * stride_bk,
            rows,
            rows_ok,
            cols,
            N,
            chunk_k,
            stride_am,
            stride_ak,
            stride_bk,
            stride_bn,
            UPCAST,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    else:
        half: tl.constexpr = COUNT // 2
        left = _chunk_tree(
            a_ptr, b_ptr, rows, rows_ok, cols, N, chunk_k, first,
            stride_am, stride_ak, stride_bk, stride_bn,
            half, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        right = _chunk_tree(
            a_ptr, b_ptr, rows, rows_ok, cols, N, chunk_k, first + half,
            stride_am, stride_ak, stride_bk, stride_bn,
            half, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        return left + right


@triton.jit(do_not_specialize=["M", "stride_cc", "stride_cm"])
def _chunked_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    chunk_k,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cc,
    stride_cm,
    stride_cn,
    TREE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The TP-invariant order of ``a [M, C * chunk_k] @ b`` in fp32: each program sums TREE
    chunks by the tree in registers, from chunk ``program_id(2)``. TREE = C (a grid axis 2 of
    one): a program per output tile computes every chunk and the whole tree into ``c [M, N]``.
    TREE = 1: a program per (tile, chunk) computes that chunk alone into plane ``c[chunk]`` of
    ``c [C, M, N]``, for :func:`_plane_tree_kernel`."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(2)  # planes: this program's chunk; the tree in registers: 0
    acc = _chunk_tree(
        a_ptr, b_ptr, rows, rows < M, cols, N, chunk_k, first,
        stride_am, stride_ak, stride_bk, stride_bn,
        TREE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    c_ptr += first.to(tl.int64) * stride_cc  # stride_cc is 0 for the tree in registers
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _plane_sum(planes_ptr, offsets, mask, plane_stride, first, COUNT: tl.constexpr):
    """Planes ``first .. first + COUNT - 1`` at ``offsets``, summed by the same balanced
    pairwise tree as :func:`_chunk_tree`'s (the same additions of the same values)."""
    if COUNT == 1:
        base = planes_ptr + (plane_stride * first).to(tl.int64)
        return tl.load(base + offsets, mask=mask, other=0.0)
    else:
        half: tl.constexpr = COUNT // 2
        left = _plane_sum(planes_ptr, offsets, mask, plane_stride, first, half)
        right = _plane_sum(planes_ptr, offsets, mask, plane_stride, first + half, half)
        return left + right


@triton.jit(do_not_specialize=["numel", "plane_stride"])
def _plane_tree_kernel(
    planes_ptr, out_ptr, numel, plane_stride, CHUNKS: tl.constexpr, BLOCK: tl.constexpr
):
    """``out`` (contiguous, ``numel`` elements) = the tree over the CHUNKS contiguous planes."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    total = _plane_sum(planes_ptr, offsets, mask, plane_stride, 0, CHUNKS)
    tl.store(out_ptr + offsets, total, mask=mask)


MAX_CHUNKS = 8
"""Chunks :func:`chunked_matmul` takes (``bik.contract.TP_CHUNKS``): its tree is unrolled at
compile time, and with 16 chunks Triton 3.6 and 3.9 spill the kernel to local memory."""
CHUNKED_NUM_WARPS = 8
"""Two warpgroups per 64 x 64 tile (HGMMA.64x32x16 each): with four, eight chunks' live
accumulators and operands spill (tests/backends/test_sm90.py)."""


PLANE_TREE_BLOCK = 1024  # elements per program of the plane tree (elementwise: any width)


def chunked_launches(a, b, chunks, out, planes: bool) -> list[Launch]:
    """The launches computing ``out [M, N]`` (fp32) = the ``chunks``-chunk order of
    ``a [M, K] @ b [K, N]`` (16-bit): one (the tree in registers), or, with ``planes``, the
    chunks into fp32 planes and then their tree."""
    m, k = a.shape
    n = b.shape[1]
    tiles = (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))
    target = out.new_empty(chunks, m, n) if planes else out
    args = dict(
        a_ptr=a,
        b_ptr=b,
        c_ptr=target,
        M=m,
        N=n,
        chunk_k=k // chunks,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cc=m * n if planes else 0,
        stride_cm=target.stride(-2),
        stride_cn=target.stride(-1),
        TREE=1 if planes else chunks,
        UPCAST=upcast_dot_operands(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    grid = (*tiles, chunks if planes else 1)
    launches = [Launch(_chunked_kernel, grid, args, num_warps=CHUNKED_NUM_WARPS)]
    if planes:
        tree_args = dict(
            planes_ptr=target,
            out_ptr=out,
            numel=m * n,
            plane_stride=m * n,
            CHUNKS=chunks,
            BLOCK=PLANE_TREE_BLOCK,
        )
        launches.append(Launch(_plane_tree_kernel, (cdiv(m * n, PLANE_TREE_BLOCK),), tree_args))
    return launches


def chunked_matmul(a, b, chunks, planes: bool | None = None):
    """``a [M, K] @ b [K, N]`` (any strides) -> fp32 ``[M, N]``: K in ``chunks`` equal chunks,
    each one chain from zero, summed by the balanced pairwise tree.

    16-bit inputs: each chunk is the tile kernel's tensor-core MMA chain on the inputs as they
    are (:func:`_chunked_kernel`). Where the output has fewer 64 x 64 tiles than the GPU has
    SMs (decode), the chunks run as programs of their own into fp32 planes and a second
    kernel sums them, rather than one program per tile running its chunks in turn: the same
    chains and the same additions, so the same bits (``planes``: None picks by that rule,
    True / False force it). fp32: each chunk is a tile-kernel matmul (IEEE fma: what every
    backend's chunk is), tree-summed here (an fp32 chunked kernel would spill its operands)."""
    if chunks > MAX_CHUNKS:
        raise ValueError(
            f"chunks: the triton backend's chunked kernel takes up to {MAX_CHUNKS}, got {chunks}"
        )
    if a.dtype == torch.float32:
        step = a.shape[1] // chunks
        return tp_tree_sum(
            [matmul(a[:, i * step : (i + 1) * step], b[i * step : (i + 1) * step], None)
             for i in range(chunks)]
        )  # fmt: skip
    m, n = a.shape[0], b.shape[1]
    if planes is None:
        planes = cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N) < multiprocessors(a.device)
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    for launch in chunked_launches(aligned(a), aligned(b), chunks, out, planes):
        launch()
    return out
