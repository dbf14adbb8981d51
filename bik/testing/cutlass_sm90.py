"""A CUTLASS 3.x GEMM for Hopper, in one fixed order (csrc/cutlass/gemm_sm90.cu): not yet a
backend, a candidate the GPU probe measures against cuBLAS and against the Triton bucket of
the same instruction (128 x 256 x 64 tiles, HGMMA 64x256x16, no split-K or stream-K).

The kernel is built on a machine with nvcc and no GPU (``make cutlass-sm90``, CUTLASS's
headers from the pinned ``nvidia-cutlass`` package) into a torch-independent shared library
of about 1 MB, ``build/cutlass/libbik_cutlass_sm90.so`` (or ``$BIK_CUTLASS_SM90``), which
travels to the GPU machine and is loaded here with ctypes. Where its bits equal the Triton
bucket's it can become that backend's accelerator; where they differ, a backend of its own
with its own promise, tested on every axis (benchmarks/gpu_probe.py, part ``cutlass``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parents[2] / "build" / "cutlass" / "libbik_cutlass_sm90.so"
ALIGNMENT = 8  # elements of K and N: CUTLASS's TMA moves 16-byte rows


def library_path() -> Path:
    return Path(os.environ.get("BIK_CUTLASS_SM90", LIBRARY))


@functools.cache
def library() -> ctypes.CDLL:
    """The shared library, its functions typed; FileNotFoundError says how to build it."""
    path = library_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"bik cutlass_sm90: no library at {path}; build it with `make cutlass-sm90` on a "
            "machine with nvcc (no GPU needed), or point BIK_CUTLASS_SM90 at one"
        )
    lib = ctypes.CDLL(str(path))
    size, i32, ptr = ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
    lib.bik_cutlass_sm90_config.restype = ctypes.c_char_p
    lib.bik_cutlass_sm90_workspace.argtypes = [i32, i32, i32, i32, i32]
    lib.bik_cutlass_sm90_workspace.restype = size
    lib.bik_cutlass_sm90_can_implement.argtypes = [i32, i32, i32]
    lib.bik_cutlass_sm90_linear.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr, size, ptr]
    return lib


def config() -> str:
    """The tile shape and instruction the library was built with."""
    return library().bik_cutlass_sm90_config().decode()


def can_implement(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes these sizes (host only: K and N multiples of 8)."""
    return bool(library().bik_cutlass_sm90_can_implement(m, n, k))


def workspace_bytes(m: int, n: int, k: int, biased: bool, sm_count: int) -> int:
    """The workspace a GEMM of these sizes needs (host only)."""
    return int(library().bik_cutlass_sm90_workspace(m, n, k, int(biased), sm_count))


_FAILURES = {
    1: "CUTLASS cannot implement these sizes",
    2: "the workspace is too small",
    3: "the kernel's launch failed",
}


@functools.cache
def _sm90_and_sms(device: torch.device) -> tuple[bool, int]:
    """(whether ``device`` is a Hopper, its SM count): read once per device, not per call."""
    properties = torch.cuda.get_device_properties(device)
    return (properties.major, properties.minor) == (9, 0), properties.multi_processor_count


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != torch.bfloat16 or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous bfloat16 tensor, got {tensor.dtype}")
        hopper = tensor.device.type == "cuda" and _sm90_and_sms(tensor.device)[0]
        if not hopper:
            raise ValueError(
                f"{name}: expected a tensor on a Hopper GPU (sm_90), got {tensor.device}"
            )
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x, weight: expected [M, K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if n % ALIGNMENT or k % ALIGNMENT:
        raise ValueError(f"weight: expected N and K multiples of {ALIGNMENT}, got [{n}, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` in bf16 with an fp32 accumulator, on the
    current stream."""
    _check(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sm_count = _sm90_and_sms(x.device)[1]
    workspace = torch.empty(
        workspace_bytes(m, n, k, bias is not None, sm_count), dtype=torch.uint8, device=x.device
    )
    status = library().bik_cutlass_sm90_linear(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        n,
        k,
        sm_count,
        workspace.data_ptr() if workspace.numel() else None,
        workspace.numel(),
        torch.cuda.current_stream(x.device).cuda_stream,
    )
    if status:
        raise RuntimeError(
            f"bik cutlass_sm90: {_FAILURES.get(status, status)} (M={m}, N={n}, K={k})"
        )
    return out
