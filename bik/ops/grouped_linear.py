"""Grouped linear: every row through its own group's weight (mixture-of-experts expert layers).

Row r of the result is ``x[r] @ weight[groups[r]].T``, computed in the fixed order of
:func:`bik.linear` (ascending K tiles into one fp32 accumulator). A row's bits therefore
depend only on the row and its group's weight: not on how many rows, or which rows, chose the
same group in this call. Rows are sorted by group (a stable sort, so each group keeps its rows
in ascending order), multiplied group by group, and put back in place. A backend with a
grouped kernel (triton) runs every group in one launch; the others run their matmul once per
non-empty group.
"""

import itertools

import torch

from .. import _checks, backends
from ._dispatch import custom_op, run
from .matmul import matmul


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``x [R, K]``, ``weight [G, N, K]`` (nn.Linear layout per group), ``groups [R]`` (int,
    values in [0, G)) -> ``[R, N]`` in x's dtype: row r is ``x[r] @ weight[groups[r]].T``."""
    _checks.floating("x", x)
    _checks.rank("x", x, 2)
    _checks.floating("weight", weight)
    _checks.rank("weight", weight, 3)
    _checks.same_dtype("weight", weight, "x", x)
    _checks.same_device("weight", weight, "x", x)
    _checks.dim_size("weight", weight, 2, x.shape[1], "K, the last dim of x")
    _checks.tensor("groups", groups)
    if groups.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"groups: expected dtype int32 or int64, got {groups.dtype}")
    if groups.shape != (x.shape[0],):
        raise ValueError(f"groups: expected shape ({x.shape[0]},), got {tuple(groups.shape)}")
    _checks.same_device("groups", groups, "x", x)
    if groups.numel():
        _checks.values_in_range("groups", groups, 0, weight.shape[0] - 1, f"G={weight.shape[0]}")
    return run(_grouped_linear_op, _grouped_linear, x, weight, groups)


def _sorted_by_group(groups: torch.Tensor, num_groups: int):
    """(the stable permutation sorting rows by group, offsets [G + 1] of each group's rows)."""
    order = torch.sort(groups, stable=True).indices
    counts = torch.bincount(groups, minlength=num_groups)
    offsets = torch.zeros(num_groups + 1, dtype=torch.int64, device=groups.device)
    offsets[1:] = counts.cumsum(0)
    return order, offsets


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    rows, n = x.shape[0], weight.shape[1]
    if rows == 0 or n == 0:
        return x.new_zeros(rows, n)
    order, offsets = _sorted_by_group(groups, weight.shape[0])
    packed = x[order]
    backend = backends.resolve(x.device, "matmul")
    if backend.grouped_matmul is not None:
        product = backend.grouped_matmul(packed, weight.transpose(1, 2), offsets)
    else:
        product = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        matmul, bounds = backend.kernel("matmul"), offsets.tolist()
        for group, (start, end) in enumerate(itertools.pairwise(bounds)):
            if end > start:
                b = weight[group].t().unsqueeze(0)
                product[start:end] = matmul(packed[start:end].unsqueeze(0), b, None)[0]
    out = torch.empty_like(product)
    out[order] = product
    return out


_grouped_linear_op = custom_op("bik::grouped_linear", _grouped_linear)


@_grouped_linear_op.register_fake
def _(x, weight, groups):
    return x.new_empty(x.shape[0], weight.shape[1])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    # Deterministic, through bik's own fixed orders: grad_x is a grouped linear with each
    # group's weight transposed; grad_weight[g] sums the group's rows in ascending order.
    x, weight, groups = ctx.saved_tensors
    grad = grad.to(x.dtype)
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = run(_grouped_linear_op, _grouped_linear, grad, weight.transpose(1, 2), groups)
    if ctx.needs_input_grad[1]:
        order, offsets = _sorted_by_group(groups, weight.shape[0])
        grad_sorted, x_sorted = grad[order], x[order]
        bounds = offsets.tolist()
        grad_weight = torch.zeros_like(weight)
        for group, (start, end) in enumerate(itertools.pairwise(bounds)):
            if end > start:
                grad_weight[group] = matmul(grad_sorted[start:end].t(), x_sorted[start:end])
    return grad_x, grad_weight, None


_grouped_linear_op.register_autograd(_backward, setup_context=_setup_context)
