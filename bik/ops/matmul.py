"""matmul / linear with one fixed reduction order per output element.

Every backend accumulates each output element over K in ascending, fixed-size K tiles into an
fp32 accumulator (no split-K, no atomics), so a row's result does not depend on how many
other rows share the call. Bias is added in fp32 before the single final rounding.
"""

import torch

from .. import _checks, backends, packed_weights
from ._dispatch import as_rows, custom_op, needs_custom_op, run, shaped


def _validate(a_name, a, b_name, b, bias):
    _checks.floating(a_name, a)
    _checks.floating(b_name, b)
    _checks.rank(a_name, a, (1,))
    _checks.rank(b_name, b, 2)
    _checks.same_dtype(b_name, b, a_name, a)
    _checks.same_device(b_name, b, a_name, a)
    if bias is not None:
        _checks.floating("bias", bias)
        _checks.rank("bias", bias, 1)
        _checks.same_dtype("bias", bias, a_name, a)
        _checks.same_device("bias", bias, a_name, a)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [..., K] @ b [K, N] (+ bias [N])``; ``b`` may be any strided view (e.g. ``w.t()``)."""
    _validate("a", a, "b", b, bias)
    _checks.dim_size("b", b, 0, a.shape[-1], "K, the last dim of a")
    if bias is not None:
        _checks.dim_size("bias", bias, 0, b.shape[1], "N, the last dim of b")
    return run(_matmul_op, _matmul, a, b, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` semantics: ``x [..., K] @ weight[N, K].T (+ bias [N])``."""
    _validate("x", x, "weight", weight, bias)
    _checks.dim_size("weight", weight, 1, x.shape[-1], "K, the last dim of x")
    if bias is not None:
        _checks.dim_size("bias", bias, 0, weight.shape[0], "N, the first dim of weight")
    out = _prepacked(x, weight, bias)
    return run(_matmul_op, _matmul, x, weight.t(), bias) if out is None else out


def _prepacked(x, weight, bias):
    """The product from the weight's packed copy (bik.packed_weights), or None: the weight is
    not marked or not readable, a graph is recorded or traced, or the backend has no packed
    kernel."""
    if (
        not packed_weights.is_marked(weight)
        or not packed_weights.readable(weight)
        or needs_custom_op((x, bias))
    ):
        return None
    rows, n = as_rows(x), weight.shape[0]
    if rows.shape[0] == 0 or n == 0:
        return None
    out = packed_weights._prepacked_linear(rows, weight, bias)
    return None if out is None else shaped(out, (*x.shape[:-1], n))


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Validated ``a [..., K] @ b [K, N]`` through the backend's batched kernel."""
    n = b.shape[1]
    rows = as_rows(a)
    if rows.shape[0] == 0 or n == 0:
        return a.new_zeros(*a.shape[:-1], n)
    out = backends.kernel(a.device, "matmul")(rows, b, bias)
    return shaped(out, (*a.shape[:-1], n))


_matmul_op = custom_op("bik::matmul", _matmul, row_args=(0,))


@_matmul_op.register_fake
def _(a, b, bias):
    return a.new_empty(*a.shape[:-1], b.shape[1])


def _setup_context(ctx, inputs, output):
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    # Each gradient is itself a bik matmul, so it has a fixed reduction order too:
    # grad_b and grad_bias reduce over the rows M in ascending tiles (deterministic). Going
    # through run() keeps them differentiable under backward(create_graph=True).
    a, b = ctx.saved_tensors
    rows, grad_rows = as_rows(a), as_rows(grad).to(a.dtype)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_a = run(_matmul_op, _matmul, grad_rows, b.t(), None).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        grad_b = run(_matmul_op, _matmul, rows.t(), grad_rows, None)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        ones = grad_rows.new_ones(1, grad_rows.shape[0])
        grad_bias = run(_matmul_op, _matmul, ones, grad_rows, None).reshape(b.shape[1])
    return grad_a, grad_b, grad_bias


_matmul_op.register_autograd(_backward, setup_context=_setup_context)
