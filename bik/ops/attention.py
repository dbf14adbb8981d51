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
masking, inside the same order.
"""

import math

import torch

from .. import _checks, backends, contract
from ..backends import reference
from . import _recompute, custom_op, run


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
    """
    _validate_qkv(q, k, v)
    batch, _, _, dim = q.shape
    tk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(dim) if dim else 1.0  # D = 0: an empty result, scale unused
    else:
        scale = _checks.positive_number("scale", scale)
    causal = _checks.flag("causal", causal)
    kv_start = _validate_kv_start(kv_start, batch, tk, q.device)
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
    return run(
        _attention_op, _attention, q, k, v, causal, scale, kv_start, split_size, softcap, window
    )


_WIDEST_WINDOW = 2**31 - 1


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
) -> torch.Tensor:
    if q.numel() == 0:
        return q.new_empty(q.shape)
    backend = backends.resolve(q.device)
    return backend.attention(q, k, v, causal, scale, kv_start, split_size, softcap, window)


_attention_op = custom_op("bik::attention", _attention)


@_attention_op.register_fake
def _(q, k, v, causal, scale, kv_start, split_size, softcap, window):
    return q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale, kv_start, _, ctx.softcap, ctx.window = inputs
    ctx.save_for_backward(q, k, v, kv_start)


def _backward(ctx, grad):
    q, k, v, kv_start = ctx.saved_tensors

    def formula(q_, k_, v_):
        return reference.attention(
            q_, k_, v_, ctx.causal, ctx.scale, kv_start, None, ctx.softcap, ctx.window
        )

    grads = _recompute.grads(formula, (q, k, v), ctx.needs_input_grad[:3], grad)
    return (*grads, None, None, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)
