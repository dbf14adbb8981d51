"""Activations (SiLU, sigmoid, softplus, tanh-approximated GELU) with bits that do not depend on the
tensor's shape or layout.

There is no reduction here, but torch's own fp32 activations on the CPU are still not
invariant: their vectorised body and their scalar tail (the last elements of a buffer, or
every element of a strided view) compute ``exp`` or ``tanh`` differently, so an element's bits
depend on where it sits. Both sides of a rollout/training pair (the Hugging Face model and
vLLM's layers) call these functions instead. Each is a formula in fp32 over ops whose vector
and scalar paths agree (negation, multiplication, addition, division, ``exp``, ``log`` and
``tanh``; tests/ops/test_elementwise.py checks ``exp``, ``log`` and ``tanh``), rounded once to
x's dtype.
"""

import math
from collections.abc import Callable

import torch

from .. import _checks
from . import _recompute
from ._dispatch import custom_op, run


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _silu_formula(x: torch.Tensor) -> torch.Tensor:
    wide = _wide(x)
    return (wide / (1 + torch.exp(-wide))).to(x.dtype)


def _sigmoid_formula(x: torch.Tensor) -> torch.Tensor:
    return (1 / (1 + torch.exp(-_wide(x)))).to(x.dtype)


def _softplus_formula(x: torch.Tensor) -> torch.Tensor:
    # max(x, 0) + log1p(exp(-|x|)), with log1p from log (torch's vector and scalar log1p
    # differ, log agrees): log1p(u) = log(w) * u / (w - 1) for w = 1 + u (Goldberg's form,
    # a few ulps), u itself where w rounds to 1.
    wide = _wide(x)
    u = torch.exp(-wide.abs())
    w = 1 + u
    log1p = torch.where(w == 1, u, torch.log(w) * u / (w - 1))
    return (torch.relu(wide) + log1p).to(x.dtype)


_GELU_BETA = math.sqrt(2 / math.pi)
_GELU_KAPPA = 0.044715


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    wide = _wide(x)
    inner = _GELU_BETA * (wide + _GELU_KAPPA * (wide * wide * wide))
    return (0.5 * wide * (1 + torch.tanh(inner))).to(x.dtype)


def _activation(name: str, formula: Callable[[torch.Tensor], torch.Tensor], doc: str):
    """The public function of activation ``formula``: a custom op ``bik::<name>`` (so a
    compiler cannot fuse the formula into code with a different exp or tanh), with its fake
    kernel and an autograd formula."""

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return formula(x)

    kernel.__name__ = f"_{name}"
    op = custom_op(f"bik::{name}", kernel, row_args=(0,))
    op.register_fake(lambda x: x.new_empty(x.shape))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        (grad_x,) = _recompute.grads(formula, (x,), (True,), grad)
        return grad_x

    op.register_autograd(backward, setup_context=setup_context)

    def public(x: torch.Tensor) -> torch.Tensor:
        _checks.floating("x", x)
        return run(op, kernel, x)

    public.__name__ = public.__qualname__ = name
    public.__doc__ = doc
    return public


silu = _activation(
    "silu", _silu_formula, "SiLU, ``x / (1 + exp(-x))``, with fp32 math, in x's dtype."
)
sigmoid = _activation(
    "sigmoid", _sigmoid_formula, "``1 / (1 + exp(-x))`` with fp32 math, in x's dtype."
)
softplus = _activation(
    "softplus",
    _softplus_formula,
    "``log(1 + exp(x))`` as ``max(x, 0) + log(1 + exp(-|x|))`` with fp32 math, in x's dtype "
    "(the decay of the gated delta rule).",
)
gelu_tanh = _activation(
    "gelu_tanh",
    _gelu_tanh_formula,
    "GELU with the tanh approximation (transformers' ``gelu_pytorch_tanh``), "
    "``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, with fp32 math, in x's dtype.",
)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate, up]`` split in halves along the last dim (the
    fused gate/up projection of an engine); the product is rounded in x's dtype."""
    _checks.floating("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dim (gate and up halves), got {tuple(x.shape)}")
    half = x.shape[-1] // 2
    return silu(x[..., :half]) * x[..., half:]
