"""SiLU, ``x * sigmoid(x)``, with bits that do not depend on the tensor's shape or layout.

There is no reduction here, but torch's own fp32 SiLU on the CPU is still not invariant: its
vectorised body and its scalar tail (the last elements of a buffer, or every element of a
strided view) compute ``exp`` differently, so an element's bits depend on where it sits. Both
sides of a rollout/training pair (the Hugging Face MLP and vLLM's SiLU-and-multiply) call
this one function instead: ``x / (1 + exp(-x))`` in fp32 from ops whose vector and scalar
paths agree (negation, ``exp``, addition and division; tests/test_silu.py checks ``exp``),
rounded once to x's dtype.
"""

import torch

from .. import _checks
from . import _recompute, custom_op, run


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` with fp32 math, returned in x's dtype."""
    _checks.floating("x", x)
    return run(_silu_op, _silu, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate, up]`` split in halves along the last dim (the
    fused gate/up projection of an engine); the product is rounded in x's dtype."""
    _checks.floating("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dim (gate and up halves), got {tuple(x.shape)}")
    half = x.shape[-1] // 2
    return silu(x[..., :half]) * x[..., half:]


def _formula(x: torch.Tensor) -> torch.Tensor:
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide / (1 + torch.exp(-wide))).to(x.dtype)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return _formula(x)


# A custom op so a compiler cannot fuse the formula into code with a different exp.
_silu_op = custom_op("bik::silu", _silu)


@_silu_op.register_fake
def _(x):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    (grad_x,) = _recompute.grads(_formula, (x,), (True,), grad)
    return grad_x


_silu_op.register_autograd(_backward, setup_context=_setup_context)
