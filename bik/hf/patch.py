"""patch_model / unpatch_model: route every reduction of a Hugging Face causal LM through bik."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import backends, packed_weights
from ..contract import TP_CHUNKS, check_split_size
from ..families import FAMILIES, ROW_PARALLEL_NAMES, SUPPORTED_FAMILIES, Family
from .attention import ATTENTION_NAME, AttentionSettings, WholeCacheAttention, register_attention
from .forwards import PatchedForward
from .kinds import UNPATCHED, LayerKind, classify

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


_WHOLE_CACHE = "bik.attention, a sliding window over whole cache layers"
_ROW_PARALLEL = f"bik.distributed.chunked_linear ({TP_CHUNKS} chunks: TP-invariant)"


Kinds = dict[str, LayerKind | None]


def _row_parallel(model: torch.nn.Module, kinds: Kinds) -> set[str]:
    """The names of ``model``'s row-parallel layers for ``tp_invariant=True``: its
    row-parallel linears (``ROW_PARALLEL_NAMES``) and its experts modules (whose down
    projection tensor parallelism splits along K, the intermediate size); a ValueError when
    the order cannot apply to the model."""
    names = {
        name
        for name, kind in kinds.items()
        if kind is not None
        and (
            (kind.name == "linear" and name.rsplit(".", 1)[-1] in ROW_PARALLEL_NAMES)
            or kind.experts is not None
        )
    }
    if not names:
        raise ValueError(
            f"tp_invariant: the model has no row-parallel linear ({', '.join(ROW_PARALLEL_NAMES)})"
        )
    for name in sorted(names):
        module = model.get_submodule(name)
        experts = cast(LayerKind, kinds[name]).experts
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
    module: torch.nn.Module, kind: LayerKind, backend: str
) -> tuple[Any, str]:
    """A row-parallel layer's forward in the TP-invariant order, and its report line."""
    if kind.experts is None:
        return PatchedForward(module, "row_parallel_linear", backend), _ROW_PARALLEL
    description = f"{kind.computes}, down projection in {_ROW_PARALLEL}"
    return kind.experts(module, backend, down_chunks=TP_CHUNKS), description


def _check(
    model: PreTrainedModel, backend: str, split_size: int | None, tp_invariant: bool, pack: bool
) -> Family | None:
    """Refuse what cannot be patched, before any change; returns the model's family record
    (None: a family bik does not support)."""
    _check_model(model)
    backends.check_name(backend)
    check_split_size(split_size)
    if not isinstance(tp_invariant, bool):
        raise TypeError(f"tp_invariant: expected a bool, got {tp_invariant!r}")
    if not isinstance(pack, bool):
        raise TypeError(f"pack_weights: expected a bool, got {pack!r}")
    return FAMILIES.get(model.config.model_type)


def _classify(model: torch.nn.Module, family: Family | None) -> Kinds:
    """Every named module's kind (bik.hf.kinds.classify); the submodules a patched parent
    computes itself (its kind's ``children``) have none."""
    kinds = {name: classify(module, family) for name, module in model.named_modules() if name}
    for parent, kind in list(kinds.items()):
        for child in kind.children if kind is not None else ():
            kinds[f"{parent}.{child}"] = None
    return kinds


def _patch(
    model: torch.nn.Module,
    kinds: Kinds,
    family: Family | None,
    backend: str,
    split_size: int | None,
    row_parallel: set[str],
) -> dict[str, str]:
    """Give every module of a patched kind its new forward (attention its settings); returns
    what each one now computes."""
    patched = {}
    # A recurrent layer carries its state across a packed row's sequences: such a model's
    # packed forwards stay refused (bik.hf.packed).
    recurrent = any(kind is not None and kind.recurrent for kind in kinds.values())
    settings = AttentionSettings(backend, split_size, packing=not recurrent)
    for name, kind in kinds.items():
        if kind is None or kind is UNPATCHED:
            continue
        module = model.get_submodule(name)
        patched[name] = kind.computes
        if kind.attention:
            # torch hints Module.__setattr__ for tensors and modules; any value is allowed
            module._bik_attention = settings  # type: ignore[assignment]
            if kind.forward is None and _sliding_window(module) is not None:
                module.forward = WholeCacheAttention(module)
                patched[name] = _WHOLE_CACHE
        if name in row_parallel:
            module.forward, patched[name] = _tp_invariant_forward(module, kind, backend)
        elif kind.forward is not None:
            module.forward = kind.forward(module, backend, family)
    return patched


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
    family = _check(model, backend, split_size, tp_invariant, pack_weights)
    model_type = model.config.model_type
    if strict and family is None:
        raise ValueError(
            f"model: family {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); pass strict=False to bik.patch_model to patch "
            "what can be and list the rest in report.unpatched"
        )
    kinds = _classify(model, family)
    unpatched = [
        f"{name} ({type(model.get_submodule(name)).__name__})"
        for name, kind in kinds.items()
        if kind is UNPATCHED
    ]
    if strict and unpatched:
        raise ValueError(
            f"model: cannot make these modules invariant: {', '.join(unpatched)}; pass "
            "strict=False to bik.patch_model to patch the rest and list them in report.unpatched"
        )
    row_parallel = _row_parallel(model, kinds) if tp_invariant else set()
    patched = _patch(model, kinds, family, backend, split_size, row_parallel)
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
