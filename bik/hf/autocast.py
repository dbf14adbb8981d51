"""How a patched module runs its bik op: under the patch-time backend, with torch.autocast's
input casts applied by hand and autocast itself switched off around bik's kernels (they keep
their own dtypes, so results stay batch-invariant)."""

from collections.abc import Callable
from typing import Any

import torch

from .. import backends


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast casts a matmul's inputs to on ``device_type``, or None."""
    if not torch._C._is_any_autocast_enabled():  # the common case, checked cheaply first
        return None
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta...)
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast_cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # torch's own eligibility rule: floating tensors other than fp64 are cast.
    if t is not None and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t


def autocast_inputs(device_type: str, *tensors: Any) -> tuple[str | None, tuple[Any, ...]]:
    """(the device type of an active autocast or None, ``tensors`` cast as torch.autocast
    would cast a matmul's inputs)."""
    autocast_dtype = _autocast_dtype(device_type)
    if autocast_dtype is None:
        return None, tensors
    return device_type, tuple(_autocast_cast(t, autocast_dtype) for t in tensors)


def run(backend: str, autocast_on: str | None, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn`` under ``backend`` ("auto": the caller's selection). ``autocast_on``: the device
    type of an active autocast, switched off around ``fn``: the patched forwards cast their
    inputs themselves, and bik's kernels keep their own dtypes."""
    if autocast_on is not None:
        with torch.autocast(autocast_on, enabled=False):
            return run(backend, None, fn, *args, **kwargs)
    if backend == "auto" or backend == backends.get_backend():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # A compiled graph's bik ops resolve their backend when they run, from the global
        # selection: a per-module backend would silently not apply.
        raise RuntimeError(
            f"bik: this model was patched with backend={backend!r}, which torch.compile "
            f"cannot apply per module; call bik.set_backend({backend!r}) before running the "
            "compiled model (or patch with backend='auto')"
        )
    with backends.use_backend(backend):
        return fn(*args, **kwargs)
