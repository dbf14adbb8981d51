"""vLLM's layers routed to bik: the numerics both sides of a rollout/training pair share.

RMSNorm, SiLU-and-multiply and the rotary embedding are replaced through vLLM's out-of-tree
custom-op registry (``CustomOp.register_oot``): every one vLLM builds afterwards is bik's
subclass. Unquantized linear layers (the fused QKV and gate/up projections included) and the
LM head run ``bik.linear``; bik keeps their weights as loaded (vLLM's CPU path would repack
them for oneDNN), so a weight update written into the parameters is what the next step uses.
Each replacement computes what the bik-patched Hugging Face model computes for the same
layer, in the same dtype, so the two give the same bits.
"""

import torch
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from ..ops.activations import silu_and_mul
from ..ops.matmul import linear
from ..ops.rms_norm import rms_norm_like_transformers
from ..ops.rotary import apply_rotary, default_inv_freq, rotary_cos_sin


class BikRMSNorm(RMSNorm):
    """``rms_norm(x + residual)``; the residual sum is rounded in the activations' dtype, as
    the Hugging Face decoder layer's ``residual + hidden_states``."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None:
            raise NotImplementedError("bik.vllm: RMSNorm over part of the hidden size")
        if residual is not None:
            x = x + residual
            residual = x
        # self.weight: all ones when the norm has no weight of its own
        out = rms_norm_like_transformers(x, self.weight, self.variance_epsilon)
        return out if residual is None else (out, residual)


class BikSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class BikRotaryEmbedding(RotaryEmbedding):
    """Half-rotation ("neox") RoPE over the whole head, cos/sin from bik's formula."""

    bik_inv_freq: torch.Tensor  # a buffer (register_buffer below)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        init_cache: bool = True,
    ) -> None:
        if rotary_dim != head_size or not is_neox_style:
            raise NotImplementedError(
                "bik.vllm: rotary embedding over part of the head or interleaved (GPT-J style) "
                "is not supported"
            )
        super().__init__(
            head_size,
            rotary_dim,
            max_position_embeddings,
            base,
            is_neox_style,
            dtype,
            init_cache=False,
        )
        self.register_buffer("bik_inv_freq", default_inv_freq(base, rotary_dim), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        cos, sin = rotary_cos_sin(self.bik_inv_freq, positions, 1.0, query.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D] against [T, heads, D]
        return _rotate(query, cos, sin, self.head_size), _rotate(key, cos, sin, self.head_size)


def _rotate(
    x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, head_size: int
) -> torch.Tensor | None:
    if x is None:
        return None
    return apply_rotary(x.view(x.shape[0], -1, head_size), cos, sin).view(x.shape)


def _linear_apply(self, layer, x, bias=None):
    return linear(x, layer.weight, bias)


def _keep_weights(self, layer):
    """bik reads ``layer.weight`` as loaded: nothing to repack."""


_REPLACED_OPS = {
    "RMSNorm": BikRMSNorm,
    "SiluAndMul": BikSiluAndMul,
    "RotaryEmbedding": BikRotaryEmbedding,
}
_PATCHED_METHODS = (
    (UnquantizedLinearMethod, "apply", _linear_apply),
    (UnquantizedLinearMethod, "process_weights_after_loading", _keep_weights),
    (UnquantizedEmbeddingMethod, "apply", _linear_apply),  # the LM head
)
BIK_LAYERS = tuple(_REPLACED_OPS.values())


def install() -> None:
    """Register bik's layers with vLLM (once per process)."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    for name, cls in _REPLACED_OPS.items():
        if op_registry_oot.get(name) is not cls:
            CustomOp.register_oot(cls, name=name)
    for owner, name, method in _PATCHED_METHODS:
        setattr(owner, name, method)
