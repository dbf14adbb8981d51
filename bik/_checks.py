"""Input validation shared by the ops: every error names the argument and what was expected."""

import numbers

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
    are those of the whole batch.
    """
    if values.numel() == 0:
        return
    expected = f"{name}: expected values in [{low}, {high}] ({what})"
    compiling = torch.compiler.is_compiling()  # Dynamo traces no functorch query below
    if not compiling:
        values = _unwrapped(values)
        if _without_values(values):
            return
    if values.device.type != "cpu" or compiling:
        torch._assert_async(((values >= low) & (values <= high)).all(), expected)
        return
    smallest, largest = int(values.min()), int(values.max())
    if smallest < low or largest > high:
        raise ValueError(f"{expected}, got min {smallest}, max {largest}")


def _unwrapped(values: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers (vmap's batched tensors: every example's values)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(values):
        values = functorch.get_unwrapped(values)
    return values


def _without_values(values: torch.Tensor) -> bool:
    """A fake or meta tensor: shapes and dtypes only, nothing to read."""
    return values.is_meta or isinstance(values, FakeTensor)
