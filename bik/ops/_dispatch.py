"""What every op module shares (private): the custom-op registration with its vmap rule, the
choice between the custom op and the direct kernel call (bik.ops's docstring), and the row
reshapes of row-wise ops."""

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` viewed (or copied) as ``[R, D]``; works when D or R is 0."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def shaped(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` reshaped to ``shape`` (skipping the reshape call, which costs more than the
    kernel of a one-row op, when it already has that shape)."""
    return out if out.shape == shape else out.reshape(shape)


_unsafe_view = torch.ops.aten._unsafe_view.default


def custom_op(
    name: str, kernel: Callable[..., torch.Tensor], row_args: tuple[int, ...] = ()
) -> Any:
    """``kernel`` (annotated) registered as the torch.library custom op ``name``. Its result
    is never a view (aten's ``_unsafe_view``, as torch's own ops return), so callers may
    modify it in place under autograd (e.g. ``logits.div_(temperature)``).

    ``torch.vmap`` runs it by :func:`_vmap_rule`: ``row_args`` are the positions of the
    arguments whose leading dims are rows of the output (``x [..., K]`` of a linear)."""

    @functools.wraps(kernel)  # the schema is read from kernel's signature
    def fresh_output(*args):
        out = kernel(*args)
        return _unsafe_view(out, out.shape) if out._is_view() else out

    op = torch.library.custom_op(name, fresh_output, mutates_args=())
    op.register_vmap(functools.partial(_vmap_rule, name, op, row_args))
    return op


def _vmap_rule(
    name: str,
    op: Callable[..., torch.Tensor],
    row_args: tuple[int, ...],
    info: Any,
    in_dims: tuple[int | None, ...],
    *args: Any,
) -> tuple[torch.Tensor, int]:
    """``op`` under ``torch.vmap``. When exactly the row arguments are batched, their batch
    dim becomes one more leading dim of rows and ``op`` runs once: a row's bits do not
    depend on the other rows (the contract), so this equals one call per example. Otherwise
    (a batched weight, attention's keys...) ``op`` runs on each example in turn and the
    results are stacked."""
    batched = tuple(i for i, d in enumerate(in_dims) if d is not None)
    if row_args and batched == row_args:
        args = tuple(a if d is None else a.movedim(d, 0) for a, d in zip(args, in_dims))
        return op(*args), 0
    if info.batch_size == 0:
        raise ValueError(f"{name}: torch.vmap over an empty batch dim of a non-row argument")
    outs = [
        op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
        for i in range(info.batch_size)
    ]
    return torch.stack(outs), 0


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def needs_custom_op(args: tuple) -> bool:
    # Dynamo tracing, a dispatch mode (FakeTensorMode, make_fx...) or a torch.func transform
    # (vmap's batched tensors): a raw kernel would write through a fake data pointer, read a
    # wrapper's, or vanish from the traced graph.
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._functorch.peek_interpreter_stack() is not None
    ):
        return True
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (
            (grad and a.requires_grad) or a.is_meta or type(a) not in _PLAIN_TENSORS
        ):
            return True
    return False


R = TypeVar("R")


def run(op: Callable[..., R], kernel: Callable[..., R], *args: Any) -> R:
    """``op(*args)`` (the custom op) when a graph is recorded, traced or faked; else
    ``kernel(*args)``, the function the custom op itself runs: same bits either way."""
    return op(*args) if needs_custom_op(args) else kernel(*args)
