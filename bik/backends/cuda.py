"""The "cuda" backend: the PORTABLE REFERENCE backend for CUDA tensors, not a performance path.

CUDA kernels from csrc/cuda (pybind11, no libtorch), launched on torch's current stream, with
the fixed orders of csrc/cuda/kernels.cu. They are written for order-correctness and
readability, not speed: matmul computes each output element in one thread (a shared-memory
16 x 16 tile, scalar loads, CUDA-core fma, no tensor cores), which an estimate (not yet a
measurement) puts near 1 % of cuBLAS on large bf16 products; the row ops and attention run
one thread block per row (attention: per row and split). It serves to check the orders on a
GPU with code that is not Triton's. The performance path on a GPU is the Triton backend,
which ``auto`` picks for CUDA tensors; this one runs only when selected by name
(``bik.set_backend("cuda")``, ``BIK_BACKEND=cuda``) or where Triton cannot run. Built by
setup.py where nvcc and a GPU are present, or with BIK_BUILD_CUDA=1."""

import torch

from ..contract import CUDA_ROW_THREADS, KEY_BLOCK
from .native import native_backend

try:
    from .. import _cuda
except ImportError as error:
    raise ImportError(
        "bik cuda backend is not built: reinstall on a machine with nvcc and a GPU, or with "
        "BIK_BUILD_CUDA=1 (`BIK_BUILD_CUDA=1 pip install -e .`)"
    ) from error


def _stream(device):
    return (torch.cuda.current_stream(device).cuda_stream,)


def _attention_scratch(q, tk, split_size):
    """fp32 workspace for the split partials (acc, max, sum) of every query row and split:
    (the tensor, the extra launch arguments)."""
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    n_splits = max(1, -(-tk // split_size))
    scratch = torch.empty(rows * n_splits * (q.shape[3] + 2), dtype=torch.float32, device=q.device)
    return scratch, (scratch.data_ptr(), n_splits)


BACKEND = native_backend(
    "cuda",
    "cuda",
    _cuda,
    order=(
        "CUDA C++ (csrc/cuda), the portable reference: one thread's fma chain per matmul "
        f"output over ascending K; rows over {CUDA_ROW_THREADS} strided threads, then a fixed "
        f"shared-memory tree; attention in {KEY_BLOCK}-key blocks and fixed-size splits"
    ),
    launch_args=_stream,
    attention_scratch=_attention_scratch,
)
