"""The "triton" backend: Triton kernels for CUDA tensors, or CPU tensors under the interpreter."""

try:
    import triton  # noqa: F401
except ImportError as error:  # registry reports this as "backend not usable"
    raise ImportError("bik triton backend: the triton package is not installed") from error

import torch

from ...contract import KEY_BLOCK, MATMUL_BLOCK_K
from ..base import Backend
from ._common import INTERPRET
from .attention_launch import attention, paged_attention
from .chunked import chunked_matmul
from .delta_rule import delta_rule
from .grouped import grouped_matmul
from .log_softmax import log_softmax, token_logprobs
from .matmul import matmul
from .rms_norm import rms_norm
from .selective_scan import selective_scan


def _needs_interpreter_on_cpu(device: torch.device) -> None:
    if device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "bik triton backend: CPU tensors need the Triton interpreter; "
            "set TRITON_INTERPRET=1 before bik (and triton) are imported"
        )


BACKEND = Backend(
    name="triton",
    device_types=("cuda", "cpu"),
    order=(
        f"Triton: matmul in BLOCK_K={MATMUL_BLOCK_K} tiles added in ascending order; one row "
        "(or row segment) per program, widths fixed by the row length; attention in "
        f"{KEY_BLOCK}-key blocks and fixed-size splits merged in ascending order"
    ),
    matmul=matmul,
    rms_norm=rms_norm,
    log_softmax=log_softmax,
    token_logprobs=token_logprobs,
    attention=attention,
    paged_attention=paged_attention,
    grouped_matmul=grouped_matmul,
    chunked_matmul=chunked_matmul,
    delta_rule=delta_rule,
    selective_scan=selective_scan,
    attention_sinks=True,
    extra_device_check=_needs_interpreter_on_cpu,
)
