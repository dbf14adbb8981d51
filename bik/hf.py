"""Hugging Face integration: patch_model / unpatch_model and the trainer-side log-prob helper.

After ``bik.patch_model(model)`` every reduction of the forward runs through bik: Linear
layers (lm_head included) through ``bik.linear``, RMSNorm through ``bik.rms_norm``, and
attention through ``bik.attention``, registered in transformers' attention-function registry
as "bik". Then the log-probs of tokens sampled by ``model.generate`` (KV cache, left-padded
batches) equal those of one full forward of the finished sequences, bit for bit.

What bik cannot compute is never ignored: attention keywords it does not implement (sinks,
an active sliding window, dropout...) raise when the model runs. Under
``torch.autocast`` each patched module returns the dtype the unpatched one would, and the
kernels run on the cast inputs with autocast off, so results stay batch-invariant.
"""

import dataclasses
import weakref

import torch

from . import backends
from .backends import reference
from .contract import check_split_size
from .ops.activations import gelu_tanh, sigmoid, silu
from .ops.attention import attention
from .ops.log_softmax import token_logprobs
from .ops.matmul import linear
from .ops.moe import expert_mlp, route
from .ops.rms_norm import rms_norm
from .ops.rotary import rotary_cos_sin

# Mixture-of-experts families: their router, experts and MoE block are patched too.
MOE_FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe")
# Families whose RMSNorm scales by (1 + weight) in fp32 and rounds once.
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "olmo2",
    *GEMMA_FAMILIES,
    *MOE_FAMILIES,
)
ATTENTION_NAME = "bik"
_UNPATCH_ADVICE = (
    f"call bik.unpatch_model(model) to run it with its own attention (bik patches the "
    f"{', '.join(SUPPORTED_FAMILIES)} families)"
)


@dataclasses.dataclass
class PatchReport:
    """What patch_model did: module name -> what it now runs, and the modules that reduce
    (so their bits can depend on the batch) but could not be patched."""

    family: str
    backend: str
    patched: dict
    unpatched: list
    attention_was: str
    split_size: int | None = None

    def __str__(self) -> str:
        kinds = {}
        for kind in self.patched.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        lines = [f"bik.patch_model: {self.family} model, backend {self.backend!r}"]
        lines += [f"  {count:4d} x {kind}" for kind, count in sorted(kinds.items())]
        lines.append(f"  attention: {ATTENTION_NAME} (was {self.attention_was})")
        if self.unpatched:
            lines.append(f"  NOT patched ({len(self.unpatched)}): {', '.join(self.unpatched)}")
        return "\n".join(lines)


# -- autocast ------------------------------------------------------------------------------


def _autocast_dtype(device_type):
    """The dtype torch.autocast casts a matmul's inputs to on ``device_type``, or None."""
    if not torch._C._is_any_autocast_enabled():  # the common case, checked cheaply first
        return None
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta...)
        return None
    return torch.get_autocast_dtype(device_type)


def _autocast_cast(t, dtype):
    # torch's own eligibility rule: floating tensors other than fp64 are cast.
    if t is not None and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t


def _run(backend, autocast_on, fn, *args, **kwargs):
    """``fn`` under ``backend`` ("auto": the caller's selection). ``autocast_on``: the device
    type of an active autocast, switched off around ``fn``: the patched forwards cast their
    inputs themselves, and bik's kernels keep their own dtypes."""
    if autocast_on is not None:
        with torch.autocast(autocast_on, enabled=False):
            return _run(backend, None, fn, *args, **kwargs)
    if backend == "auto" or backend == backends.get_backend():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # A compiled graph's bik ops resolve their backend when they run, from the global
        # selection: a per-module backend would silently not apply.
        raise RuntimeError(
            f"bik: this model was patched with backend={backend!r}, which torch.compile "
            f"cannot apply per module; call bik.set_backend({backend!r}) before running the "
            "compiled model (or patch with backend='auto')"
        )
    with backends.use_backend(backend):
        return fn(*args, **kwargs)


# -- Linear and RMSNorm --------------------------------------------------------------------


def _autocast_inputs(device_type, *tensors):
    """(the device type of an active autocast or None, ``tensors`` cast as torch.autocast
    would cast a matmul's inputs)."""
    autocast_dtype = _autocast_dtype(device_type)
    if autocast_dtype is None:
        return None, tensors
    return device_type, tuple(_autocast_cast(t, autocast_dtype) for t in tensors)


class _PatchedForward:
    """A patched module's forward. A plain object holding the module and the patch-time
    backend, not a closure or bound method, so deepcopy and pickle keep it."""

    def __init__(self, module, kind, backend):
        self.module, self.kind, self.backend = module, kind, backend

    def __call__(self, x):
        m, weight = self.module, self.module.weight
        if self.kind == "linear":
            autocast_on, (x, weight, bias) = _autocast_inputs(x.device.type, x, weight, m.bias)
            return _run(self.backend, autocast_on, linear, x, weight, bias)
        autocast_on, _ = _autocast_inputs(x.device.type)
        if self.kind == "gemma_rms_norm":  # x * inv_rms * (1 + w), fp32 math, one rounding
            wide, scale = x.float(), 1.0 + weight.float()
            return _run(self.backend, autocast_on, rms_norm, wide, scale, m.eps).to(x.dtype)
        # transformers' RMSNorm returns ``weight * normed.to(x.dtype)``: x's dtype promoted with
        # the weight's (fp32 for bf16 activations under autocast). bik computes in that dtype.
        if x.dtype != weight.dtype:
            dtype = torch.promote_types(x.dtype, weight.dtype)
            x, weight = x.to(dtype), weight.to(dtype)
        return _run(self.backend, autocast_on, rms_norm, x, weight, m.variance_epsilon)


class _EagerRotary:
    """A rotary embedding's forward, run eagerly even inside torch.compile. Its cos/sin are
    the one step of the model whose bits a compiler changes (inductor's vectorised cos/sin
    differ from eager's); the rest of the forward compiles to eager's bits, so compiled
    rollouts and eager training agree. Costs one graph break per forward.

    In the families bik supports, RoPE with fixed frequencies takes its cos/sin from
    bik.ops.rotary, the formula bik's vLLM layer uses too; dynamic variants (recomputed per
    length) and other families run transformers' code."""

    def __init__(self, module, bik_formula):
        self.module = module
        rope_type = getattr(module, "rope_type", "default")
        self.bik_formula = bik_formula and not any(
            kind in rope_type for kind in ("dynamic", "longrope")
        )

    def __call__(self, x, position_ids, *args, **kwargs):
        if self.bik_formula and not (args or kwargs):
            return _bik_cos_sin(self.module, x, position_ids)
        return _eager_forward(self.module, x, position_ids, *args, **kwargs)


@torch.compiler.disable
def _bik_cos_sin(module, x, position_ids):
    return rotary_cos_sin(module.inv_freq, position_ids, module.attention_scaling, x.dtype)


@torch.compiler.disable
def _eager_forward(module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


class _Activation:
    """An activation module's forward: bik.silu or bik.gelu_tanh, whose bits do not depend on
    the tensor's layout (torch's fp32 kernels' do); bik's vLLM layer calls bik.silu too."""

    def __init__(self, kind):
        self.kind = kind

    def __call__(self, x):
        return silu(x) if self.kind == "silu" else gelu_tanh(x)


# -- mixture of experts ----------------------------------------------------------------------

# Families whose router hands the experts fp32 weights; the others cast them to the logits'
# dtype first (transformers' code, kept so patched and unpatched models weigh experts alike).
_FP32_ROUTER_WEIGHTS = ("mixtral",)


class _Router:
    """A top-k router's forward: logits through bik.linear, then bik.ops.moe.route (softmax,
    top-k with ties to the lower expert index, renormalisation in rank order)."""

    def __init__(self, module, backend, family):
        self.module, self.backend = module, backend
        self.normalize = getattr(module, "norm_topk_prob", True)  # Mixtral always normalises
        self.fp32_weights = family in _FP32_ROUTER_WEIGHTS

    def __call__(self, hidden_states):
        m = self.module
        x = hidden_states.reshape(-1, m.weight.shape[1])
        autocast_on, (x, weight) = _autocast_inputs(x.device.type, x, m.weight)
        logits = _run(self.backend, autocast_on, linear, x, weight)
        weights, experts = _run(self.backend, autocast_on, route, logits, m.top_k, self.normalize)
        return logits, weights if self.fp32_weights else weights.to(logits.dtype), experts


class _Experts:
    """An experts module's forward (3-D gate_up_proj / down_proj weights): bik.ops.moe's
    expert_mlp, whose rows do not depend on which other tokens chose the same expert."""

    def __init__(self, module, backend):
        self.module, self.backend = module, backend

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        m = self.module
        autocast_on, (x, gate_up, down) = _autocast_inputs(
            hidden_states.device.type, hidden_states, m.gate_up_proj, m.down_proj
        )
        out = _run(
            self.backend, autocast_on, expert_mlp, x, top_k_index, top_k_weights, gate_up, down
        )
        return out.to(hidden_states.dtype)


class _MoeBlock:
    """A sparse MoE block's forward: router, experts and (Qwen2-MoE) the shared expert, whose
    gate goes through bik.sigmoid (torch's fp32 sigmoid depends on the tensor's layout)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, hidden_states):
        m = self.module
        if m.training and getattr(m, "jitter_noise", 0):
            raise NotImplementedError(
                f"bik: {type(m).__name__} multiplies its input by random router jitter "
                f"(router_jitter_noise={m.jitter_noise}) in training mode, which makes a "
                "token's routing depend on a random draw; call model.eval() or set "
                "config.router_jitter_noise = 0.0"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weights, experts = m.gate(x)
        out = m.experts(x, experts, weights)
        shared = getattr(m, "shared_expert", None)
        if shared is not None:
            out = out + sigmoid(m.shared_expert_gate(x)) * shared(x)
        return out.reshape(hidden_states.shape)


def _is_silu(module):
    return isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _moe_kind(module):
    """'router', 'experts' or 'moe_block' for the MoE modules of a family in MOE_FAMILIES."""
    name = type(module).__name__
    if name.endswith("TopKRouter"):
        return "router"
    if name.endswith("Experts") and _is_silu(getattr(module, "act_fn", None)):
        return "experts"  # other activations: not in the families bik supports; unpatched
    if name.endswith("SparseMoeBlock"):
        return "moe_block"
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


def _kind(module, family):
    """'linear', 'rms_norm', 'attention', 'rotary', 'silu', an MoE kind (see _moe_kind),
    'unpatched' (reduces, but bik cannot vouch for its order) or None (does no reduction of
    its own)."""
    moe_kind = _moe_kind(module) if family in MOE_FAMILIES else None
    if moe_kind is not None:
        return moe_kind
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if _is_rms_norm(module):
        return "rms_norm"
    name = type(module).__name__
    if family in GEMMA_FAMILIES and name.endswith("RMSNorm") and hasattr(module, "eps"):
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
        raise RuntimeError(
            "model: already patched by bik; call bik.unpatch_model(model) before patching again"
        )


def patch_model(
    model: torch.nn.Module,
    *,
    backend: str = "auto",
    strict: bool = True,
    split_size: int | None = None,
) -> PatchReport:
    """Route every reduction of ``model``'s forward through bik; returns a :class:`PatchReport`.

    strict: a module that reduces but cannot be made invariant (or an unsupported model family)
    raises ``ValueError`` naming it; with ``strict=False`` it is listed in ``report.unpatched``.
    Attention features bik does not implement (sinks, an active sliding window,
    dropout...) raise ``NotImplementedError`` when the model runs, strict or not.
    split_size: the attention's fixed split-KV size (None: ``bik.DEFAULT_SPLIT_SIZE``).
    The backend and split size live on the patched modules: deepcopy and pickle keep them.
    """
    _check_model(model)
    backends.check_name(backend)
    check_split_size(split_size)
    family = model.config.model_type
    if strict and family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model: family {family!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}); pass strict=False to bik.patch_model to patch "
            "what can be and list the rest in report.unpatched"
        )
    kinds = {name: _kind(module, family) for name, module in model.named_modules() if name}
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

    patched = {}
    settings = _AttentionSettings(backend, split_size)
    for name, kind in kinds.items():
        module = model.get_submodule(name)
        if kind in ("linear", "rms_norm"):
            module.forward = _PatchedForward(module, kind, backend)
            patched[name] = f"bik.{kind}"
        elif kind == "gemma_rms_norm":
            module.forward = _PatchedForward(module, kind, backend)
            patched[name] = "bik.rms_norm (scale 1 + weight)"
        elif kind == "attention":
            module._bik_attention = settings
            patched[name] = "bik.attention"
        elif kind == "rotary":
            module.forward = _EagerRotary(module, family in SUPPORTED_FAMILIES)
            patched[name] = "eager rotary (same cos/sin bits under torch.compile)"
        elif kind in ("silu", "gelu_tanh"):
            module.forward = _Activation(kind)
            patched[name] = f"bik.{kind}"
        elif kind == "router":
            module.forward = _Router(module, backend, family)
            patched[name] = "bik.linear + bik MoE routing (top-k, ties to the lower expert)"
        elif kind == "experts":
            module.forward = _Experts(module, backend)
            patched[name] = "bik.grouped_linear experts (summed in rank order)"
        elif kind == "moe_block":
            module.forward = _MoeBlock(module)
            patched[name] = "MoE block (a shared-expert gate through bik.sigmoid)"
    attention_was = model.config._attn_implementation
    _register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    report = PatchReport(family, backend, patched, unpatched, attention_was, split_size)
    model._bik_patch = report
    return report


def unpatch_model(model: torch.nn.Module) -> None:
    """Undo :func:`patch_model` exactly: original forwards and attention implementation."""
    report = getattr(model, "_bik_patch", None)
    if report is None:
        raise ValueError("model: not patched by bik (bik.unpatch_model undoes bik.patch_model)")
    for name, kind in report.patched.items():
        module = model.get_submodule(name)
        if kind == "bik.attention":
            vars(module).pop("_bik_attention", None)
        else:
            del module.forward  # the class's own forward shows again
    model.set_attn_implementation(report.attention_was)
    del model._bik_patch


# -- attention -----------------------------------------------------------------------------


class _AttentionSettings:
    """Backend and split size chosen at patch time, kept on each patched attention module."""

    def __init__(self, backend, split_size):
        self.backend, self.split_size = backend, split_size

    def __setstate__(self, state):
        # Unpickling a patched model in a fresh process: its config names the "bik" attention,
        # which must be registered before the model runs.
        vars(self).update(state)
        _register_attention()


_DEFAULT_SETTINGS = _AttentionSettings("auto", None)  # "bik" set on a config by hand


def _register_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # boolean [B, 1, Tq, Tk] or None


_last_bounds = [None]  # (weakref to the mask, key, bounds): every layer gets the same mask


@torch.compiler.disable  # reads the mask's values: one graph break per layer under compile
def _cached_kv_bounds(mask, batch, tq, tk, window):
    """:func:`_kv_bounds`, computed once per forward: all layers share the mask object."""
    if mask is None:
        return _kv_bounds(None, batch, tq, tk, window)
    # mask._version changes with every in-place edit of the mask
    key = (batch, tq, tk, mask.shape, mask.dtype, mask._version, window)
    cached = _last_bounds[0]  # one read: the entry is replaced whole, never edited
    if cached is not None and cached[0]() is mask and cached[1] == key:
        return cached[2]
    bounds = _kv_bounds(mask, batch, tq, tk, window)
    _last_bounds[0] = (weakref.ref(mask), key, bounds)
    return bounds


class _WindowActive(Exception):
    """A sliding window hides keys some query would otherwise see."""


def _kv_bounds(mask, batch, tq, tk, window):
    """Each row's first valid key and the number of keys in use, read off the mask, which
    must be exactly causal with left padding (anything else cannot be expressed to bik)."""
    if mask is None:
        kv_start, kv_len = torch.zeros(batch, dtype=torch.int32, device="cpu"), tk
    else:
        allowed = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
        allowed = allowed[:, 0].expand(batch, tq, tk)
        seen = allowed.any(1)  # [B, Tk]: keys some query sees (a window hides none of them)
        if not bool(seen.any(-1).all()):
            raise RuntimeError(
                "bik attention: attention_mask leaves a row with no key to attend to (a row of "
                "padding only); give every row at least one token"
            )
        kv_start = seen.int().argmax(-1)
        kv_len = tk - int(seen.flip(-1).int().argmax(-1).min())
        expected = reference.attention_mask(tq, kv_len, kv_start, causal=True)[:, 0]
        if not torch.equal(allowed[..., :kv_len], expected) or bool(allowed[..., kv_len:].any()):
            if window is not None and _windowed(expected, tq, kv_len, window).equal(
                allowed[..., :kv_len]
            ):
                raise _WindowActive
            raise RuntimeError(
                "bik attention: attention_mask is not causal with left padding (right padding "
                "or packed sequences), which bik cannot make invariant; pad on the left "
                "(tokenizer.padding_side = 'left') with one sequence per row"
            )
    if window is not None and kv_len - int(kv_start.min()) > window:
        raise _WindowActive
    return kv_start.to(torch.int32), kv_len


def _windowed(visible, tq, tk, window):
    """``visible`` [B, Tq, Tk] restricted to transformers' sliding window: query at position
    p sees keys in (p - window, p]."""
    keys = torch.arange(tk, device=visible.device)
    positions = torch.arange(tk - tq, tk, device=visible.device)
    return visible & (keys[None, :] > positions[:, None] - window)


# Keywords transformers passes for bookkeeping: RoPE is applied and the cache updated before
# the attention function runs, so they do not change what it computes.
_BOOKKEEPING = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "output_hidden_states",  # the model collects hidden states; attention is unchanged
        "return_dict",
        "num_items_in_batch",  # a loss normaliser the HF Trainer passes through
    }
)
# What an attention keyword asks for, and what the caller can do instead.
_UNSUPPORTED = {
    "dropout": (
        "attention dropout",
        "call model.eval(), or set attention_dropout = 0.0 on the attention modules",
    ),
    "s_aux": ("attention sinks", _UNPATCH_ADVICE),
    "sliding_window": (
        "an active sliding window (a query would see more keys than the window allows; "
        "transformers' sliding-window cache then drops keys, which moves bik's key blocks)",
        "keep each sequence within the window, or " + _UNPATCH_ADVICE,
    ),
    "is_causal": ("non-causal attention", _UNPATCH_ADVICE),
    "output_attentions": (
        "returning attention weights (bik never materialises them)",
        "run the model without output_attentions=True",
    ),
    "position_bias": ("an additive position bias", _UNPATCH_ADVICE),
    **{
        key: ("packed (varlen) sequences", "pad on the left with one sequence per row")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    },
}


def _unsupported(module, keyword, value):
    family = getattr(getattr(module, "config", None), "model_type", "unknown")
    shown = (
        f"<tensor of shape {list(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
    )
    what, advice = _UNSUPPORTED.get(
        keyword, ("an attention keyword bik does not know", _UNPATCH_ADVICE)
    )
    return NotImplementedError(
        f"bik attention: {type(module).__name__} (model family {family!r}) was called with "
        f"{keyword}={shown}: {what}. bik's attention does not implement it, and ignoring it "
        f"could silently change the output. To fix: {advice}."
    )


def _check_keywords(module, dropout, kwargs):
    """Raise for every attention keyword that asks for something bik does not compute."""
    if dropout:
        raise _unsupported(module, "dropout", dropout)
    if not getattr(module, "is_causal", True) and kwargs.get("is_causal") is None:
        raise _unsupported(module, "is_causal", False)
    for keyword, value in kwargs.items():
        if keyword in _BOOKKEEPING or keyword == "sliding_window" or value is None:
            continue  # sliding_window is checked against the mask, in _kv_bounds
        if keyword == "softcap":
            continue  # computed: bik.attention's softcap
        if keyword == "is_causal" and value is True:
            continue
        if value is False and keyword != "is_causal":
            continue  # a feature switched off
        raise _unsupported(module, keyword, value)


def _attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers attention function: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (cache included)
    -> ([B, Tq, Hq, D], None)."""
    _check_keywords(module, dropout, kwargs)
    window = kwargs.get("sliding_window")
    batch, _, tq, _ = query.shape
    try:
        kv_start, kv_len = _cached_kv_bounds(attention_mask, batch, tq, key.shape[2], window)
    except _WindowActive:
        raise _unsupported(module, "sliding_window", window) from None
    settings = getattr(module, "_bik_attention", None) or _DEFAULT_SETTINGS
    # cast like F.scaled_dot_product_attention under autocast
    autocast_on, (query, key, value) = _autocast_inputs(query.device.type, query, key, value)
    out = _run(
        settings.backend,
        autocast_on,
        attention,
        query,
        key[:, :, :kv_len],
        value[:, :, :kv_len],
        causal=True,
        scale=scaling,
        kv_start=kv_start.to(query.device),
        split_size=settings.split_size,
        softcap=kwargs.get("softcap"),
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
