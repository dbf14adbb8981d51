"""Split-KV attention with a fixed split size; prefill, chunks and decode share it.

Two kernels:
  1. ``_split_partials_kernel``: one program per (query block, batch*head, split). It runs an
     online softmax over the split's key blocks in ascending order, blocks counted from the
     row's first valid key, and writes the unnormalised partial (acc, max, sum) per query.
  2. ``_combine_kernel``: merges each query's split partials in ascending split order and
     normalises. A query reads exactly the splits that hold its visible keys.
Blocks a query cannot see (future keys of its query block) only multiply by exp(0) = 1 and
add exact zeros, so a query's bits do not depend on its neighbours in the block.

Sliding window: the blocks stay counted from the row's first valid key; a program skips the
key blocks wholly before the window of its tile's first query, and the combine skips a
query's splits wholly before its window. A block before the window of a later query of the
tile is processed for that query while its state is still empty (max -inf, sum 0, acc 0):
rescale exp(-inf) = 0 and probabilities 0 leave the empty state exactly as it was, so the
bits equal those of skipping it. Soft-capping (``_tanh``) is applied to the scores before
the mask.
"""

import torch
import triton
import triton.language as tl

from ...contract import KEY_BLOCK
from ._common import dot_acc, upcast_dot_operands

QUERY_BLOCK = 16
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp and a polynomial (Cephes' tanhf, a few ulps; Triton has no tanh
    that runs both on the GPU and in the interpreter):
      |x| >= 0.625: sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|) in [0, 0.29], which never
        overflows and gives exactly +-1 once e underflows;
      |x| <  0.625: x + x^3 * P(x^2), Cephes' minimax polynomial (no cancellation near 0).
    NaN stays NaN. The polynomial only sees arguments below 0.625 (no overflow in the branch
    that tl.where discards)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0.0, -big, big)
    xs = tl.where(a < 0.625, x, 0.0)
    z = xs * xs
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = p * z * xs + xs
    return tl.where(a < 0.625, small, big)


@triton.jit
def _split_partials_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_start_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    Hq,
    GROUPS,
    Tq,
    Tk,
    D,
    n_splits,
    split_size,
    scale,
    softcap,
    window,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    q_block, bh, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    b, h = bh // Hq, bh % Hq
    kv_h = h // GROUPS
    first_key = tl.load(kv_start_ptr + b)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = Tk - Tq + rows  # absolute key position of each query
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr
        + b * stride_qb
        + h * stride_qh
        + rows[:, None] * stride_qt
        + dims[None, :] * stride_qd,
        mask=(rows[:, None] < Tq) & (dims[None, :] < D),
        other=0.0,
    )
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh

    lo = first_key + split * split_size
    hi = tl.minimum(lo + split_size, Tk)
    if CAUSAL:  # no query of this block sees past its last position
        hi = tl.minimum(hi, Tk - Tq + tl.minimum((q_block + 1) * BLOCK_M, Tq))
    if WINDOW:  # nor before the window of its first query: skip whole blocks up to there
        tile_first = Tk - Tq + q_block * BLOCK_M - window + 1  # >= -2**31 + 2: no overflow
        skipped = (tl.maximum(tile_first, first_key) - first_key) // BLOCK_N * BLOCK_N
        lo = tl.maximum(lo, first_key + skipped)
    run_max = tl.full((BLOCK_M,), NEG_INF, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Ascending key blocks of this split: the online-softmax reduction order.
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (keys[:, None] < Tk) & (dims[None, :] < D)
        k = tl.load(
            k_base + keys[:, None] * stride_kt + dims[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        scores = (
            dot_acc(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), UPCAST) * scale
        )
        if SOFTCAP:  # transformers' order: divide, tanh, multiply
            scores = _tanh(scores / softcap) * softcap
        visible = keys[None, :] < Tk
        if CAUSAL:
            visible = visible & (keys[None, :] <= positions[:, None])
        if WINDOW:
            visible = visible & (keys[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, NEG_INF)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)  # queries with nothing seen yet
        rescale = tl.exp(run_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        run_sum = run_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            v_base + keys[:, None] * stride_vt + dims[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        acc = dot_acc(probs.to(v.dtype), v, acc * rescale[:, None], UPCAST)
        run_max = new_max

    part = (bh * n_splits + split) * Tq + rows
    ok = rows < Tq
    tl.store(
        acc_ptr + part[:, None] * D + dims[None, :], acc, mask=ok[:, None] & (dims[None, :] < D)
    )
    tl.store(max_ptr + part, run_max, mask=ok)
    tl.store(sum_ptr + part, run_sum, mask=ok)


@triton.jit
def _combine_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    kv_start_ptr,
    out_ptr,
    Hq,
    Tq,
    Tk,
    D,
    n_splits,
    split_size,
    window,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    q_block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // Hq, bh % Hq
    first_key = tl.load(kv_start_ptr + b)
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    if CAUSAL:
        last_key = Tk - Tq + rows
    else:
        last_key = tl.full((BLOCK_M,), Tk - 1, dtype=tl.int32)
    # Splits holding this query's visible keys (0 for a query before its row's first key).
    n_own = tl.where(
        (last_key >= first_key) & (rows < Tq), (last_key - first_key) // split_size + 1, 0
    )
    if WINDOW:  # the first split holding a key of the query's window
        first_own = (tl.maximum(last_key - window + 1, first_key) - first_key) // split_size
    else:
        first_own = tl.zeros((BLOCK_M,), dtype=tl.int32)
    run_max = tl.full((BLOCK_M,), NEG_INF, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Merge the split partials in ascending split order.
    for split in range(tl.min(first_own, axis=0), tl.max(n_own, axis=0)):
        take = (split >= first_own) & (split < n_own)
        part = (bh * n_splits + split) * Tq + rows
        part_max = tl.load(max_ptr + part, mask=take, other=NEG_INF)
        part_sum = tl.load(sum_ptr + part, mask=take, other=0.0)
        part_acc = tl.load(
            acc_ptr + part[:, None] * D + dims[None, :],
            mask=take[:, None] & (dims[None, :] < D),
            other=0.0,
        )
        new_max = tl.maximum(run_max, part_max)
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)
        old_scale, part_scale = tl.exp(run_max - safe_max), tl.exp(part_max - safe_max)
        run_sum = run_sum * old_scale + part_sum * part_scale
        acc = acc * old_scale[:, None] + part_acc * part_scale[:, None]
        run_max = new_max
    # A query that sees no key (before its row's first key) returns zeros.
    empty = run_sum[:, None] == 0.0
    out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, run_sum[:, None]))
    tl.store(
        out_ptr
        + b * stride_ob
        + h * stride_oh
        + rows[:, None] * stride_ot
        + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < Tq) & (dims[None, :] < D),
    )


def attention(q, k, v, causal, scale, kv_start, split_size, softcap=None, window=None):
    """See bik.ops.attention: ``q [B, Hq, Tq, D]``, ``k, v [B, Hkv, Tk, D]``
    -> ``[B, Hq, Tq, D]``; ``softcap`` / ``window`` None: off."""
    batch, hq, tq, d = q.shape
    tk = k.shape[2]
    n_splits = triton.cdiv(tk, split_size)  # enough for a row whose first key is 0
    block_d = max(16, triton.next_power_of_2(d))
    f32 = dict(dtype=torch.float32, device=q.device)
    part_acc = torch.empty(batch * hq, n_splits, tq, d, **f32)
    part_max = torch.empty(batch * hq, n_splits, tq, **f32)
    part_sum = torch.empty(batch * hq, n_splits, tq, **f32)
    q_blocks = triton.cdiv(tq, QUERY_BLOCK)
    _split_partials_kernel[(q_blocks, batch * hq, n_splits)](
        q,
        k,
        v,
        kv_start,
        part_acc,
        part_max,
        part_sum,
        hq,
        hq // k.shape[1],
        tq,
        tk,
        d,
        n_splits,
        split_size,
        scale,
        1.0 if softcap is None else softcap,
        0 if window is None else window,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        CAUSAL=causal,
        SOFTCAP=softcap is not None,
        WINDOW=window is not None,
        UPCAST=upcast_dot_operands(q.dtype),
        BLOCK_M=QUERY_BLOCK,
        BLOCK_N=KEY_BLOCK,
        BLOCK_D=block_d,
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _combine_kernel[(q_blocks, batch * hq)](
        part_acc,
        part_max,
        part_sum,
        kv_start,
        out,
        hq,
        tq,
        tk,
        d,
        n_splits,
        split_size,
        0 if window is None else window,
        *out.stride(),
        CAUSAL=causal,
        WINDOW=window is not None,
        BLOCK_M=QUERY_BLOCK,
        BLOCK_D=block_d,
    )
    return out
