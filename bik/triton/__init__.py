"""The "triton" backend: Triton kernels for CUDA tensors, or CPU tensors under the interpreter."""

try:
    import triton  # noqa: F401
except ImportError as error:  # registry reports this as "backend not usable"
    raise ImportError("bik triton backend: the triton package is not installed") from error

from ._common import INTERPRET
from .attention import attention
from .log_softmax import log_softmax, token_logprobs
from .matmul import matmul
from .rms_norm import rms_norm

__all__ = ["attention", "check_device", "log_softmax", "matmul", "rms_norm", "token_logprobs"]


def check_device(device):
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return
    if device.type == "cpu":
        raise RuntimeError(
            "bik triton backend: CPU tensors need the Triton interpreter; "
            "set TRITON_INTERPRET=1 before bik (and triton) are imported"
        )
    raise RuntimeError(f"bik triton backend: cannot run on device {device}")
