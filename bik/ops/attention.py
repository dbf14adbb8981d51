"""Scaled-dot-product attention with one algorithm for prefill, chunked prefill and decode.

The reduction order of every backend (docs/design.md, "Reduction orders"):
  * keys are visited in blocks of contract.KEY_BLOCK, counted from the row's first valid key
    ``kv_start[b]`` (so left padding never moves a block boundary);
  * blocks are grouped into splits of a FIXED number of keys ``split_size`` (never a fixed
    number of splits); inside a split an online softmax runs over its blocks in ascending order;
  * the split partials are merged in ascending split order.
A query therefore sees the same blocks, splits and merge sequence whether it is computed in
a full prefill, in a chunk, or alone during decode over a KV cache.

A sliding ``window`` only masks more keys: the blocks and splits stay counted from
``kv_start[b]``. Blocks and splits that lie wholly before a query's window are skipped; one
that is processed anyway (a Triton query tile shares its blocks) leaves the query's online
softmax state exactly as it was (max -inf, sum 0, acc 0), so skipping and processing agree
bit for bit. ``softcap`` maps each score through ``softcap * tanh(score / softcap)`` before
masking, inside the same order. Attention ``sinks`` join after the last split: one more state
(max = the head's sink logit, sum 1, no value) merged the way the splits are.
"""

import math

import torch

from .. import _checks, backends, contract
from ..backends import reference
from ..backends.base import AttentionOptions
from . import _recompute
from ._dispatch import custom_op, run


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    split_size: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Tq, D]`` over ``k, v [B, Hkv, Tk, D]``; returns ``[B, Hq, Tq, D]``.

    The Tq queries are the last Tq of the Tk positions (Tq == Tk: prefill, Tq == 1: decode).
    Hq must be a multiple of Hkv (GQA: query head h reads kv head h // (Hq // Hkv)).
    ``kv_start [B]``: each row's first valid key (left padding); keys before it are masked and
    a query before it attends nothing and returns zeros. ``scale`` defaults to 1/sqrt(D).

    ``softcap`` (a positive number; None: off): each score ``s = scale * q.k`` becomes
    ``softcap * tanh(s / softcap)`` before masking and the softmax (Gemma 2 logit
    soft-capping, as transformers computes it). ``window`` (a positive int; None: no window;
    needs ``causal=True``): the sliding window as transformers defines it, the query at key
    position p sees the keys j with ``p - window < j <= p`` (and ``j >= kv_start[b]``), so at
    least its own key.

    ``sinks [Hq]`` (None: off): attention sinks as gpt-oss defines them, a learned logit per
    query head that joins each row's softmax denominator and attends no value: the row's
    output is ``sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j))`` over its visible
    scores ``s_j`` (after ``scale`` and ``softcap``; the sink itself is neither scaled, capped
    nor masked). A query that sees no key still returns zeros. Differentiable in ``sinks``.
    """
    _validate_qkv(q, k, v)
    kv_start = _validate_kv_start(kv_start, q.shape[0], k.shape[2], q.device)
    o = validate_options(q, causal, scale, split_size, softcap, window, sinks)
    # the custom op's schema is flat (torch.library); _attention rebuilds the record
    args = (o.causal, o.scale, kv_start, o.split_size, o.softcap, o.window, sinks)
    return run(_attention_op, _attention, q, k, v, *args)


_WIDEST_WINDOW = 2**31 - 1


def validate_options(
    q: torch.Tensor,
    causal: bool,
    scale: float | None,
    split_size: int | None,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> AttentionOptions:
    """The options record of attention over queries ``q [..., Hq, ..., D]`` (heads at dim 1,
    as in the packed ``[T, Hq, D]`` of paged attention), each checked, ``scale`` defaulting
    to 1/sqrt(D); ``sinks`` is checked, not recorded (a tensor operand of the kernels)."""
    causal = _checks.flag("causal", causal)
    dim = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(dim) if dim else 1.0  # D = 0: an empty result, scale unused
    else:
        scale = _checks.positive_number("scale", scale)
    split_size = contract.check_split_size(split_size)
    if softcap is not None:
        softcap = _checks.positive_number("softcap", softcap)
    if window is not None:
        window = _checks.positive_int("window", window)
        if not causal:
            raise ValueError("window: a sliding window needs causal=True, got causal=False")
        # Wider windows hide no key of any sequence a kernel indexes (int32 positions); the
        # clamp is a constant, so kernels never see an argument that depends on Tk.
        window = min(window, _WIDEST_WINDOW)
    if sinks is not None:
        _validate_sinks(sinks, q)
    return AttentionOptions(causal, scale, split_size, softcap, window)


def _validate_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.floating(name, t)
        _checks.rank(name, t, 4)
    for name, t in (("k", k), ("v", v)):
        _checks.same_dtype(name, t, "q", q)
        _checks.same_device(name, t, "q", q)
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    _checks.dim_size("k", k, 0, q.shape[0], "B, the batch of q")
    _checks.dim_size("k", k, 3, q.shape[3], "D, the head dim of q")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"k: expected a head count Hkv > 0 dividing Hq={q.shape[1]} (GQA), got {k.shape[1]}"
        )
    if q.shape[2] > k.shape[2]:
        raise ValueError(
            f"q: expected at most Tk={k.shape[2]} queries (the last Tq key positions), "
            f"got Tq={q.shape[2]}"
        )


def _validate_sinks(sinks, q):
    _checks.floating("sinks", sinks)
    _checks.same_device("sinks", sinks, "q", q)
    if sinks.shape != (q.shape[1],):
        raise ValueError(
            f"sinks: expected shape ({q.shape[1]},) (one logit per query head), "
            f"got {tuple(sinks.shape)}"
        )


def _validate_kv_start(kv_start, batch, tk, device):
    if kv_start is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    _checks.tensor("kv_start", kv_start)
    if kv_start.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kv_start: expected dtype int32 or int64, got {kv_start.dtype}")
    if kv_start.shape != (batch,):
        raise ValueError(f"kv_start: expected shape ({batch},), got {tuple(kv_start.shape)}")
    if kv_start.device != device:
        raise ValueError(f"kv_start: expected device {device} (same as q), got {kv_start.device}")
    _checks.values_in_range("kv_start", kv_start, 0, max(tk - 1, 0), f"Tk={tk}")
    return kv_start.to(torch.int32)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    kv_start: torch.Tensor,
    split_size: int,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    if q.numel() == 0:
        return q.new_empty(q.shape)
    options = AttentionOptions(causal, scale, split_size, softcap, window)
    kernel = backends.resolve(q.device, "attention").attention_kernel(sinks)
    return kernel(q, k, v, kv_start, options, fp32_sinks(sinks))


def fp32_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sinks as every kernel reads them: fp32, contiguous."""
    return None if sinks is None else sinks.float().contiguous()


_attention_op = custom_op("bik::attention", _attention)


@_attention_op.register_fake
def _(q, k, v, causal, scale, kv_start, split_size, softcap, window, sinks):
    return q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, kv_start, split_size, softcap, window, sinks = inputs
    ctx.options = AttentionOptions(causal, scale, split_size, softcap, window)
    ctx.save_for_backward(q, k, v, kv_start, *([] if sinks is None else [sinks]))


def _backward(ctx, grad):
    q, k, v, kv_start, *sinks = ctx.saved_tensors

    def formula(q_, k_, v_, *sinks_):
        return reference.attention(q_, k_, v_, kv_start, ctx.options, *sinks_)

    needs = ctx.needs_input_grad[:3] + (ctx.needs_input_grad[9:] if sinks else ())
    q_grad, k_grad, v_grad, *sinks_grad = _recompute.grads(formula, (q, k, v, *sinks), needs, grad)
    sinks_grad = sinks_grad[0] if sinks_grad else None
    return (q_grad, k_grad, v_grad, None, None, None, None, None, None, sinks_grad)


_attention_op.register_autograd(_backward, setup_context=_setup_context)
