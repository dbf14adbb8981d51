"""Public ops: validate inputs, then dispatch to the selected backend (see bik.backends)."""

import math


def as_rows(x):
    """``x [..., D]`` viewed (or copied) as ``[R, D]``; works when D or R is 0."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
