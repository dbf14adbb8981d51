"""Input validation shared by the ops: every error names the argument and what was expected."""

import numbers
import weakref

import numpy
import torch
from torch._subclasses.fake_tensor import FakeTensor

from .contract import FLOAT_DTYPES


def tensor(name, value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def floating(name, value):
    """``value`` must be a float32, bfloat16 or float16 tensor."""
    tensor(name, value)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {value.dtype}")
    return value


def rank(name, value, expected):
    """``value.dim()`` must equal ``expected`` (an int), or be at least ``expected[0]``
    (a 1-tuple)."""
    if isinstance(expected, tuple):
        if value.dim() < expected[0]:
            raise ValueError(
                f"{name}: expected at least {expected[0]} dims, got shape {tuple(value.shape)}"
            )
    elif value.dim() != expected:
        raise ValueError(f"{name}: expected {expected} dims, got shape {tuple(value.shape)}")
    return value


def same_dtype(name, value, ref_name, ref):
    if value.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected dtype {ref.dtype} (same as {ref_name}), got {value.dtype}"
        )


def same_device(name, value, ref_name, ref):
    if value.device != ref.device:
        raise ValueError(
            f"{name}: expected device {ref.device} (same as {ref_name}), got {value.device}"
        )


def dim_size(name, value, dim, expected, what):
    if value.shape[dim] != expected:
        raise ValueError(
            f"{name}: expected size {expected} in dim {dim} ({what}), "
            f"got shape {tuple(value.shape)}"
        )


FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = torch.finfo(torch.float32).tiny  # smaller positive values are 0 or subnormal


def real_number(name, value):
    """``value`` as a Python float: any real scalar (int, float, numpy scalar, a one-element
    0-d tensor), never a bool, a string or a tensor with several elements."""
    if type(value) is float:  # the common case, without the costlier ABC check below
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    return float(value)


def positive_number(name, value):
    """A real number > 0 that stays finite in fp32 (the kernels compute with it in fp32)."""
    number = real_number(name, value)
    if not FP32_TINY <= number <= FP32_MAX:
        raise ValueError(
            f"{name}: expected a positive number that is finite and not 0 in float32 (in "
            f"[{FP32_TINY:.4g}, {FP32_MAX:.4g}]), got {value!r}"
        )
    return number


def non_negative_number(name, value):
    """A real number >= 0 that stays finite in fp32."""
    number = real_number(name, value)
    if not 0 <= number <= FP32_MAX:
        raise ValueError(f"{name}: expected a number >= 0 that is finite in float32, got {value!r}")
    return number


def positive_int(name, value):
    """``value`` as a Python int >= 1: an int or numpy integer, never a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def chunk_count(name, chunks, k, what="K, the last dim of x"):
    """``chunks`` as the chunk count of a K reduction split into equal chunks: a power of two
    (1, 2, 4, ...) dividing ``k`` (``what`` names it)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{name}: expected a positive int, got {chunks!r}")
    if chunks & (chunks - 1):
        raise ValueError(f"{name}: expected a power of two (1, 2, 4, ...), got {chunks}")
    if k % chunks:
        raise ValueError(f"{name}: {what} = {k} is not divisible by {chunks}")
    return chunks


def flag(name, value):
    """``value`` as a bool: True/False (or a numpy bool), never a string or a number."""
    if isinstance(value, bool | numpy.bool_):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def values_in_range(name, values, low, high, what):
    """Every value of the integer tensor ``values`` lies in ``[low, high]``.

    CPU tensors: a ValueError naming the argument, the range and the offending extremes.
    Device tensors: the same test runs on the device, queued without a host sync (a decode
    step calls this once per layer); a bad value stops the program with this message when the
    device reaches it (a device-side assert via torch._assert_async, carrying this message
    where torch can report it), instead of reading out of bounds. Under torch.compile the
    device form is used on every device, so the check does not break the graph. Fake
    tensors (FakeTensorMode, meta tensors) have no values: the check is skipped, as under
    torch.compile's tracing; under torch.vmap or torch.func transforms the values checked
    are those of the whole batch. A tensor bik built itself within the range
    (:func:`known_in_range`) is not checked again until it is written to.
    """
    if values.numel() == 0:
        return
    expected = f"{name}: expected values in [{low}, {high}] ({what})"
    compiling = torch.compiler.is_compiling()  # Dynamo traces no functorch query below
    if not compiling:
        values = _unwrapped(values)
        if _without_values(values) or _KNOWN_IN_RANGE.holds(values, low, high):
            return
    _check_range(values, low, high, expected, on_device=values.device.type != "cpu" or compiling)


def _check_range(values, low, high, expected, on_device):
    if on_device:
        torch._assert_async(((values >= low) & (values <= high)).all(), expected)
        return
    smallest, largest = int(values.min()), int(values.max())
    if smallest < low or largest > high:
        raise ValueError(f"{expected}, got min {smallest}, max {largest}")


def known_in_range(values: torch.Tensor, low: int, high: int) -> None:
    """Record that every value of ``values``, a tensor bik built itself (never a caller's:
    only its builder knows), lies in ``[low, high]``, so that :func:`values_in_range` queues
    no check for it. A decode step hands the ``kv_start`` it derived from the mask to every
    layer; on a GPU each check is five queued launches of host work."""
    _KNOWN_IN_RANGE.add(values, low, high)


class _KnownInRange:
    """Tensors with the range their builder vouched for and the version they had then: a
    write into one bumps its version, and its next check runs. An inference tensor (it has
    no version counter) is never recorded. Entries hold a weak reference, so a freed
    tensor's id never answers for a new one; the table is cleared when full."""

    SIZE = 64

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref, int, int, int]] = {}

    def add(self, values: torch.Tensor, low: int, high: int) -> None:
        if values.is_inference():
            return
        if len(self.entries) >= self.SIZE:
            self.entries.clear()
        self.entries[id(values)] = (weakref.ref(values), values._version, low, high)

    def holds(self, values: torch.Tensor, low: int, high: int) -> bool:
        """Whether ``values``, unwritten since it was recorded, lies within ``[low, high]``."""
        entry = self.entries.get(id(values))
        if entry is None:
            return False
        ref, version, known_low, known_high = entry
        return (
            ref() is values
            and version == values._version
            and low <= known_low
            and known_high <= high
        )


_KNOWN_IN_RANGE = _KnownInRange()


def _unwrapped(values: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers (vmap's batched tensors: every example's values)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(values):
        values = functorch.get_unwrapped(values)
    return values


def _without_values(values: torch.Tensor) -> bool:
    """A fake or meta tensor: shapes and dtypes only, nothing to read."""
    return values.is_meta or isinstance(values, FakeTensor)
