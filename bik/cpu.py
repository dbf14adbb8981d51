"""The "cpu" backend: C++ kernels from csrc/cpu (pybind11 + OpenMP), same fixed orders.

Each output element is computed by one thread in one order (see csrc/cpu/common.h), so the
bits do not depend on the batch, on chunking or padding, or on the number of threads.
"""

from ._native import NativeBackend

try:
    from . import _cpu
except ImportError as error:
    raise ImportError(
        "bik cpu backend is not built: reinstall with a C++17 compiler present "
        "(`pip install -e .` in the bik checkout builds csrc/cpu)"
    ) from error

NativeBackend("cpu", "cpu", _cpu).export(globals())
