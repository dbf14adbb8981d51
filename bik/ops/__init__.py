"""Public ops: validate inputs, then dispatch to the selected backend (see bik.backends)."""

import math

import torch


def as_rows(x):
    """``x [..., D]`` viewed (or copied) as ``[R, D]``; works when D or R is 0."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def shaped(out, shape):
    """``out`` reshaped to ``shape`` (skipping the reshape call, which costs more than the
    kernel of a one-row op, when it already has that shape)."""
    return out if out.shape == shape else out.reshape(shape)


class _NoGraph:
    """Stands in for autograd's ctx when no graph is recorded: forward's saves go nowhere."""

    def save_for_backward(self, *tensors):
        pass


def run(function, *args):
    """``function.apply(*args)``, or just its forward when autograd would record nothing
    (grad disabled, or no input requires grad): same result, without autograd's per-call cost,
    which dominates small decode-time calls."""
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return function.apply(*args)
    return function.forward(_NoGraph(), *args)
