"""RMSNorm: one row per program, sum of squares over fixed chunks, fp32 math."""

import torch
import triton
import triton.language as tl

from ...contract import row_chunk


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * stride_x, y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    # Lane-wise partial sums over ascending chunks, then one fixed reduction tree (tl.sum).
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


def rms_norm(x, weight, eps):
    """Rows of ``x [R, D]`` normalised; output in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, d = x.shape
    _rms_norm_kernel[(rows,)](
        x, weight.contiguous(), out, d, x.stride(0), out.stride(0), eps, BLOCK=row_chunk(d)
    )
    return out
