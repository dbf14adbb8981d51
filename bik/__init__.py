"""bik: batch-invariant kernels. A row's result never depends on how it was batched,
chunked or padded, so rollout and training compute the same bits."""

__version__ = "0.1.0"  # the one version source (setup.py reads it)

from typing import TYPE_CHECKING

try:
    import torch  # noqa: F401  (every module below needs it)
except ModuleNotFoundError as missing:  # a Python outside the project's virtualenv
    raise ModuleNotFoundError(
        f"bik needs torch ({missing}): run it with the project's virtualenv "
        "(`. .venv/bin/activate`, or `.venv/bin/python -m bik ...`); `make install` creates it"
    ) from None

from .backends import available_backends, get_backend, register_backend, set_backend, use_backend
from .contract import DEFAULT_SPLIT_SIZE, KEY_BLOCK
from .mode import batch_invariant_mode
from .ops.activations import gelu_tanh, sigmoid, silu, softplus
from .ops.attention import attention
from .ops.grouped_linear import grouped_linear
from .ops.log_softmax import log_softmax, token_logprobs
from .ops.matmul import linear, matmul
from .ops.rms_norm import rms_norm
from .packed_weights import pack_weights, packed_bytes, unpack_weights, weights_changed

if TYPE_CHECKING:  # what __getattr__ imports on first use; other names are errors
    from .hf import PatchReport, patch_model, sequence_logprobs, unpatch_model
else:

    def __getattr__(name: str) -> object:
        # The Hugging Face layer is imported on first use: the kernels never need transformers.
        if name in ("patch_model", "unpatch_model", "sequence_logprobs", "PatchReport"):
            from . import hf

            return getattr(hf, name)
        raise AttributeError(f"module 'bik' has no attribute {name!r}")


__all__ = [
    "DEFAULT_SPLIT_SIZE",
    "KEY_BLOCK",
    "PatchReport",
    "attention",
    "available_backends",
    "batch_invariant_mode",
    "gelu_tanh",
    "get_backend",
    "grouped_linear",
    "linear",
    "log_softmax",
    "matmul",
    "pack_weights",
    "packed_bytes",
    "patch_model",
    "register_backend",
    "rms_norm",
    "sequence_logprobs",
    "set_backend",
    "sigmoid",
    "silu",
    "softplus",
    "token_logprobs",
    "unpack_weights",
    "unpatch_model",
    "use_backend",
    "weights_changed",
]
