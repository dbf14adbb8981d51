"""RMSNorm over the last dim: one row at a time, fixed chunk order, fp32 math.

Backends reduce each row's sum of squares in a fixed order over fixed-size chunks whose size
depends only on the row length D, never on the number of rows.
"""

import torch

from .. import _checks, backends
from ..backends import reference
from . import _recompute, as_rows, run, shaped


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` in fp32, returned in x's dtype."""
    _checks.floating("x", x)
    _checks.rank("x", x, (1,))
    _checks.floating("weight", weight)
    _checks.rank("weight", weight, 1)
    _checks.same_device("weight", weight, "x", x)
    _checks.dim_size("weight", weight, 0, x.shape[-1], "D, the last dim of x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
    return run(_RMSNorm, x, weight, float(eps))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        rows = as_rows(x)
        if rows.numel() == 0:
            return torch.empty_like(x)
        return shaped(backends.resolve(x.device).rms_norm(rows, weight, eps), x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        formula = lambda x_, w_: reference.rms_norm(x_, w_, ctx.eps)
        grad_x, grad_w = _recompute.grads(formula, (x, weight), ctx.needs_input_grad[:2], grad)
        return grad_x, grad_w, None
