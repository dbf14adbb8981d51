"""Backend registry: which kernels run an op.

A backend is a :class:`Backend` (see base.py): a name, the device types it serves, its kernels
by keyword (each optional), its capabilities and ``check_device``. Each backend lives in a
module of this package that defines ``BACKEND``; the module is imported on first use, so a
backend whose extension is not built (cpu, cuda) or whose package is missing (triton) costs
nothing until it is selected. Ops
validate their inputs, then ask :func:`kernel` (or :func:`resolve`) for the kernel of their op
on the tensors' device: the selected backend's, or under "auto" the first backend of the
device's order that is usable here and implements the op. ``python -m bik backends`` prints
the op x backend matrix.

Names:
  "auto"      -- picks per device type from what is available (see ``_AUTO_ORDER``);
  "cpu"       -- C++ kernels (csrc/cpu), CPU tensors, when built;
  "cuda"      -- CUDA kernels (csrc/cuda), CUDA tensors, when built: the portable reference
                 kernels, not a performance path (auto prefers triton);
  "triton"    -- Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1;
  "reference" -- plain torch, the accuracy oracle (NOT batch-invariant).
"""

import contextlib
import importlib
import os
from collections.abc import Iterator

import torch

from .base import OPS, Backend, Kernel

__all__ = [
    "OPS",
    "Backend",
    "available_backends",
    "check_name",
    "get_backend",
    "kernel",
    "load",
    "register_backend",
    "resolve",
    "set_backend",
    "use_backend",
]

_SOURCES: dict[str, str | Backend] = {}  # name -> module path (imported on first use) or Backend
_LOADED: dict[str, Backend] = {}
# Invariant backends tried by "auto", best first, per device type.
_AUTO_ORDER = {"cpu": ["cpu", "triton"], "cuda": ["triton", "cuda"]}
_current = "auto"
# (selected name, device, op) -> the backend resolve() found for them: ops ask on every call,
# and the search costs more than a small kernel. Emptied when a backend is registered; an
# entry whose backend is no longer the loaded one is searched again.
_resolved: dict[tuple[str, torch.device, str], Backend] = {}


def register_backend(name: str, source: str | Backend) -> None:
    """Register backend ``name``: a :class:`Backend`, or the path of a module defining
    ``BACKEND`` (imported on first use)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name: expected a non-empty backend name other than 'auto', got {name!r}")
    if not isinstance(source, str | Backend):
        raise TypeError(
            f"source: expected a module path or a bik.backends.Backend, got {type(source).__name__}"
        )
    _SOURCES[name] = source
    _LOADED.pop(name, None)
    _resolved.clear()


def available_backends() -> list[str]:
    """Names of all registered backends, plus "auto"."""
    return ["auto", *sorted(_SOURCES)]


def check_name(name: object) -> str:
    """``name`` if it is "auto" or a registered backend, else a ValueError listing them."""
    if not isinstance(name, str) or (name != "auto" and name not in _SOURCES):
        raise ValueError(f"backend: expected one of {available_backends()}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Select the backend used by every bik op from now on ("auto" restores the default)."""
    global _current
    _current = check_name(name)


def get_backend() -> str:
    """Name of the selected backend (may be "auto")."""
    return _current


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: run the enclosed ops on backend ``name``, then restore the previous one."""
    previous = _current
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def load(name: str) -> Backend:
    """The backend called ``name``, importing its module once. Raises ImportError (saying how
    to build or install it) when it is not available on this machine."""
    check_name(name)
    if name not in _LOADED:
        source = _SOURCES[name]
        _LOADED[name] = (
            source if isinstance(source, Backend) else importlib.import_module(source).BACKEND
        )
    return _LOADED[name]


def _usable(name: str, device: torch.device) -> bool:
    try:
        load(name).check_device(device)
        return True
    except (ImportError, RuntimeError):
        return False


def resolve(device: torch.device, op: str = "matmul") -> Backend:
    """The backend that will run ``op`` on tensors living on ``device``: the selected one
    (NotImplementedError if it lacks the op), or under "auto" the first usable backend of
    ``_AUTO_ORDER`` that implements it."""
    key = (_current, device, op)
    backend = _resolved.get(key)
    if backend is None or _LOADED.get(backend.name) is not backend:
        backend = _resolved[key] = _search(device, op)
    return backend


def _search(device: torch.device, op: str) -> Backend:
    if _current != "auto":
        backend = load(_current)
        backend.check_device(device)
        backend.kernel(op)  # raises when the selected backend lacks the op
        return backend
    candidates = [n for n in _AUTO_ORDER.get(device.type, []) if n in _SOURCES]
    for name in candidates:
        if _usable(name, device) and load(name).implements(op):
            return load(name)
    raise RuntimeError(
        f"bik: no batch-invariant backend can run {op} on device {device}. Tried {candidates}. "
        "On a CPU machine without the compiled cpu backend, set TRITON_INTERPRET=1 before "
        "importing bik to run the Triton kernels in the interpreter, or call "
        "bik.set_backend('reference') for plain (non-invariant) torch."
    )


def kernel(device: torch.device, op: str) -> Kernel:
    """The kernel that runs ``op`` on tensors living on ``device`` (see :func:`resolve`)."""
    return resolve(device, op).kernel(op)


register_backend("reference", "bik.backends.reference")
register_backend("triton", "bik.backends.triton")
register_backend("cpu", "bik.backends.cpu")
register_backend("cuda", "bik.backends.cuda")
set_backend(os.environ.get("BIK_BACKEND", "auto"))
