"""Which modules of a model patch_model replaces, and which reduce but cannot be patched."""

import torch

from ..families import Family


def _is_silu(module):
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _moe_kind(module):
    """'router', 'grouped_sigmoid_router', 'experts', 'clamped_swiglu_experts' or
    'moe_block' for the MoE modules of a mixture-of-experts family."""
    name = type(module).__name__
    if name.endswith("TopKRouter"):
        return "router"
    if name.endswith("TopkRouter") and hasattr(module, "e_score_correction_bias"):
        return "grouped_sigmoid_router"  # DeepSeek-V3 style: sigmoid, bias, groups
    if name.endswith("Experts") and _is_silu(getattr(module, "act_fn", None)):
        return "experts"  # other activations: not in the families bik supports; unpatched
    if name.endswith("Experts") and hasattr(module, "limit") and hasattr(module, "alpha"):
        return "clamped_swiglu_experts"  # gpt-oss
    if name.endswith("SparseMoeBlock"):
        return "moe_block"
    return None


def _recurrent_kind(module, recurrent):
    """The kind of a module of a hybrid family whose recurrent layers are of kind ``recurrent``
    (bik.families.Family.recurrent): its recurrent layer, its gated RMSNorm, and (Qwen3-Next,
    Qwen3.5) its gated full attention; None for the others."""
    name = type(module).__name__
    layer = {
        "gated_deltanet": ("GatedDeltaNet", "gated_delta_net"),
        "kimi_delta": ("DeltaAttention", "kimi_delta_attention"),
        "mamba2": ("Mamba2Mixer", "mamba2_mixer"),
    }[recurrent]
    if name.endswith(layer[0]):
        return layer[1]
    if recurrent == "mamba2":  # its gated norm belongs to the mixer (group-wise)
        return None
    if name.endswith("RMSNormGated") and hasattr(module, "variance_epsilon"):
        return "gated_rms_norm"
    if recurrent == "gated_deltanet" and name.endswith("Attention") and hasattr(module, "config"):
        return "gated_attention"
    return None


def _is_rms_norm(module):
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _is_gelu_tanh(module):
    if isinstance(module, torch.nn.GELU):
        return module.approximate == "tanh"
    return type(module).__name__ == "GELUTanh"


# torch.nn modules without weights of their own that still reduce over something.
_REDUCING_TYPES = tuple(
    getattr(torch.nn, name)
    for name in (
        "Softmax",
        "LogSoftmax",
        "Softmin",
        "Softmax2d",
        "LayerNorm",
        "GroupNorm",
        "LocalResponseNorm",
        *(f"{kind}{d}d" for kind in ("BatchNorm", "InstanceNorm") for d in (1, 2, 3)),
        *(f"{kind}{d}d" for kind in ("AvgPool", "AdaptiveAvgPool", "LPPool") for d in (1, 2)),
        "AvgPool3d",
        "AdaptiveAvgPool3d",
        "CosineSimilarity",
        "PairwiseDistance",
    )
)
# Class-name endings of model code that reduces: norms, attention, poolers, MoE routing and
# expert combination. Containers (layers, blocks, MLPs), elementwise activations, dropout and
# rotary embeddings do no reduction of their own and are not listed.
_REDUCING_SUFFIXES = (
    "Norm",
    "Attention",
    "Softmax",
    "Pool",
    "Pooler",
    "Pooling",
    "Experts",
    "Router",
    "MoeBlock",
    "MoE",
    "Moe",
)


# MoE blocks whose forward only composes their children (router, experts, a shared-expert MLP)
# with elementwise additions: they reduce nothing themselves (read from transformers' source).
_COMPOSING_MOE_BLOCKS = ("Glm4MoeMoE", "DeepseekV3MoE", "KimiLinearMoE")


def module_kind(module: torch.nn.Module, family: Family | None) -> str | None:
    """'linear', 'rms_norm', 'gemma_rms_norm', 'attention', 'rotary', 'silu', 'gelu_tanh',
    an MoE kind (see _moe_kind), a recurrent family's kind (see _recurrent_kind),
    'unpatched' (reduces, but bik cannot vouch for its order) or
    None (does no reduction of its own). ``family``: None for a family bik does not support."""
    moe_kind = _moe_kind(module) if family is not None and family.moe else None
    if moe_kind is not None:
        return moe_kind
    if family is not None and type(module).__name__ in _COMPOSING_MOE_BLOCKS:
        return None
    recurrent_kind = (
        _recurrent_kind(module, family.recurrent) if family and family.recurrent else None
    )
    if recurrent_kind is not None:
        return recurrent_kind
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if _is_rms_norm(module):
        return "rms_norm"
    name = type(module).__name__
    if (
        family is not None
        and family.gemma_norm
        and name.endswith("RMSNorm")
        and hasattr(module, "eps")
    ):
        return "gemma_rms_norm"
    if name.endswith("Attention") and hasattr(module, "config"):
        return "attention"
    if name.endswith("RotaryEmbedding"):
        return "rotary"
    if _is_silu(module):
        return "silu"
    if _is_gelu_tanh(module):
        return "gelu_tanh"
    if isinstance(module, torch.nn.Embedding):  # a lookup (EmbeddingBag sums: not this class)
        return None
    owns_weights = next(module.parameters(recurse=False), None) is not None
    if owns_weights or isinstance(module, _REDUCING_TYPES) or name.endswith(_REDUCING_SUFFIXES):
        return "unpatched"
    return None
