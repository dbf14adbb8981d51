"""Pieces shared by the Triton kernels, and what every launch pins.

The bits a GPU binary produces depend on what the compiler was allowed to choose, so every
launch goes through :class:`Launch`, which fixes the choices that would otherwise be left to
chance (docs/design.md, "GPU binaries"):

- FP contraction: ``enable_fp_fusion`` is passed explicitly (:data:`FP_FUSION`), so a
  multiply feeding an add rounds the same way whatever a Triton release's default is.
- Specialisation: Triton compiles a separate binary for an integer argument equal to 1 or
  divisible by 16, and for a pointer aligned to 16 bytes. Kernels name their batch-like
  integers (rows, query and key lengths, split counts, strides that scale with them) in
  ``do_not_specialize``; :func:`aligned` copies a tensor whose storage is not 16-byte aligned,
  so the binary never changes with a view's offset.
- Warps and stages are part of the launch, never left to a default that may change.

``bik.tools.sm90`` compiles the same :class:`Launch` descriptions for Hopper with no GPU and
reads the instructions they became.
"""

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

# Read once, as triton.jit does: under the interpreter the kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

FP_FUSION = False
"""No FMA contraction: every rounding the kernel source writes happens, as in the interpreter
(fp32 ``tl.dot`` still lowers to FMA: that is the dot's own, fixed, definition)."""

ALIGNMENT = 16
"""Bytes: the pointer alignment every kernel is compiled for (see :func:`aligned`)."""


def upcast_dot_operands(dtype):
    """The interpreter stores bfloat16 as raw uint16 and cannot feed it to a matmul; there the
    operands are widened to fp32 first (exact: a bf16 x bf16 product fits in fp32)."""
    return INTERPRET and dtype == torch.bfloat16


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it when its first element is not :data:`ALIGNMENT`-byte aligned
    (a view into the middle of a buffer), so every launch sees the alignment it was compiled
    for. Meta tensors (the sm_90a compile check) have no address and pass through."""
    if tensor.device.type == "meta" or tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


@dataclass
class Launch:
    """One kernel launch described before it runs: ``kernel[grid](**args)`` with pinned options.

    ``args`` names every kernel parameter (tensors, integers, floats and constexprs).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    extra_options: dict[str, Any] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """The compile options this launch pins."""
        return dict(
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            enable_fp_fusion=FP_FUSION,
            **self.extra_options,
        )

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args, **self.options())


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with an fp32 accumulator; fp32 operands use IEEE fp32, never TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")
