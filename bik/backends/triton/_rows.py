"""What the row kernels (rms_norm, log_softmax) share: 16-byte vectors and row layout.

A row reduction's tree follows the register layout Triton derives for its loads, and that
layout depends on how aligned the compiler can prove each row's start to be. So the row
stride is passed in units of :func:`vector_width` elements (and never specialised): the
compiler sees ``row * stride * VEC``, provably VEC-aligned for every batch, and picks the
same layout, hence the same tree, whatever the number of rows or the stride's value.
"""

import torch

from ._common import aligned


def vector_width(length: int, dtype: torch.dtype) -> int:
    """Elements per 16-byte access that divide ``length``: the largest power of two at most
    ``16 / itemsize`` dividing it (1 for an odd length). A function of the row length only."""
    width = 16 // dtype.itemsize
    while length % width:
        width //= 2
    return width


def kernel_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x [R, L]`` as the row kernels take it, and its vector width: unit column stride, a
    row stride divisible by the vector width, aligned storage (copied when not so)."""
    vec = vector_width(x.shape[1], x.dtype)
    if x.stride(-1) != 1 or x.stride(0) % vec:
        x = x.contiguous()
    return aligned(x), vec


def stride_in_vectors(x: torch.Tensor, vec: int) -> int:
    """``x``'s row stride in units of ``vec`` elements (what the kernels multiply back)."""
    if x.stride(-1) != 1 or x.stride(0) % vec:
        raise ValueError(f"x: expected unit column stride and a row stride divisible by {vec}")
    return x.stride(0) // vec
