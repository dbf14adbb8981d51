"""The layer kinds ``patch_model`` knows, one record each: how a module of the kind is
recognised, what forward replaces its own, and what the report says it now computes.

``patch_model`` checks the model, classifies every module (:func:`classify`: the first record
of :data:`KINDS` that recognises it, else one that reduces nothing, else :data:`UNPATCHED`),
patches each by its record and reports. A family that brings a new layer kind adds one record
here (its recogniser, its forward in ``forwards.py``, ``moe.py`` or ``linear_attention.py``);
a recurrent kind also gets a ``bik.families.RecurrentKind`` record (its name and config keys),
which the family's record points at. The engine's layers (``bik.vllm.layers.ENGINE_LAYERS``)
are keyed by the same names.

The order of :data:`KINDS` is the order of recognition: a family's mixture-of-experts and
recurrent kinds come first (their modules would otherwise read as unpatched or as plain
attention), then the kinds every family has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..families import (
    GATED_DELTA_NET,
    KIMI_DELTA_ATTENTION,
    MAMBA2_MIXER,
    Family,
    RecurrentKind,
)
from .forwards import Activation, EagerRotary, PatchedForward
from .linear_attention import (
    GatedAttention,
    GatedDeltaNet,
    GatedRMSNorm,
    KimiDeltaAttention,
    Mamba2Mixer,
)
from .moe import ClampedSwigluExperts, Experts, GroupedSigmoidRouter, MoeBlock, Router

Recogniser = Callable[[torch.nn.Module, Family | None], bool]
# A kind's new forward, from the module, the backend and the family record (None: a family
# bik does not support, patched with strict=False)
Forward = Callable[[torch.nn.Module, str, Family | None], Callable]


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of module (module doc).

    name: the kind's name (the report's, the families' and bik.vllm's). recognise: whether a
    module of a family is of this kind. computes: what the report says it now runs.
    forward: its new forward; None for attention, which transformers' attention registry
    routes to bik (its settings on the module). attention: it reads those settings (plain
    attention, and a gated attention that also gets a forward). children: its submodules
    that its forward computes itself (not patched on their own). recurrent: it carries a
    state across a packed row's sequences (bik.hf.packed refuses packing such a model).
    experts: the experts class whose down projection ``tp_invariant`` chunks."""

    name: str
    recognise: Recogniser
    computes: str
    forward: Forward | None = None
    attention: bool = False
    children: tuple[str, ...] = ()
    recurrent: bool = False
    experts: type[Experts] | None = None


def _type_name(module: object) -> str:
    return type(module).__name__


def _ends(suffix: str, *attributes: str) -> Recogniser:
    """A module whose class name ends with ``suffix`` and that has ``attributes``."""
    return lambda m, _: _type_name(m).endswith(suffix) and all(hasattr(m, a) for a in attributes)


def _moe(recognise: Recogniser) -> Recogniser:
    """``recognise`` within a mixture-of-experts family."""
    return lambda m, family: family is not None and family.moe and recognise(m, family)


def _recurrent(kind: RecurrentKind, recognise: Recogniser) -> Recogniser:
    """``recognise`` within a hybrid family whose recurrent layers are of kind ``kind``."""
    return lambda m, family: (
        family is not None and family.recurrent is kind and recognise(m, family)
    )


def _is_silu(module: torch.nn.Module | None) -> bool:
    return isinstance(module, torch.nn.SiLU) or _type_name(module) == "SiLUActivation"


def _is_gelu_tanh(module: torch.nn.Module, _: Family | None) -> bool:
    if isinstance(module, torch.nn.GELU):
        return module.approximate == "tanh"
    return _type_name(module) == "GELUTanh"


def _gated_rms_norm(module: torch.nn.Module, family: Family | None) -> bool:
    """The gated RMSNorm of Qwen3-Next / Qwen3.5 and Kimi Linear (Mamba2's belongs to its
    mixer: group-wise)."""
    recurrent = family.recurrent if family is not None else None
    return (
        recurrent in (GATED_DELTA_NET, KIMI_DELTA_ATTENTION)
        and _type_name(module).endswith("RMSNormGated")
        and hasattr(module, "variance_epsilon")
    )


def _gemma_rms_norm(module: torch.nn.Module, family: Family | None) -> bool:
    return (
        family is not None
        and family.gemma_norm
        and _type_name(module).endswith("RMSNorm")
        and hasattr(module, "eps")
    )


def _router(module: torch.nn.Module, backend: str, family: Family | None) -> Router:
    assert family is not None  # a router is recognised in a supported MoE family only
    return Router(module, backend, family)


KINDS: tuple[LayerKind, ...] = (
    # -- mixture of experts
    LayerKind(
        "router",
        _moe(_ends("TopKRouter")),
        "bik.linear + bik MoE routing (top-k, ties to the lower expert)",
        _router,
    ),
    LayerKind(
        "grouped_sigmoid_router",  # DeepSeek-V3 style: sigmoid, score bias, groups
        _moe(_ends("TopkRouter", "e_score_correction_bias")),
        "bik.linear + sigmoid routing (score bias, group-limited top-k, ties to the lower index)",
        lambda m, backend, _: GroupedSigmoidRouter(m, backend),
    ),
    LayerKind(
        "experts",  # other activations: not in the families bik supports; unpatched
        _moe(
            lambda m, _: _type_name(m).endswith("Experts") and _is_silu(getattr(m, "act_fn", None))
        ),
        "bik.grouped_linear experts (summed in rank order)",
        lambda m, backend, _: Experts(m, backend),
        experts=Experts,
    ),
    LayerKind(
        "clamped_swiglu_experts",  # gpt-oss
        _moe(_ends("Experts", "limit", "alpha")),
        "bik.grouped_linear experts with biases and the clamped SwiGLU (summed in rank order)",
        lambda m, backend, _: ClampedSwigluExperts(m, backend),
        experts=ClampedSwigluExperts,
    ),
    LayerKind(
        "moe_block",
        _moe(_ends("SparseMoeBlock")),
        "MoE block (a shared-expert gate through bik.sigmoid)",
        lambda m, backend, _: MoeBlock(m),
    ),
    # -- the recurrent layers of hybrid families, their gated norms and gated attention
    LayerKind(
        GATED_DELTA_NET.name,
        _recurrent(GATED_DELTA_NET, _ends("GatedDeltaNet")),
        "Gated DeltaNet (bik.layers.delta_rule: causal_conv1d, gated_delta_rule)",
        lambda m, backend, _: GatedDeltaNet(m),
        children=("conv1d",),
        recurrent=True,
    ),
    LayerKind(
        KIMI_DELTA_ATTENTION.name,
        _recurrent(KIMI_DELTA_ATTENTION, _ends("DeltaAttention")),
        "Kimi Delta Attention (bik.layers.delta_rule, a decay per key channel)",
        lambda m, backend, _: KimiDeltaAttention(m),
        children=("conv1d", "forget_gate"),
        recurrent=True,
    ),
    LayerKind(
        MAMBA2_MIXER.name,
        _recurrent(MAMBA2_MIXER, _ends("Mamba2Mixer")),
        "Mamba2 mixer (bik.layers: causal_conv1d, selective_scan; gated group RMSNorm)",
        lambda m, backend, _: Mamba2Mixer(m, backend),
        children=("conv1d", "norm"),
        recurrent=True,
    ),
    LayerKind(
        "gated_rms_norm",
        _gated_rms_norm,
        "bik.rms_norm times its gate through bik.silu or bik.sigmoid",
        lambda m, backend, _: GatedRMSNorm(m, backend),
    ),
    LayerKind(
        "gated_attention",  # Qwen3-Next, Qwen3.5: full attention with an output gate
        _recurrent(GATED_DELTA_NET, _ends("Attention", "config")),
        "bik.attention, its output gate through bik.sigmoid",
        lambda m, backend, _: GatedAttention(m),
        attention=True,
    ),
    # -- every family
    LayerKind(
        "linear",
        lambda m, _: isinstance(m, torch.nn.Linear),
        "bik.linear",
        lambda m, backend, _: PatchedForward(m, "linear", backend),
    ),
    LayerKind(
        "rms_norm",
        _ends("RMSNorm", "variance_epsilon"),
        "bik.rms_norm",
        lambda m, backend, _: PatchedForward(m, "rms_norm", backend),
    ),
    LayerKind(
        "gemma_rms_norm",
        _gemma_rms_norm,
        "bik.rms_norm (scale 1 + weight)",
        lambda m, backend, _: PatchedForward(m, "gemma_rms_norm", backend),
    ),
    LayerKind("attention", _ends("Attention", "config"), "bik.attention", attention=True),
    LayerKind(
        "rotary",
        _ends("RotaryEmbedding"),
        "eager rotary (same cos/sin bits under torch.compile)",
        lambda m, _, family: EagerRotary(m, family is not None and family.bik_rotary),
    ),
    LayerKind("silu", lambda m, _: _is_silu(m), "bik.silu", lambda m, _, __: Activation("silu")),
    LayerKind(
        "gelu_tanh", _is_gelu_tanh, "bik.gelu_tanh", lambda m, _, __: Activation("gelu_tanh")
    ),
)

UNPATCHED = LayerKind("unpatched", lambda m, _: True, "reduces, but bik cannot vouch for its order")

# MoE blocks whose forward only composes their children (router, experts, a shared-expert MLP)
# with elementwise additions: they reduce nothing themselves (read from transformers' source).
_COMPOSING_MOE_BLOCKS = ("Glm4MoeMoE", "DeepseekV3MoE", "KimiLinearMoE")
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


def _reduces_nothing(module: torch.nn.Module, family: Family | None) -> bool:
    """A module that does no reduction of its own: a supported family's composing MoE block,
    an embedding (a lookup; EmbeddingBag sums: not this class)."""
    composing = family is not None and _type_name(module) in _COMPOSING_MOE_BLOCKS
    return composing or isinstance(module, torch.nn.Embedding)


def _reduces(module: torch.nn.Module) -> bool:
    """Whether a module of no known kind reduces: it owns weights, is a reducing torch.nn
    module, or its class name says so."""
    owns_weights = next(module.parameters(recurse=False), None) is not None
    return (
        owns_weights
        or isinstance(module, _REDUCING_TYPES)
        or _type_name(module).endswith(_REDUCING_SUFFIXES)
    )


def classify(module: torch.nn.Module, family: Family | None) -> LayerKind | None:
    """The kind of ``module`` in a model of ``family`` (None: a family bik does not support):
    the first of :data:`KINDS` that recognises it, None when it reduces nothing itself, or
    :data:`UNPATCHED` when it reduces but no kind vouches for its order."""
    for kind in KINDS:
        if kind.recognise(module, family):
            return kind
    if _reduces_nothing(module, family) or not _reduces(module):
        return None
    return UNPATCHED


def module_kind(module: torch.nn.Module, family: Family | None) -> str | None:
    """The name of ``module``'s kind (:func:`classify`), or None."""
    kind = classify(module, family)
    return None if kind is None else kind.name
