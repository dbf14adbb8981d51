"""Pieces shared by the Triton kernels."""

import os

import torch
import triton
import triton.language as tl

# Read once, as triton.jit does: under the interpreter the kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def upcast_dot_operands(dtype):
    """The interpreter stores bfloat16 as raw uint16 and cannot feed it to a matmul; there the
    operands are widened to fp32 first (exact: a bf16 x bf16 product fits in fp32)."""
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with an fp32 accumulator; fp32 operands use IEEE fp32, never TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")
