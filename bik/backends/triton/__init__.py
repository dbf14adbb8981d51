"""The "triton" backend: Triton kernels for CUDA tensors, or CPU tensors under the interpreter."""

try:
    import triton  # noqa: F401
except ImportError as error:  # registry reports this as "backend not usable"
    raise ImportError("bik triton backend: the triton package is not installed") from error

import torch

from ..base import Backend
from ._common import INTERPRET
from .attention import attention
from .log_softmax import log_softmax, token_logprobs
from .matmul import grouped_matmul, matmul
from .rms_norm import rms_norm


def _needs_interpreter_on_cpu(device: torch.device) -> None:
    if device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "bik triton backend: CPU tensors need the Triton interpreter; "
            "set TRITON_INTERPRET=1 before bik (and triton) are imported"
        )


BACKEND = Backend(
    "triton",
    ("cuda", "cpu"),
    matmul,
    rms_norm,
    log_softmax,
    token_logprobs,
    attention,
    grouped_matmul=grouped_matmul,
    extra_device_check=_needs_interpreter_on_cpu,
)
