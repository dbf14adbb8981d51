"""The "cpu" backend: C++ kernels from csrc/cpu (pybind11 + OpenMP), same fixed orders.

Each output element is computed by one thread in one order (csrc/cpu/common.h, bik.contract),
so the bits do not depend on the batch, on chunking or padding, or on the number of threads.
"""

from ..contract import CPU_LANES, KEY_BLOCK
from .native import native_backend

try:
    from .. import _cpu
except ImportError as error:
    raise ImportError(
        "bik cpu backend is not built: reinstall with a C++17 compiler present "
        "(`pip install -e .` in the bik checkout builds csrc/cpu)"
    ) from error

BACKEND = native_backend(
    "cpu",
    "cpu",
    _cpu,
    order=(
        "C++ (csrc/cpu): one fp32 accumulator per matmul output over ascending K; rows in "
        f"{CPU_LANES} interleaved lanes, then a fixed pairwise tree; attention in "
        f"{KEY_BLOCK}-key blocks and fixed-size splits merged in ascending order"
    ),
    attention_sinks=True,
    paged_attention=True,
    chunked_matmul=True,
    prepacked_matmul=True,
    recurrences=True,
)
