"""patch_model / unpatch_model: route every reduction of a Hugging Face causal LM through bik."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import backends, packed_weights
from ..contract import TP_CHUNKS, check_split_size
from ..families import FAMILIES, ROW_PARALLEL_NAMES, SUPPORTED_FAMILIES, Family
from .attention import ATTENTION_NAME, AttentionSettings, WholeCacheAttention, register_attention
from .classify import module_kind
from .forwards import Activation, EagerRotary, PatchedForward
from .linear_attention import (
    GatedAttention,
    GatedDeltaNet,
    GatedRMSNorm,
    KimiDeltaAttention,
    Mamba2Mixer,
)
from .moe import ClampedSwigluExperts, Experts, GroupedSigmoidRouter, MoeBlock, Router

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclasses.dataclass
class PatchReport:
    """What patch_model did: module name -> what it now runs, and the modules that reduce
    (so their bits can depend on the batch) but could not be patched."""

    family: str
    backend: str
    patched: dict[str, str]
    unpatched: list[str]
    attention_was: str
    split_size: int | None = None
    tp_invariant: bool = False
    packed_weights: bool = False

    def __str__(self) -> str:
        kinds: dict[str, int] = {}
        for kind in self.patched.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        lines = [f"bik.patch_model: {self.family} model, backend {self.backend!r}"]
        lines += [f"  {count:4d} x {kind}" for kind, count in sorted(kinds.items())]
        lines.append(f"  attention: {ATTENTION_NAME} (was {self.attention_was})")
        if self.packed_weights:
            lines.append("  linear weights packed once (bik.pack_weights)")
        if self.unpatched:
            lines.append(f"  NOT patched ({len(self.unpatched)}): {', '.join(self.unpatched)}")
        return "\n".join(lines)


def _router(module: torch.nn.Module, backend: str, family: Family | None) -> Router:
    assert family is not None  # module_kind finds routers in a supported MoE family only
    return Router(module, backend, family)


# A module kind (see classify.module_kind) -> (its new forward, from the module, the backend
# and the family record or None; what the report says it now runs). Attention is not here:
# it goes through transformers' registry, with its settings on the module.
_Forward = Callable[[torch.nn.Module, str, Family | None], Callable]
_FORWARDS: dict[str, tuple[_Forward, str]] = {
    "linear": (lambda m, backend, _: PatchedForward(m, "linear", backend), "bik.linear"),
    "rms_norm": (lambda m, backend, _: PatchedForward(m, "rms_norm", backend), "bik.rms_norm"),
    "gemma_rms_norm": (
        lambda m, backend, _: PatchedForward(m, "gemma_rms_norm", backend),
        "bik.rms_norm (scale 1 + weight)",
    ),
    "rotary": (
        lambda m, _, family: EagerRotary(m, family is not None and family.bik_rotary),
        "eager rotary (same cos/sin bits under torch.compile)",
    ),
    "silu": (lambda m, backend, _: Activation("silu"), "bik.silu"),
    "gelu_tanh": (lambda m, backend, _: Activation("gelu_tanh"), "bik.gelu_tanh"),
    "router": (
        _router,
        "bik.linear + bik MoE routing (top-k, ties to the lower expert)",
    ),
    "grouped_sigmoid_router": (
        lambda m, backend, _: GroupedSigmoidRouter(m, backend),
        "bik.linear + sigmoid routing (score bias, group-limited top-k, ties to the lower index)",
    ),
    "experts": (
        lambda m, backend, _: Experts(m, backend),
        "bik.grouped_linear experts (summed in rank order)",
    ),
    "clamped_swiglu_experts": (
        lambda m, backend, _: ClampedSwigluExperts(m, backend),
        "bik.grouped_linear experts with biases and the clamped SwiGLU (summed in rank order)",
    ),
    "moe_block": (
        lambda m, backend, _: MoeBlock(m),
        "MoE block (a shared-expert gate through bik.sigmoid)",
    ),
    "gated_delta_net": (
        lambda m, backend, _: GatedDeltaNet(m),
        "Gated DeltaNet (bik.layers.delta_rule: causal_conv1d, gated_delta_rule)",
    ),
    "gated_rms_norm": (
        lambda m, backend, _: GatedRMSNorm(m, backend),
        "bik.rms_norm times its gate through bik.silu or bik.sigmoid",
    ),
    "gated_attention": (
        lambda m, backend, _: GatedAttention(m),
        "bik.attention, its output gate through bik.sigmoid",
    ),
    "kimi_delta_attention": (
        lambda m, backend, _: KimiDeltaAttention(m),
        "Kimi Delta Attention (bik.layers.delta_rule, a decay per key channel)",
    ),
    "mamba2_mixer": (
        lambda m, backend, _: Mamba2Mixer(m, backend),
        "Mamba2 mixer (bik.layers: causal_conv1d, selective_scan; gated group RMSNorm)",
    ),
}
RECURRENT_KINDS = frozenset({"gated_delta_net", "kimi_delta_attention", "mamba2_mixer"})
# Modules that a patched parent computes itself: (the parent's kind, the child's name).
_COMPUTED_BY_PARENT = (
    ("gated_delta_net", "conv1d"),
    ("kimi_delta_attention", "conv1d"),
    ("kimi_delta_attention", "forget_gate"),
    ("mamba2_mixer", "conv1d"),
    ("mamba2_mixer", "norm"),
)


def _sliding_window(module: torch.nn.Module) -> int | None:
    """An attention module's sliding window: its own (None on a full-attention layer of a
    model that alternates), else its config's (Mistral's window for every layer)."""
    if hasattr(module, "sliding_window"):
        return cast(int | None, module.sliding_window)
    return getattr(getattr(module, "config", None), "sliding_window", None)


def _check_model(model: torch.nn.Module) -> None:
    from transformers import GenerationMixin, PreTrainedModel

    if (
        not isinstance(model, PreTrainedModel)
        or not isinstance(model, GenerationMixin)
        or not hasattr(model, "lm_head")
    ):
        raise TypeError(
            f"model: expected a Hugging Face causal LM (PreTrainedModel with a "
            f"generate() and an lm_head), got {type(model).__name__}"
        )
    if hasattr(model, "_bik_patch"):
        raise RuntimeError(
            "model: already patched by bik; call bik.unpatch_model(model) before patching again"
        )


_EXPERTS: dict[str, type[Experts]] = {
    "experts": Experts,
    "clamped_swiglu_experts": ClampedSwigluExperts,
}
_WHOLE_CACHE = "bik.attention, a sliding window over whole cache layers"
_ROW_PARALLEL = f"bik.distributed.chunked_linear ({TP_CHUNKS} chunks: TP-invariant)"


def _row_parallel(model: torch.nn.Module, kinds: dict[str, str | None]) -> set[str]:
    """The names of ``model``'s row-parallel layers for ``tp_invariant=True``: its
    row-parallel linears (``ROW_PARALLEL_NAMES``) and its experts modules (whose down
    projection tensor parallelism splits along K, the intermediate size); a ValueError when
    the order cannot apply to the model."""
    names = {
        name
        for name, kind in kinds.items()
        if (kind == "linear" and name.rsplit(".", 1)[-1] in ROW_PARALLEL_NAMES) or kind in _EXPERTS
    }
    if not names:
        raise ValueError(
            f"tp_invariant: the model has no row-parallel linear ({', '.join(ROW_PARALLEL_NAMES)})"
        )
    for name in sorted(names):
        module = model.get_submodule(name)
        experts = _EXPERTS.get(kinds[name] or "")
        if experts is not None:
            k = experts.intermediate_size(module)
        else:
            k = cast(torch.Tensor, module.weight).shape[1]
        if k % TP_CHUNKS:
            raise ValueError(
                f"tp_invariant: {name} has K = {k} input features, not divisible by "
                f"bik.contract.TP_CHUNKS = {TP_CHUNKS}"
            )
    return names


def _tp_invariant_forward(
    module: torch.nn.Module, kind: str | None, backend: str
) -> tuple[Any, str]:
    """A row-parallel layer's forward in the TP-invariant order, and its report line."""
    experts = _EXPERTS.get(kind or "")
    if experts is None:
        return PatchedForward(module, "row_parallel_linear", backend), _ROW_PARALLEL
    description = f"{_FORWARDS[cast(str, kind)][1]}, down projection in {_ROW_PARALLEL}"
    return experts(module, backend, down_chunks=TP_CHUNKS), description


def patch_model(
    model: PreTrainedModel,
    *,
    backend: str = "auto",
    strict: bool = True,
    split_size: int | None = None,
    tp_invariant: bool = False,
    pack_weights: bool = False,
) -> PatchReport:
    """Route every reduction of ``model``'s forward through bik; returns a :class:`PatchReport`.

    strict: a module that reduces but cannot be made invariant (or an unsupported model family)
    raises ``ValueError`` naming it; with ``strict=False`` it is listed in ``report.unpatched``.
    Attention features bik does not implement (dropout, non-causal attention...) raise
    ``NotImplementedError`` when the model runs, strict or not. A sliding-window layer's
    cache is kept whole (bik.hf.attention.WholeCacheAttention): the window masks keys
    instead of the cache dropping them.
    split_size: the attention's fixed split-KV size (None: ``bik.DEFAULT_SPLIT_SIZE``).
    tp_invariant: the row-parallel linears (``o_proj``, ``down_proj``) reduce K in
    ``bik.contract.TP_CHUNKS`` chunks summed by a fixed tree (``bik.distributed.chunked_linear``),
    the order bik's vLLM engine computes at every tensor-parallel degree, so the model's bits
    equal a TP 1, 2, 4 or 8 rollout's (``bik.vllm.LLM(..., tp_invariant=True)``). Off, they run
    ``bik.linear``. A mixture-of-experts model's experts run their down projections in the
    same order. K must be divisible by ``TP_CHUNKS`` (else ValueError).
    pack_weights: keep each linear weight packed in the CPU kernel's layout once used, instead
    of packing it on every call (``bik.pack_weights``: faster decoding, the same bits, one
    packed copy per weight; writes through ``.data`` need ``bik.weights_changed()``).
    The backend and split size live on the patched modules: deepcopy and pickle keep them.
    """
    _check_model(model)
    backends.check_name(backend)
    check_split_size(split_size)
    if not isinstance(tp_invariant, bool):
        raise TypeError(f"tp_invariant: expected a bool, got {tp_invariant!r}")
    if not isinstance(pack_weights, bool):
        raise TypeError(f"pack_weights: expected a bool, got {pack_weights!r}")
    model_type = model.config.model_type
    family = FAMILIES.get(model_type)
    if strict and family is None:
        raise ValueError(
            f"model: family {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); pass strict=False to bik.patch_model to patch "
            "what can be and list the rest in report.unpatched"
        )
    kinds = {name: module_kind(module, family) for name, module in model.named_modules() if name}
    for parent, kind in list(kinds.items()):
        for parent_kind, child in _COMPUTED_BY_PARENT:
            if kind == parent_kind:
                kinds[f"{parent}.{child}"] = None
    unpatched = [
        f"{name} ({type(model.get_submodule(name)).__name__})"
        for name, kind in kinds.items()
        if kind == "unpatched"
    ]
    if strict and unpatched:
        raise ValueError(
            f"model: cannot make these modules invariant: {', '.join(unpatched)}; pass "
            "strict=False to bik.patch_model to patch the rest and list them in report.unpatched"
        )

    row_parallel = _row_parallel(model, kinds) if tp_invariant else set()
    patched = {}
    # A recurrent layer carries its state across a packed row's sequences: such a model's
    # packed forwards stay refused (bik.hf.packed).
    recurrent = any(kind in RECURRENT_KINDS for kind in kinds.values())
    settings = AttentionSettings(backend, split_size, packing=not recurrent)
    for name, kind in kinds.items():
        module = model.get_submodule(name)
        if kind in ("attention", "gated_attention"):
            # torch hints Module.__setattr__ for tensors and modules; any value is allowed
            module._bik_attention = settings  # type: ignore[assignment]
            patched[name] = "bik.attention"
            if kind == "attention" and _sliding_window(module) is not None:
                module.forward = WholeCacheAttention(module)
                patched[name] = _WHOLE_CACHE
            if kind == "gated_attention":
                make_forward, patched[name] = _FORWARDS[kind]
                module.forward = make_forward(module, backend, family)
        elif name in row_parallel:
            module.forward, patched[name] = _tp_invariant_forward(module, kind, backend)
        elif kind in _FORWARDS:
            make_forward, patched[name] = _FORWARDS[kind]
            module.forward = make_forward(module, backend, family)
    attention_was = model.config._attn_implementation
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if pack_weights:
        packed_weights.pack_weights(model)
        for name in patched:
            forward = model.get_submodule(name).forward
            if isinstance(forward, PatchedForward):
                forward.pack_weight = True
    report = PatchReport(
        model_type,
        backend,
        patched,
        unpatched,
        attention_was,
        split_size,
        tp_invariant,
        pack_weights,
    )
    model._bik_patch = report  # type: ignore[assignment]  # as above: any value is allowed
    return report


def unpatch_model(model: PreTrainedModel) -> None:
    """Undo :func:`patch_model` exactly: original forwards and attention implementation."""
    report = getattr(model, "_bik_patch", None)
    if report is None:
        raise ValueError("model: not patched by bik (bik.unpatch_model undoes bik.patch_model)")
    for name, kind in report.patched.items():
        module = model.get_submodule(name)
        vars(module).pop("_bik_attention", None)
        if kind != "bik.attention":
            del module.forward  # the class's own forward shows again
    model.set_attn_implementation(report.attention_was)
    if report.packed_weights:
        packed_weights.unpack_weights(model)
    del model._bik_patch
