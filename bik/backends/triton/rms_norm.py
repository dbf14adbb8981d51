"""RMSNorm: one row per program, fp32 math, one rounding to the output dtype.

A row of up to :data:`~bik.contract.RMS_NORM_ONE_PASS` elements stays in registers: x is
read once, y written once. A longer row is read twice in chunks of
:data:`~bik.contract.ROW_CHUNK_CAP` (sum of squares, then the scaled write).

Every compile-time choice is a function of the row length D (and the dtypes) alone, never of
the number of rows, because the reduction tree follows the register layout Triton derives from
them: D and the block width are constexprs, ``num_warps`` comes from the block width, and the
row stride is passed in units of :func:`~._rows.vector_width` elements (not specialised), so
the compiler can prove every row starts 16-byte aligned whatever the batch.
"""

import torch
import triton
import triton.language as tl

from ...contract import RMS_NORM_ONE_PASS, ROW_CHUNK_CAP, row_chunk
from ._common import I32, Launch, aligned, alignments
from ._rows import kernel_rows, stride_in_vectors, vector_width


@triton.jit(do_not_specialize=["stride_x"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_x,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # x's row stride arrives in units of VEC elements: the product is provably VEC-aligned,
    # so the loads vectorise the same way for every batch. y is contiguous (row stride D).
    x_row = x_ptr + row * stride_x * VEC
    y_row = y_ptr + row * D
    cols = tl.arange(0, BLOCK)
    if BLOCK >= D:
        # One pass: the row lives in registers. Its sum of squares is one fixed tree (tl.sum:
        # each thread's elements in register order, then lanes, then warps); the tree's shape
        # follows the layout, which BLOCK, num_warps and VEC (all functions of D) fix.
        ok = cols < D
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        # Two passes: lane-wise partial sums over ascending chunks, then one fixed tree across
        # the lanes; the second pass reads the row again to write it.
        squares = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, D, BLOCK):
            x = tl.load(x_row + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
            squares += x * x
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
        for c0 in range(0, D, BLOCK):
            ok = c0 + cols < D
            x = tl.load(x_row + c0 + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c0 + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_row + c0 + cols, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=ok)


def block_and_warps(d: int, one_pass: int = RMS_NORM_ONE_PASS) -> tuple[int, int]:
    """(block width, num_warps) for rows of ``d`` elements: the whole row (next power of two)
    up to ``one_pass`` (a power of two), else chunks of :data:`~bik.contract.ROW_CHUNK_CAP`
    (or ``one_pass`` if narrower). ``block / 512`` warps, so 16 elements per thread (two
    16-byte bf16 loads), up to 16 warps (32 elements per thread at 16384). A function of
    ``d`` only."""
    assert one_pass & (one_pass - 1) == 0, "one_pass: expected a power of two"
    block = row_chunk(d, cap=one_pass if d <= one_pass else min(one_pass, ROW_CHUNK_CAP))
    return block, min(16, max(1, block // 512))


def rms_norm_launch(x, weight, out, eps, one_pass: int = RMS_NORM_ONE_PASS) -> Launch:
    """The launch computing ``out [R, D] = rms_norm(x [R, D], weight [D])`` (``out``
    contiguous, ``x`` as :func:`~._rows.kernel_rows` returns it). Works on meta tensors.
    ``one_pass`` is the widest row kept in registers (tests shrink it)."""
    rows, d = x.shape
    block, warps = block_and_warps(d, one_pass)
    vec = vector_width(d, x.dtype)
    assert out.is_contiguous() and out.shape == x.shape
    stride = stride_in_vectors(x, vec)
    tensors = (x, weight, out)
    return Launch(
        _rms_norm_kernel,
        (rows,),
        dict(
            x_ptr=x,
            w_ptr=weight,
            y_ptr=out,
            stride_x=stride,
            eps=float(eps),  # one binary whatever number type the caller passed
            D=d,
            BLOCK=block,
            VEC=vec,
        ),
        num_warps=warps,
        num_stages=1,
        plan_key=(
            tuple(t.dtype for t in tensors),
            alignments(*tensors),
            stride in I32,
            d,
            block,
            vec,
        ),
    )


def rms_norm(x, weight, eps, one_pass: int = RMS_NORM_ONE_PASS):
    """Rows of ``x [R, D]`` normalised; output in x's dtype."""
    x, _ = kernel_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_launch(x, aligned(weight.contiguous()), out, eps, one_pass)()
    return out
