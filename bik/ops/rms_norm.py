"""RMSNorm over the last dim: one row at a time, fixed chunk order, fp32 math.

Backends reduce each row's sum of squares in a fixed order over fixed-size chunks whose size
depends only on the row length D, never on the number of rows.
"""

import torch

from .. import _checks, backends
from ..backends import reference
from . import _recompute
from ._dispatch import as_rows, custom_op, run, shaped


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` in fp32, returned in x's dtype."""
    _checks.floating("x", x)
    _checks.rank("x", x, (1,))
    _checks.floating("weight", weight)
    _checks.rank("weight", weight, 1)
    _checks.same_device("weight", weight, "x", x)
    _checks.dim_size("weight", weight, 0, x.shape[-1], "D, the last dim of x")
    eps = _checks.non_negative_number("eps", eps)
    return run(_rms_norm_op, _rms_norm, x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = as_rows(x)
    if rows.numel() == 0:
        return x.new_empty(x.shape)
    return shaped(backends.kernel(x.device, "rms_norm")(rows, weight, eps), x.shape)


_rms_norm_op = custom_op("bik::rms_norm", _rms_norm, row_args=(0,))


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    formula = lambda x_, w_: reference.rms_norm(x_, w_, ctx.eps)
    grad_x, grad_w = _recompute.grads(formula, (x, weight), ctx.needs_input_grad[:2], grad)
    return grad_x, grad_w, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_like_transformers(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in the dtype transformers' RMSNorm returns: ``weight * normed.to(
    x.dtype)`` is x's dtype promoted with the weight's (fp32 for bf16 activations beside fp32
    weights), so bik computes in that dtype. The patched Hugging Face model and bik's vLLM
    layer both call this, so they give the same bits."""
    if x.dtype != weight.dtype:
        dtype = torch.promote_types(x.dtype, weight.dtype)
        x, weight = x.to(dtype), weight.to(dtype)
    return rms_norm(x, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's (and Qwen3.5's) RMSNorm: ``x * inv_rms * (1 + weight)`` in fp32, rounded once
    to x's dtype. The patched Hugging Face model and bik's vLLM layer both call this."""
    return rms_norm(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str
) -> torch.Tensor:
    """transformers' ``RMSNormGated`` in its two forms, one rounding to x's dtype at the end:
    "silu" (Qwen's Gated DeltaNet): the norm as :func:`rms_norm_like_transformers`, times
    ``silu(gate)`` in fp32; "sigmoid" (Kimi Delta Attention): the norm and its weight in fp32,
    times ``sigmoid(gate)``. The gates through bik.silu / bik.sigmoid (layout-independent
    bits). The patched Hugging Face model and bik's vLLM layer both call this."""
    from .activations import sigmoid, silu

    if activation == "silu":
        normed = rms_norm_like_transformers(x, weight, eps)
        return (normed.float() * silu(gate.float())).to(x.dtype)
    if activation == "sigmoid":
        normed = rms_norm(x.float(), weight.float(), eps)
        return (normed * sigmoid(gate.float())).to(x.dtype)
    raise ValueError(f"activation: expected 'silu' or 'sigmoid', got {activation!r}")
