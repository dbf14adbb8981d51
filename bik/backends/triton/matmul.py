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

Their tile products are shared: the grouped (mixture-of-experts) kernels of
:mod:`bik.backends.triton.grouped` and the tensor-parallel-invariant chunks of
:mod:`bik.backends.triton.chunked` run them.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...contract import MATMUL_BLOCK_K
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
def multiprocessors(device: torch.device) -> int:
    """Programs a persistent launch keeps resident: the GPU's SMs (read once per device)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return HOPPER_SMS if device.type == "meta" else 4  # the interpreter: a few, to test the loop


def _programs(device: torch.device, tiles: int) -> int:
    return min(tiles, multiprocessors(device))


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


def run_linear(x, weight, bias, bucket: TokenBucket) -> torch.Tensor:
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
    single = run_linear(x, weight, bias, TOKEN_BUCKETS[0])
    return all(
        torch.equal(run_linear(x[: b.max_rows or rows], weight, bias, b), single[: b.max_rows])
        for b in ALL_BUCKETS[1:]
    )


BUCKETS_CHECK = SelfCheck("the token buckets (the single-row one is the plain launch)")


def bucket_for(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> TokenBucket:
    """The token bucket for ``rows`` once :func:`buckets_agree` has passed for this (N, K,
    dtype) on the device; the single-row bucket for every row count if it failed."""
    chosen = token_bucket(rows, weight.shape[0], multiprocessors(weight.device))
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
        out = run_linear(x, weight, bias, bucket_for(x.shape[0], weight, bias))
        return out if flat else out.reshape(*a.shape[:-1], -1)
    if a.dim() == 2:  # the tile kernel's layout has a batch dim
        return matmul(a.unsqueeze(0), b.unsqueeze(0), bias)[0]
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    matmul_launch(aligned(a), aligned(b), bias if bias is None else aligned(bias), out)()
    return out
