"""Batch-invariant matmul: one fp32 accumulator per output element, fed in ascending K.

Two kernels; which one runs depends on the dtype and the weight's layout alone, never on the
number of rows, so a row's bits do not change with the batch:

- ``_linear_kernel`` (bf16 / fp16, one weight for every row, stored K-contiguous as
  ``nn.Linear`` keeps it, rows that TMA can describe): persistent, fed by TMA (tensor
  descriptors), software pipelined. Operands are swapped so that the weight is the MMA's M
  side (``BLOCK_W`` output features, 64 per warpgroup) and the tokens its N side
  (``BLOCK_T``). The row count (and whether the weight is wider than one wave of tiles)
  picks a token bucket (:data:`TOKEN_BUCKETS`) that changes only the tile, warps and stages;
  each output element is still one accumulator over the same ascending K tiles. On Hopper
  every bucket compiles to ``HGMMA.64xNx16`` with N from 16 to 256
  (tests/backends/test_sm90.py). No document promises that the instruction's shape cannot
  change an element's bits, so the interpreter tests compare every bucket with single-row
  runs, and on a GPU :func:`buckets_agree` checks it once per (N, K, dtype) before first use
  and falls back to the single-row bucket for every row count if it fails.
- ``_matmul_kernel`` (every other case: fp32, per-batch weights, N-contiguous ``b``, strides
  TMA cannot take): fixed 64 x 64 tiles, the same for every M.

The grouped (mixture-of-experts) kernels reuse them: ``_grouped_linear_kernel`` runs
``_linear_kernel``'s tile product (:func:`_swapped_tile`) for 16-bit experts that TMA can
describe, ``_grouped_matmul_kernel`` the tile kernel's (:func:`_tile_product`) otherwise.
"""

import functools
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...contract import MATMUL_BLOCK_K, tp_tree_sum
from ._common import (
    ALIGNMENT,
    I32,
    Launch,
    SelfCheck,
    aligned,
    alignments,
    cdiv,
    dot_acc,
    tma_descriptor,
    upcast_dot_operands,
)

# One configuration for every M: a row's K-order can never depend on the batch size.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, MATMUL_BLOCK_K


class TokenBucket(NamedTuple):
    """The launch shape of ``_linear_kernel`` for up to ``max_rows`` rows (``None``: any):
    ``block_t`` tokens by ``block_w`` output features a tile."""

    max_rows: int | None
    block_t: int
    num_warps: int
    num_stages: int
    # Output features a tile (the MMA's M side: 64 per warpgroup). A feature's accumulator
    # runs over the same K tiles whatever the tile's width, so a fused projection (q/k/v in
    # one weight, as vLLM keeps it) gives each feature the bits of the separate ones.
    block_w: int = 64


# The row count picks a bucket: a narrow token tile for decode, 128 x 256 tiles (two
# warpgroups of HGMMA.64x256x16) for prefill and training. A weight wider than one wave of
# 64-feature tiles takes its bucket's wide variant (WIDE_WEIGHT_BUCKETS): deeper pipelines at
# decode, 128-feature tiles at 65-128 rows. Chosen from side-by-side timings on an H200
# (benchmarks/gpu_probe.py); the weight side and the K order are the same in every bucket.
TOKEN_BUCKETS = (
    TokenBucket(16, 16, 4, 4),
    TokenBucket(32, 32, 4, 4),
    TokenBucket(64, 64, 4, 4),
    TokenBucket(128, 128, 4, 4),
    TokenBucket(512, 128, 8, 4, 128),
    TokenBucket(None, 256, 8, 3, 128),
)
WIDE_WEIGHT_BUCKETS: dict[int | None, TokenBucket] = {  # by max_rows: its wide variant
    16: TokenBucket(16, 16, 4, 8),
    32: TokenBucket(32, 32, 4, 8),
    64: TokenBucket(64, 64, 4, 6),
    128: TokenBucket(128, 128, 8, 4, 128),
}
ALL_BUCKETS = TOKEN_BUCKETS + tuple(WIDE_WEIGHT_BUCKETS.values())
WIDE_TILE_FEATURES = 64  # a weight is wide when it has more tiles of this many than SMs
LINEAR_BLOCK_K = 64  # K tile of _linear_kernel: 128-byte rows in bf16, TMA's widest swizzle
GROUP_T = 8  # token tiles visited together, so a weight tile is reused from L2
HOPPER_SMS = 132  # programs of a persistent launch described without a device (H100 SXM)


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


@triton.jit
def _swapped_tile(
    w_desc,
    x_desc,
    w0,
    t0,
    K,
    UPCAST: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 ``w[w0 : w0 + BLOCK_W] @ x[t0 : t0 + BLOCK_T]^T`` from two TMA descriptors. The
    only reduction: ascending BLOCK_K tiles into one fp32 accumulator. TMA fills out-of-range
    K with zeros, which add exact zeros at the same place for every row."""
    acc = tl.zeros((BLOCK_W, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([w0, k0])
        x = x_desc.load([t0, k0])
        acc = dot_acc(w, tl.trans(x), acc, UPCAST)
    return acc


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_kernel(
    w_desc,
    x_desc,
    out_desc,
    bias_ptr,
    M,
    N,
    K,
    num_programs,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_T: tl.constexpr,
):
    """``out [M, N] = x [M, K] @ w [N, K]^T (+ bias)``, computed as ``w @ x^T`` tile by tile.

    Persistent: program p takes tiles p, p + num_programs, ...; which program computes a tile
    never changes how. Tiles are visited in groups of GROUP_T token tiles per weight tile.
    """
    w_tiles = tl.cdiv(N, BLOCK_W)
    tiles = w_tiles * tl.cdiv(M, BLOCK_T)
    for tile in tl.range(tl.program_id(0), tiles, num_programs, flatten=True):
        group_first = tile // (GROUP_T * w_tiles) * GROUP_T
        group_size = tl.minimum(tl.cdiv(M, BLOCK_T) - group_first, GROUP_T)
        in_group = tile % (GROUP_T * w_tiles)
        t0 = (group_first + in_group % group_size) * BLOCK_T
        w0 = in_group // group_size * BLOCK_W
        acc = _swapped_tile(w_desc, x_desc, w0, t0, K, UPCAST, BLOCK_W, BLOCK_T, BLOCK_K)
        if HAS_BIAS:  # epilogue in fp32, then the one rounding to the output dtype
            features = w0 + tl.arange(0, BLOCK_W)
            bias = tl.load(bias_ptr + features, mask=features < N, other=0.0)
            acc += bias.to(tl.float32)[:, None]
        out_desc.store([t0, w0], tl.trans(acc).to(out_desc.dtype))


def token_bucket(rows: int, features: int = 0, multiprocessors: int = HOPPER_SMS) -> TokenBucket:
    """The bucket ``rows`` rows run in, for a weight of ``features`` output features on a
    GPU of ``multiprocessors`` SMs."""
    bucket = next(b for b in TOKEN_BUCKETS if b.max_rows is None or rows <= b.max_rows)
    if cdiv(features, WIDE_TILE_FEATURES) > multiprocessors:
        return WIDE_WEIGHT_BUCKETS.get(bucket.max_rows, bucket)
    return bucket


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Programs a persistent launch keeps resident: the GPU's SMs (read once per device)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return HOPPER_SMS if device.type == "meta" else 4  # the interpreter: a few, to test the loop


def _programs(device: torch.device, tiles: int) -> int:
    return min(tiles, _multiprocessors(device))


def linear_launch(x, weight, bias, out, bucket: TokenBucket) -> Launch:
    """The launch computing ``out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N])``."""
    rows, k = x.shape
    n = weight.shape[0]

    tiles = cdiv(n, bucket.block_w) * cdiv(rows, bucket.block_t)
    programs = _programs(x.device, tiles)
    tensors = (weight, x, out, weight if bias is None else bias)
    return Launch(
        _linear_kernel,
        (programs,),
        dict(
            w_desc=tma_descriptor(weight, [bucket.block_w, LINEAR_BLOCK_K]),
            x_desc=tma_descriptor(x, [bucket.block_t, LINEAR_BLOCK_K]),
            out_desc=tma_descriptor(out, [bucket.block_t, bucket.block_w]),
            bias_ptr=bias if bias is not None else weight,
            M=rows,
            N=n,
            K=k,
            num_programs=programs,
            HAS_BIAS=bias is not None,
            UPCAST=upcast_dot_operands(x.dtype),
            BLOCK_W=bucket.block_w,
            BLOCK_T=bucket.block_t,
            BLOCK_K=LINEAR_BLOCK_K,
            GROUP_T=GROUP_T,
        ),
        num_warps=bucket.num_warps,
        num_stages=bucket.num_stages,
        plan_key=(
            bucket,
            tuple(t.dtype for t in tensors),
            alignments(*tensors),
            bias is None,
            n,
            k,
            rows in I32,
            programs in I32,
        ),
    )


def takes_tma(weight: torch.Tensor) -> bool:
    """Whether ``weight [N, K]`` suits ``_linear_kernel``: 16-bit (fp32's IEEE dot runs on FMA
    units, and at these tiles it spills and outgrows shared memory), K-contiguous, and rows
    (its own, and the activations' and outputs') whose strides are multiples of 16 bytes."""
    size = weight.element_size()
    return (
        size == 2
        and weight.stride(1) == 1
        and (weight.stride(0) * size) % ALIGNMENT == 0
        and (weight.shape[1] * size) % ALIGNMENT == 0
        and (weight.shape[0] * size) % ALIGNMENT == 0
    )


def _run_linear(x, weight, bias, bucket: TokenBucket) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    linear_launch(x, weight, bias, out, bucket)()
    return out


def buckets_agree(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether every token bucket gives each row the bits the single-row bucket gives it, for
    this weight's (N, K, dtype): random rows through each bucket against the smallest."""
    # one more than the largest bounded bucket: reaches the last one
    rows = max(b.max_rows for b in ALL_BUCKETS if b.max_rows is not None) + 1
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(rows, weight.shape[1], generator=generator, device=weight.device)
    x = x.to(weight.dtype)
    single = _run_linear(x, weight, bias, TOKEN_BUCKETS[0])
    return all(
        torch.equal(_run_linear(x[: b.max_rows or rows], weight, bias, b), single[: b.max_rows])
        for b in ALL_BUCKETS[1:]
    )


BUCKETS_CHECK = SelfCheck("the token buckets (the single-row one is the plain launch)")


def _bucket(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> TokenBucket:
    """The token bucket for ``rows`` once :func:`buckets_agree` has passed for this (N, K,
    dtype) on the device; the single-row bucket for every row count if it failed."""
    chosen = token_bucket(rows, weight.shape[0], _multiprocessors(weight.device))
    key = (*weight.shape, weight.dtype)
    if BUCKETS_CHECK.allows(key, weight.device, lambda: buckets_agree(weight, bias)):
        return chosen
    return TOKEN_BUCKETS[0]


def matmul_launch(a, b, bias, out) -> Launch:
    """The launch computing ``out [B, M, N] = a [B, M, K] @ b [B or 1, K, N] (+ bias [N])``."""
    batch, m, k = a.shape
    n = b.shape[2]
    return Launch(
        _matmul_kernel,
        (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N), batch),
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
    """``a [B, M, K] @ b [B or 1, K, N] (+ bias [N])`` -> ``[B, M, N]`` in a's dtype, or
    ``a [M, K] @ b [K, N]`` -> ``[M, N]``."""
    k = a.shape[-1]
    weight = b.t() if b.dim() == 2 else b[0].t()  # [N, K]
    if (b.dim() == 2 or b.shape[0] == 1) and takes_tma(weight):
        flat = a.dim() == 2  # the ops' rows: no reshape either way (a view costs ~0.5 us)
        x = aligned((a if flat else a.reshape(-1, k)).contiguous())
        weight, bias = aligned(weight), bias if bias is None else aligned(bias)
        out = _run_linear(x, weight, bias, _bucket(x.shape[0], weight, bias))
        return out if flat else out.reshape(*a.shape[:-1], -1)
    if a.dim() == 2:  # the tile kernel's layout has a batch dim
        return matmul(a.unsqueeze(0), b.unsqueeze(0), bias)[0]
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    matmul_launch(aligned(a), aligned(b), bias if bias is None else aligned(bias), out)()
    return out


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
        planes = cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N) < _multiprocessors(a.device)
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    for launch in chunked_launches(aligned(a), aligned(b), chunks, out, planes):
        launch()
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
            out[start:end] = _run_linear(x[start:end], weight[group], None, TOKEN_BUCKETS[0])
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
    bucket = _bucket(cdiv(rows, weight.shape[0]), weight[0], None)
    grouped_linear_launch(x, weight, offsets, out, bucket)()
    return out
