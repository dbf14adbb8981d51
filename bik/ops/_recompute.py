"""Deterministic backward by recomputation.

The backward passes of rms_norm, log_softmax and attention differentiate the float32
reference formula (bik.backends.reference) with torch autograd. Every op in those graphs is
deterministic on CPU and CUDA (no atomics, no scatter), so gradients are reproducible run to
run; they are not promised to be batch-invariant (docs/design.md, "Reduction orders"). On a
CPU the recompute runs on one intra-op thread: torch splits a CPU reduction (a matmul's K)
by thread, so the gradients' bits would otherwise depend on the thread count.

Under ``backward(create_graph=True)`` (grad mode is on inside the backward) the formula is
differentiated through the saved inputs themselves, so the gradient keeps its graph and a
second derivative (a gradient penalty, a Hessian-vector product) is exact, not dropped.
"""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """One intra-op thread while a CPU recompute runs (nothing changes on a GPU, under
    torch.compile, or on one thread already)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or torch.compiler.is_compiling():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grads(formula, inputs, needs, grad_out):
    """Gradients of ``formula(*fp32 inputs)`` w.r.t. the tensors whose ``needs`` flag is set,
    each returned in its input's dtype (``None`` elsewhere)."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad(), _one_cpu_thread(grad_out.device):
        if create_graph:
            wanted = [t for t, need in zip(inputs, needs) if need]
            leaves = [t.float() if isinstance(t, torch.Tensor) else t for t in inputs]
        else:
            leaves = [
                t.detach().float().requires_grad_(need) if isinstance(t, torch.Tensor) else t
                for t, need in zip(inputs, needs)
            ]
            wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        out = formula(*leaves)
        found = iter(torch.autograd.grad(out, wanted, grad_out.float(), create_graph=create_graph))
    return tuple(next(found).to(t.dtype) if need else None for t, need in zip(inputs, needs))
