"""bik's attention in transformers' attention-function registry, under the name "bik".

transformers calls :func:`attention_forward` with the cache already updated and RoPE applied.
It reads each row's first valid key off the mask (left padding), refuses every keyword that
asks for something bik does not compute, and runs ``bik.attention``; over a
:class:`bik.hf.StaticDecoder`'s cache (its pages carry their lengths on the device) it runs
paged attention instead, reading nothing on the host.
"""

import functools
import weakref
from typing import Any

import torch

from .. import _checks
from ..backends import reference
from ..distributed import context
from ..families import SUPPORTED_FAMILIES
from ..ops.attention import attention
from . import packed
from .autocast import autocast_inputs, run
from .cache_keyword import pop_cache
from .static_decode import decode_attention, static_step_of, static_step_running

ATTENTION_NAME = "bik"
_UNPATCH_ADVICE = (
    f"call bik.unpatch_model(model) to run it with its own attention (bik patches the "
    f"{', '.join(SUPPORTED_FAMILIES)} families)"
)


class AttentionSettings:
    """Backend and split size chosen at patch time, kept on each patched attention module."""

    def __init__(self, backend: str, split_size: int | None, packing: bool = True) -> None:
        # packing: whether packed sequences are computed (False in a model with recurrent
        # layers, which would carry one sequence's state into the next: refused)
        self.backend, self.split_size, self.packing = backend, split_size, packing

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling a patched model in a fresh process: its config names the "bik" attention,
        # which must be registered before the model runs.
        vars(self).update(state)
        register_attention()


_DEFAULT_SETTINGS = AttentionSettings("auto", None)  # "bik" set on a config by hand


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # boolean [B, 1, Tq, Tk] or None


# (weakref to the mask, key, bounds): every layer gets the same mask
_last_bounds: list[tuple[weakref.ref[torch.Tensor], tuple[Any, ...], Any] | None] = [None]


@torch.compiler.disable  # reads the mask's values: one graph break per layer under compile
def _cached_kv_bounds(mask, batch, tq, tk, window, position_ids):
    """:func:`_kv_bounds`, computed once per forward: all layers share the mask object (and
    the position ids, read only under a sliding window)."""
    if window is None:
        position_ids = None
    if mask is None:
        return _kv_bounds(None, batch, tq, tk, window, position_ids)
    # a tensor's _version changes with every in-place edit of it
    ids = None if position_ids is None else (position_ids.data_ptr(), position_ids._version)
    key = (batch, tq, tk, mask.shape, mask.dtype, mask._version, window, ids)
    cached = _last_bounds[0]  # one read: the entry is replaced whole, never edited
    if cached is not None and cached[0]() is mask and cached[1] == key:
        return cached[2]
    bounds = _kv_bounds(mask, batch, tq, tk, window, position_ids)
    kv_start, kv_len, _ = bounds
    # built in [0, kv_len - 1] (the keys of the mask's runs): bik.attention, which gets the
    # keys up to kv_len, need not check it again in every layer
    _checks.known_in_range(kv_start, 0, max(kv_len - 1, 0))
    _last_bounds[0] = (weakref.ref(mask), key, bounds)
    return bounds


def _kv_bounds(mask, batch, tq, tk, window, position_ids):
    """Each row's first valid key, the number of keys in use, and whether the sliding
    ``window`` hides keys some query would otherwise see, read off the mask.

    A row's valid keys must be one contiguous run [start, end): left padding before it, and
    zeros after it (a sequence that stopped at EOS, or right padding), and every query inside
    the run must see exactly the keys from start to itself. Trailing zeros are exact under
    causal attention: no query before ``end`` sees a key at or after it. Queries outside the
    run are padding; no real query sees their outputs, and bik computes them causally from
    ``start`` (transformers' mask may give them other keys).

    Under an active window a decode step (or a later prefill chunk) sees no key before its
    window, so the mask cannot show where the row begins; the position ids can (see
    :func:`_first_keys`)."""
    if mask is None:
        active = window is not None and tk > window
        return torch.zeros(batch, dtype=torch.int32, device="cpu"), tk, active
    allowed = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
    allowed = allowed[:, 0].expand(batch, tq, tk)
    seen = allowed.any(1)  # [B, Tk]: keys some query sees (a window hides none of them)
    if not bool(seen.any(-1).all()):
        raise RuntimeError(
            "bik attention: attention_mask leaves a row with no key to attend to (a row of "
            "padding only); give every row at least one token"
        )
    keys = torch.arange(tk, device=seen.device)
    kv_start = seen.int().argmax(-1)
    kv_end = tk - seen.flip(-1).int().argmax(-1)
    run = (keys >= kv_start[:, None]) & (keys < kv_end[:, None])
    if not torch.equal(seen, run):
        raise RuntimeError(
            "bik attention: attention_mask has zeros between a row's tokens (packed "
            "sequences, or generation continuing a right-padded prompt), which bik cannot "
            "make invariant; give each row one sequence: padding before it (left padding) "
            "and, if any, zeros after its last token only"
        )
    # the keys in use: up to the last row's end, and at least as many as there are queries
    # (a full forward of a batch whose every row ends before its width: the queries past the
    # ends are padding, computed causally and never read)
    kv_len = max(int(kv_end.max()), tq)
    if window is not None:
        kv_start = _first_keys(kv_start, kv_end, position_ids, tq, tk, window)
    positions = keys[tk - tq :]
    real = (positions >= kv_start[:, None]) & (positions < kv_end[:, None])  # [B, Tq]
    expected = reference.attention_mask(tq, tk, kv_start, causal=True)[:, 0]
    if not torch.equal(allowed & real[..., None], expected & real[..., None]):
        windowed = _windowed(expected, tq, tk, window) if window is not None else None
        if windowed is not None and torch.equal(
            allowed & real[..., None], windowed & real[..., None]
        ):
            return kv_start.to(torch.int32), kv_len, True
        raise RuntimeError(
            "bik attention: attention_mask is not causal within a row (a query sees keys "
            "after itself, or misses keys of its own sequence), which bik cannot make "
            "invariant; pass the causal LM's own padding mask (1 for tokens, 0 for padding)"
        )
    active = window is not None and int((kv_end - kv_start).max()) > window
    return kv_start.to(torch.int32), kv_len, active


def _first_keys(seen_from, kv_end, position_ids, tq, tk, window):
    """Each row's first key under a sliding window: the first key some query sees
    (``seen_from``), unless the window of the call's first query starts there, so that an
    earlier key may be hidden; then the last query's index minus its position id, as
    transformers' generate and bik.sequence_logprobs number a row's tokens from 0 (no
    position ids: the indices themselves, a row without padding). Position ids that do not
    count the row's tokens are refused: a start after the first seen key, or, where the row's
    start is in view and its last query is its own token, another start than that one (column
    numbering of a left-padded batch, which would later give a decode step the padding's
    first column)."""
    hidden = seen_from <= (tk - tq) - window + 1  # no query of this call sees an earlier key
    if position_ids is None:
        if not bool(hidden.any()):
            return seen_from
        counted = torch.zeros_like(seen_from)
    else:
        last = position_ids[:, -1].to(seen_from.device).expand(seen_from.shape[0])
        counted = (tk - 1) - last
    in_view = ~hidden & (kv_end == tk)  # else the row's last query is trailing padding
    if bool(((counted > seen_from) | (counted < 0))[hidden].any()) or bool(
        (counted != seen_from)[in_view].any()
    ):
        raise RuntimeError(
            "bik attention: under a sliding window, position_ids must number each row's "
            "tokens from 0 at its first token (as generate and bik.sequence_logprobs do), so "
            "that a decode step finds where its row begins; got position ids that do not"
        )
    return torch.where(hidden, counted, seen_from)


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
        "cache",
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
    "sliding_window": (
        "an active sliding window in a module patch_model did not give whole cache layers "
        "(a sliding-window cache drops keys, which moves bik's key blocks)",
        "patch the model with bik.patch_model, keep each sequence within the window, or "
        + _UNPATCH_ADVICE,
    ),
    "is_causal": ("non-causal attention", _UNPATCH_ADVICE),
    "output_attentions": (
        "returning attention weights (bik never materialises them)",
        "run the model without output_attentions=True",
    ),
    "position_bias": ("an additive position bias", _UNPATCH_ADVICE),
    "value_head_dim": ("value heads wider than the query and key heads", _UNPATCH_ADVICE),
    "packed_recurrent": (
        "packed sequences in a model with recurrent layers (linear attention, Mamba), whose "
        "state would run from one sequence into the next",
        "give each sequence a row of its own (left padding)",
    ),
    "packed_context_parallel": (
        "packed sequences under bik.distributed.context_parallel",
        "give each rank its chunk of one sequence a row",
    ),
}
# flash-attention's varlen keywords of a packed forward: read by bik.hf.packed.segments
_PACKING = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


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
        if keyword in _BOOKKEEPING or keyword in _PACKING or keyword == "sliding_window":
            continue  # sliding_window is checked against the mask, in _kv_bounds
        if value is None:
            continue
        if keyword in ("softcap", "s_aux"):
            continue  # computed: bik.attention's softcap and sinks (gpt-oss's s_aux)
        if keyword == "is_causal" and value is True:
            continue
        if value is False and keyword != "is_causal":
            continue  # a feature switched off
        raise _unsupported(module, keyword, value)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (cache included)
    -> ([B, Tq, Hq, D], None)."""
    _check_keywords(module, dropout, kwargs)
    window = kwargs.get("sliding_window")
    settings = getattr(module, "_bik_attention", None) or _DEFAULT_SETTINGS
    step = static_step_of(key)
    value_dim = value.shape[-1]
    found = None  # packed sequences (bik.hf.packed), read below off a full forward
    if value_dim > query.shape[-1]:
        raise _unsupported(module, "value_head_dim", value_dim)
    if step is not None:  # a StaticDecoder's step: lengths on the device, every key kept
        fn: Any = functools.partial(decode_attention, step=step, window=window)
    elif static_step_running():
        raise NotImplementedError(
            f"bik static decode: {type(module).__name__} attends over keys that are not the "
            "static cache's pages (a model that transforms its cached keys before attention), "
            "which paged attention cannot read; decode this model with model.generate"
        )
    else:
        batch, _, tq, _ = query.shape
        found = packed.segments(attention_mask, kwargs, batch, tq, key.shape[2])
        if found is not None and context.active_group() is not None:
            raise _unsupported(module, "packed_context_parallel", True)
        if found is not None and not getattr(settings, "packing", True):
            raise _unsupported(module, "packed_recurrent", True)
        if context.active_group() is not None:
            key, value, attention_mask = _context_parallel_keys(
                query, key, value, attention_mask, kwargs
            )
        if value_dim < query.shape[-1]:
            # Multi-head latent attention (DeepSeek-V3): value heads narrower than query/key
            # heads. Zero columns widen them: each output column is its own fixed-order sum
            # over the keys, so the real columns keep their order and the added ones are 0.
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - value_dim))
        if found is not None:  # a row per sequence, each from its first token (bik.hf.packed)
            query, key, value = (packed.stack(t, found) for t in (query, key, value))
            kv_start = torch.zeros(len(found), dtype=torch.int32)
            window_active = window is not None and query.shape[2] > window
        else:
            kv_start, kv_len, window_active = _cached_kv_bounds(
                attention_mask, batch, tq, key.shape[2], window, kwargs.get("position_ids")
            )
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
        if window_active and not isinstance(vars(module).get("forward"), WholeCacheAttention):
            raise _unsupported(module, "sliding_window", window)
        fn = functools.partial(
            attention,
            causal=True,
            kv_start=kv_start.to(query.device),
            window=window if window_active else None,  # one that hides nothing: same bits
        )
    # cast like F.scaled_dot_product_attention under autocast
    autocast_on, (query, key, value) = autocast_inputs(query.device.type, query, key, value)
    out = run(
        settings.backend,
        autocast_on,
        fn,
        query,
        key,
        value,
        scale=scaling,
        split_size=settings.split_size,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    if found is not None:
        out = packed.unstack(out, found, batch, tq)
    return out[..., :value_dim].transpose(1, 2), None


def _context_parallel_keys(query, key, value, mask, kwargs):
    """Under bik.distributed.context_parallel: the keys and values of this rank and the ranks
    before it, and no mask (causal, the queries last), once the call is checked to be a whole
    unpadded chunk without a cache or a window."""
    batch, _, tq, _ = query.shape
    kv_start, kv_len, _ = _kv_bounds(mask, batch, tq, key.shape[2], None, None)
    if key.shape[2] != tq or kv_len != tq or bool(kv_start.any()) or kwargs.get("sliding_window"):
        raise ValueError(
            "bik context parallelism: each rank's call must be its whole chunk of unpadded "
            "rows, without a cache or a sliding window"
        )
    key, value = context.gather_keys(key, value, kwargs.get("position_ids"))
    return key, value, None


class WholeCacheAttention:
    """The forward of an attention module with a sliding window: before the module's first
    cache update, a sliding-window cache layer (which would keep only the last window of keys)
    is swapped for a whole one, so a decode step sees every key, as the trainer's forward
    does, and bik's key blocks stay counted from each row's first key; the window is then a
    mask (bik.attention's ``window``). A sliding layer already filled (it may have dropped
    keys) is refused. Then the module's own forward runs."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module: Any = self.module
        cache = pop_cache(dict(kwargs))
        if cache is not None:
            keep_every_key(cache, module.layer_idx)
        return type(module).forward(module, *args, **kwargs)


def keep_every_key(cache: Any, layer_idx: int) -> None:
    """Swap ``cache``'s layer ``layer_idx`` for a whole one if it is an empty sliding-window
    layer; NotImplementedError if it is a sliding layer already in use, or of another kind."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return  # a cache that grows its layers on update makes whole ones (DynamicLayer)
    layer = layers[layer_idx]
    if not getattr(layer, "is_sliding", False):
        return
    if type(layer) is DynamicSlidingWindowLayer and not layer.is_initialized:
        layers[layer_idx] = DynamicLayer()
        return
    raise NotImplementedError(
        f"bik attention: layer {layer_idx}'s cache is a sliding-window layer "
        f"({type(layer).__name__}{', already filled' if layer.is_initialized else ''}) that "
        "keeps only the last window of keys, which moves bik's key blocks; pass a new "
        "DynamicCache (bik makes its sliding layers whole) or no cache"
    )
