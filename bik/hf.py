"""Hugging Face integration: patch_model / unpatch_model and the trainer-side log-prob helper.

After ``bik.patch_model(model)`` every reduction of the forward runs through bik: Linear
layers (lm_head included) through ``bik.linear``, RMSNorm through ``bik.rms_norm``, and
attention through ``bik.attention``, registered in transformers' attention-function registry
as "bik". Then the log-probs of tokens sampled by ``model.generate`` (KV cache, left-padded
batches) equal those of one full forward of the finished sequences, bit for bit.
"""

import dataclasses
import types
import weakref

import torch

from . import backends
from .backends import reference
from .contract import check_split_size
from .ops.attention import attention
from .ops.log_softmax import token_logprobs
from .ops.matmul import linear
from .ops.rms_norm import rms_norm

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_NAME = "bik"
# Modules that run no reduction of their own: containers whose children do the work, lookups,
# elementwise activations, and rotary embeddings (an outer product: no sum over anything).
_SAFE_SUFFIXES = (
    "ForCausalLM",
    "Model",
    "DecoderLayer",
    "MLP",
    "RotaryEmbedding",
    "Activation",
    "ModuleList",
    "Embedding",
    "Identity",
    "SiLU",
    "GELU",
)


@dataclasses.dataclass
class PatchReport:
    """What patch_model did: module name -> what it now runs, and what it could not patch."""

    family: str
    backend: str
    patched: dict
    unpatched: list
    attention_was: str

    def __str__(self):
        kinds = {}
        for kind in self.patched.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        lines = [f"bik.patch_model: {self.family} model, backend {self.backend!r}"]
        lines += [f"  {count:4d} x {kind}" for kind, count in sorted(kinds.items())]
        lines.append(f"  attention: {ATTENTION_NAME} (was {self.attention_was})")
        if self.unpatched:
            lines.append(f"  NOT patched ({len(self.unpatched)}): {', '.join(self.unpatched)}")
        return "\n".join(lines)


def _in_backend(backend, fn):
    """``fn`` run under ``backend`` ("auto": the caller's current selection)."""
    if backend == "auto":
        return fn

    def scoped(*args, **kwargs):
        with backends.use_backend(backend):
            return fn(*args, **kwargs)

    return scoped


def _linear_forward(self, x):
    return linear(x, self.weight, self.bias)


def _rms_norm_forward(self, x):
    return rms_norm(x, self.weight, self.variance_epsilon)


def _is_rms_norm(module):
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _kind(name, module):
    """'linear', 'rms_norm', 'attention', 'safe', or None (cannot be made invariant)."""
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if _is_rms_norm(module):
        return "rms_norm"
    if type(module).__name__.endswith("Attention") and hasattr(module, "config"):
        return "attention"
    if isinstance(module, torch.nn.Dropout) or type(module).__name__.endswith(_SAFE_SUFFIXES):
        return "safe"
    return None


def _check_model(model):
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
        raise RuntimeError("model: already patched by bik; call bik.unpatch_model(model) first")


def patch_model(model, *, backend="auto", strict=True, split_size=None):
    """Route every reduction of ``model``'s forward through bik; returns a :class:`PatchReport`.

    strict: a module bik cannot make invariant (or an unsupported model family) raises
    ``ValueError`` naming it; with ``strict=False`` it is listed in ``report.unpatched``.
    split_size: the attention's fixed split-KV size (None: ``bik.DEFAULT_SPLIT_SIZE``).
    """
    _check_model(model)
    backends.check_name(backend)
    check_split_size(split_size)
    family = model.config.model_type
    if strict and family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model: family {family!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); pass strict=False to patch what can be"
        )
    kinds = {name: _kind(name, module) for name, module in model.named_modules() if name}
    unpatched = [
        f"{name} ({type(model.get_submodule(name)).__name__})"
        for name, kind in kinds.items()
        if kind is None
    ]
    if strict and unpatched:
        raise ValueError(f"model: cannot make these modules invariant: {', '.join(unpatched)}")

    forwards = {"linear": _linear_forward, "rms_norm": _rms_norm_forward}
    patched = {}
    for name, kind in kinds.items():
        if kind in forwards:
            module = model.get_submodule(name)
            module.forward = types.MethodType(_in_backend(backend, forwards[kind]), module)
            patched[name] = f"bik.{kind}"
        elif kind == "attention":
            patched[name] = "bik.attention"
    attention_was = model.config._attn_implementation
    _register_attention()
    _ATTENTION_SETTINGS[id(model.config)] = (backend, split_size)
    model.set_attn_implementation(ATTENTION_NAME)
    report = PatchReport(family, backend, patched, unpatched, attention_was)
    model._bik_patch = report
    return report


def unpatch_model(model):
    """Undo :func:`patch_model` exactly: original forwards and attention implementation."""
    report = getattr(model, "_bik_patch", None)
    if report is None:
        raise ValueError("model: not patched by bik")
    for name, kind in report.patched.items():
        if kind != "bik.attention":
            del model.get_submodule(name).forward  # the class's own forward shows again
    model.set_attn_implementation(report.attention_was)
    _ATTENTION_SETTINGS.pop(id(model.config), None)
    del model._bik_patch


# -- attention -----------------------------------------------------------------------------

_ATTENTION_SETTINGS = {}  # id(config) -> (backend name, split size) chosen at patch time


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # boolean [B, 1, Tq, Tk] or None


_last_bounds = {"mask": None, "key": None, "bounds": None}  # every layer gets the same mask


def _cached_kv_bounds(mask, batch, tq, tk):
    """:func:`_kv_bounds`, computed once per forward: all layers share the mask object."""
    if mask is None:
        return _kv_bounds(None, batch, tq, tk)
    key = (batch, tq, tk, mask.shape, mask.dtype)
    if (
        _last_bounds["mask"] is None
        or _last_bounds["mask"]() is not mask
        or _last_bounds["key"] != key
    ):
        _last_bounds.update(mask=weakref.ref(mask), key=key, bounds=_kv_bounds(mask, batch, tq, tk))
    return _last_bounds["bounds"]


def _kv_bounds(mask, batch, tq, tk):
    """Each row's first valid key and the number of keys in use, read off the mask, which
    must be exactly causal with left padding (anything else cannot be expressed to bik)."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.int32, device="cpu"), tk
    allowed = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
    allowed = allowed[:, 0].expand(batch, tq, tk)
    last_query = allowed[:, -1]
    if not bool(last_query.any(-1).all()):
        raise RuntimeError("bik attention: a row's last query sees no key; bik needs left padding")
    kv_start = last_query.int().argmax(-1)
    kv_len = tk - int(last_query.flip(-1).int().argmax(-1).min())
    expected = reference.attention_mask(tq, kv_len, kv_start, causal=True)[:, 0]
    if not torch.equal(allowed[..., :kv_len], expected) or bool(allowed[..., kv_len:].any()):
        raise RuntimeError(
            "bik attention: the attention mask is not causal with left padding "
            "(right padding, packing or a sliding window cannot be made invariant)"
        )
    return kv_start.to(torch.int32), kv_len


def _attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers attention function: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (cache included)
    -> ([B, Tq, Hq, D], None)."""
    if dropout and module.training:
        raise RuntimeError("bik attention: attention dropout is not supported")
    if not getattr(module, "is_causal", True):
        raise RuntimeError(f"bik attention: {type(module).__name__} is not causal")
    batch, _, tq, _ = query.shape
    kv_start, kv_len = _cached_kv_bounds(attention_mask, batch, tq, key.shape[2])
    backend, split_size = _ATTENTION_SETTINGS.get(id(module.config), ("auto", None))
    out = _in_backend(backend, attention)(
        query,
        key[:, :, :kv_len],
        value[:, :, :kv_len],
        causal=True,
        scale=scaling,
        kv_start=kv_start.to(query.device),
        split_size=split_size,
    )
    return out.transpose(1, 2), None


# -- trainer side --------------------------------------------------------------------------


def generation_position_ids(attention_mask):
    """Position ids exactly as transformers' generate derives them from the attention mask."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature=1.0):
    """Log-probs of ``input_ids`` under one full forward, as rollout computed them.

    Returns fp32 ``[B, T]``: entry t is log p(input_ids[t] | input_ids[:t]) where
    ``response_mask[:, t]`` is set, else 0 (position 0 has no prediction). Positions come from
    the attention mask as in generation, and the one-token shift is done here.
    """
    for name, t in (
        ("input_ids", input_ids),
        ("attention_mask", attention_mask),
        ("response_mask", response_mask),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor [B, T]")
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(input_ids.shape)}, got {tuple(t.shape)}"
            )
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=generation_position_ids(attention_mask),
        use_cache=False,
    ).logits
    logp = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logp.device)
    out[:, 1:] = torch.where(response_mask[:, 1:].bool(), logp, 0.0)
    return out
