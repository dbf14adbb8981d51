"""Backend registry: which kernels run an op.

A backend is a module exposing the same kernel functions (``matmul``, ``rms_norm``,
``log_softmax``, ``token_logprobs``, ``attention``) plus ``check_device(device)``, which
raises ``RuntimeError`` with a how-to-fix message when the backend cannot serve tensors on
that device. Ops validate their inputs, then ask :func:`resolve` for a backend.

Names:
  "auto"      -- picks per tensor device from what is available (see ``_AUTO_ORDER``);
  "triton"    -- Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1;
  "reference" -- plain torch, the accuracy oracle (NOT batch-invariant).
  "cpu"       -- C++ kernels (csrc/cpu), CPU tensors, when built;
  "cuda"      -- CUDA kernels (csrc/cuda), CUDA tensors, when built (auto prefers triton).
"""

import contextlib
import importlib
import os

_LOADERS = {}  # name -> module path, imported on first use
_LOADED = {}  # name -> imported module
# Invariant backends tried by "auto", best first, per device type.
_AUTO_ORDER = {"cpu": ["cpu", "triton"], "cuda": ["triton", "cuda"]}
_current = "auto"


def register_backend(name, module_path):
    """Register a backend implemented by the module at ``module_path`` (lazily imported)."""
    _LOADERS[name] = module_path


def available_backends():
    """Names of all registered backends, plus "auto"."""
    return ["auto", *sorted(_LOADERS)]


def _check_name(name):
    if not isinstance(name, str) or (name != "auto" and name not in _LOADERS):
        raise ValueError(f"backend: expected one of {available_backends()}, got {name!r}")


def set_backend(name):
    """Select the backend used by every bik op from now on ("auto" restores the default)."""
    global _current
    _check_name(name)
    _current = name


def get_backend():
    """Name of the selected backend (may be "auto")."""
    return _current


@contextlib.contextmanager
def use_backend(name):
    """Context manager: run the enclosed ops on backend ``name``, then restore the previous one."""
    previous = _current
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def load(name):
    """Import (once) and return the backend module called ``name``."""
    _check_name(name)
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(_LOADERS[name])
    return _LOADED[name]


def _usable(name, device):
    try:
        load(name).check_device(device)
        return True
    except (ImportError, RuntimeError):
        return False


def resolve(device):
    """The backend module that will run an op on tensors living on ``device``."""
    if _current != "auto":
        backend = load(_current)
        backend.check_device(device)
        return backend
    candidates = [n for n in _AUTO_ORDER.get(device.type, []) if n in _LOADERS]
    for name in candidates:
        if _usable(name, device):
            return load(name)
    raise RuntimeError(
        f"bik: no batch-invariant backend can run on device {device}. Tried {candidates}. "
        "On a CPU machine without the compiled cpu backend, set TRITON_INTERPRET=1 before "
        "importing bik to run the Triton kernels in the interpreter, or call "
        "bik.set_backend('reference') for plain (non-invariant) torch."
    )


register_backend("reference", "bik.reference")
register_backend("triton", "bik.triton")
register_backend("cpu", "bik.cpu")
register_backend("cuda", "bik.cuda")
set_backend(os.environ.get("BIK_BACKEND", "auto"))
