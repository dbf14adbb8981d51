"""Public ops: validate inputs, then dispatch to the selected backend (see bik.backends).

Every op is also a ``torch.library`` custom op (``torch.ops.bik.<name>``) with a fake kernel
and a registered autograd formula. :func:`run` picks the path:
  * eager inference (no input needs a graph): the kernel is called directly, without the
    dispatcher's per-call cost, which dominates small decode-time calls;
  * a graph to record, ``torch.compile`` tracing, or meta / fake tensors: the custom op, so
    autograd, Dynamo and fake-tensor propagation see one opaque op.
Both paths run the same kernel on the same inputs, so compiled and eager graphs give the
same bits.
"""

import math
from collections.abc import Callable

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` viewed (or copied) as ``[R, D]``; works when D or R is 0."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


_unsafe_view = torch.ops.aten._unsafe_view.default


def shaped(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A freshly computed, contiguous ``out`` given ``shape``. Not a view (aten's
    ``_unsafe_view``, as torch's own ops return), so callers may modify the result in place
    under autograd. The call is skipped, as it costs more than the kernel of a one-row op,
    when ``out`` already has that shape."""
    return out if out.shape == shape else _unsafe_view(out, shape)


def _needs_custom_op(args: tuple) -> bool:
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and ((grad and a.requires_grad) or a.is_meta):
            return True
    return False


def run(op: Callable[..., torch.Tensor], kernel: Callable[..., torch.Tensor], *args):
    """``op(*args)`` (the custom op) when a graph is recorded, traced or faked; else
    ``kernel(*args)``, the function the custom op itself runs: same bits either way."""
    return op(*args) if _needs_custom_op(args) else kernel(*args)
