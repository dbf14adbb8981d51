"""FlashAttention-style attention with a fixed split size: one kernel design for prefill,
chunked prefill and decode.

Reduction order (bik.contract): each query row visits its keys in blocks of ``BLOCK_N =
KEY_BLOCK`` counted from the row's first valid key ``kv_start[b]``; blocks are grouped into
splits of ``split_size`` keys. A split's state (running max, sum of exponentials, unnormalised
fp32 output ``acc``) is computed from an empty state over the split's blocks in ascending
order (:func:`_split_state`); the split states are then folded in ascending split order by
the one merge function :func:`_merge`, and :func:`_finish` divides by the sum.

Tiles. A program owns a tile of ``BLOCK_M = 64`` query rows of one (batch, kv head). Row ``r``
of that pair is query position ``r // G`` of query head ``kv_head * G + r % G`` (G = Hq / Hkv),
so the query heads of a GQA group share a tile and read each key/value block once, and decode
(Tq = 1) packs its G heads into one tile instead of wasting a tile per head. Every bf16 / fp16
tile has 64 rows whatever Tq is, so prefill and decode run the same tensor-core instructions
(HGMMA on Hopper, checked by tests/backends/test_sm90_attention.py); fp32 (IEEE dots on the FMA
units, no tensor cores) uses 16-row tiles over 8 warps on both paths. Each row keeps its own
position ``p = Tk - Tq + r // G`` and its own causal and window masks. Heads wider than 128 are
cut into 128-wide chunks of value dims, one program each (every chunk computes the same
scores), so the fp32 accumulators fit in registers.

Two paths, the same bits (tests force each one):
  * in-register (prefill, long chunks): a program per (tile, batch x kv head) loops over the
    tile's splits in ascending order and merges each split state into registers at once; no
    workspace at all.
  * split-parallel (decode, short chunks: one tile per batch x kv head, see
    :func:`~.attention_launch._use_split_parallel`): a program per (tile, batch x kv head,
    split) writes its split state to an fp32 workspace ``[B * Hkv, splits, Tq * G, D]``
    (small because Tq is small), and ``_combine_kernel`` merges the splits in ascending
    order with the same :func:`_merge`.
Both compute a split state with the same code, tile shape and warps (so the same dot
instructions and reduction trees), store it in fp32 exactly, and merge it with the same
elementwise formula (no FMA contraction), so a row's bits do not depend on the path.

Loads: 16-bit keys and values whose strides TMA can take (not a paged cache) arrive by TMA
boxes of one head's BLOCK_N keys (:func:`~.attention_launch._kv_takes_tma`), the others by
masked pointer loads; both give the dots the same values (zeros past the keys and the head
dim), so the same bits, and TMA leaves more registers to the two fp32 accumulators.

Work a row does not need is exact identity, which is why a row's bits do not depend on the
other rows of its tile nor on the tile's bounds. A tile visits the union of its rows' key
blocks and splits; for a row that sees none of a block's keys, the scores are -inf, so its
state is unchanged (non-empty: rescale exp(0) = 1, probabilities 0, exact zeros added; empty:
max -inf, sum 0, acc 0 stays so). A split that holds none of a row's keys leaves the row's
split state empty, and merging an empty state changes nothing (and merging anything into an
empty state copies it exactly). A split never shares a key block with the next one (splits
are multiples of the block), and the masks mark keys past Tk or past the row's position.

Masks: a 16-bit tile's key block that every row of the tile sees whole (below the causal
diagonal of its first row, inside the window of its last, before Tk: :func:`_tile`'s
``[all_lo, all_hi)``) skips the mask, which would keep every score: the same bits, and on
sm_90a 65 of the block loop's 420-440 instructions fewer (Triton 3.6 and 3.9), for all but
about two blocks per tile of a causal prefill and all but the last of a decode (on a GPU,
once :func:`~.attention_launch.fast_choices_agree` has passed). fp32 always masks: with the
branch, Triton spills its FMA-dot prefill to local memory.

Sliding window: blocks stay counted from the row's first valid key; a tile skips the key blocks
and splits wholly before the window of its first query (the skipped work would be identity for
every row, as above). Soft-capping (``_tanh``) is applied to the scores before the mask.
Attention sinks join after the last split on both paths: one more state (max = the head's
sink logit, sum 1, acc 0) folded in by the same :func:`_merge` (:func:`_with_sink`).

Binaries: every launch is a :class:`~._common.Launch` (FP contraction off, warps and stages
fixed). Query and key lengths, split and row counts and the batch / head / position strides
are never specialised on: the strides travel in units of ``UNIT`` elements (16 bytes when
every stride allows it, a property of the layout and head dim, not of the lengths) so loads
stay vectorised while the binary is the same for every sequence length.

This module holds the kernels; which choices a call takes and the launches' arguments are
:mod:`bik.backends.triton.attention_launch`'s.
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from ...contract import KEY_BLOCK
from ._common import (
    dot_acc,
)

BLOCK_M = 64
"""Query rows per tile for bf16 / fp16: one Hopper warpgroup MMA (m64), prefill and decode
alike. fp32 runs IEEE fp32 dots on the FMA units (no tensor-core instruction to agree on):
its tiles have :data:`FP32_BLOCK_M` rows, whose operands fit in registers."""
FP32_BLOCK_M = 16
BLOCK_N = KEY_BLOCK
NUM_WARPS = 4  # one warpgroup
FP32_NUM_WARPS = 8
"""fp32's FMA dots hold their key and value blocks in registers: over 4 warps Triton 3.6
spills the split-parallel kernel to local memory (336 bytes a thread at head dim 128), over 8
neither 3.6 nor 3.9 spills (tests/backends/test_sm90_attention.py)."""
NUM_STAGES = 3
MAX_BLOCK_DV = 128
"""Value dims per program: a wider head (Gemma's 256) is cut into chunks of output dims, each
computing the same scores, so the two fp32 accumulators of the in-register path fit in
registers."""
COMBINE_BLOCK_DV = 32
"""Value dims per program of the split-parallel combine. Its merge is elementwise, so each
value dim's bits are the same however the dims are cut; narrow chunks give a decode step (a
few rows per kv head, up to hundreds of splits to fold in order) more programs to run on."""
COMBINE_STAGES = tl.constexpr(6)
"""Split states the combine loads ahead (cp.async into shared memory) while it folds the
current one: the fold is a chain over the splits, so unpipelined each split waited a global
load's full latency (36 us for 128 splits on an H200). The arithmetic and its order are the
same; only where the operands wait changes."""
NEG_INF = tl.constexpr(float("-inf"))

# Batch-like integers: the binary must not change with any of them.
_LENGTHS = ["Tq", "Tk", "n_splits"]
_STRIDES = [f"s{t}{d}" for t in "qkvo" for d in "bht"]


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
def _first_key(kv_start_ptr, b, Tk):
    """Row b's first key, clamped into its keys: a device-side raise would cost a sync per
    call, and a kv_start written where no version counter saw it (past bik's checks) must not
    make the kernel read out of bounds."""
    return tl.minimum(tl.maximum(tl.load(kv_start_ptr + b), 0), tl.maximum(Tk - 1, 0))


@triton.jit
def _tile(tile, first_key, GROUPS, Tq, Tk, split_size, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N):
    """A tile's rows and the key range its rows may see.

    Returns the rows' query position ``t`` (row r: position r // GROUPS of head r % GROUPS),
    which rows exist, the first key block to visit (block-aligned from ``first_key``), the
    half-open range of the tile's keys ``[.., key_hi)`` and splits ``[split_lo, split_hi)``,
    and the keys ``[all_lo, all_hi)`` that every existing row sees (a key block inside them
    needs no mask).
    """
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUPS
    ok = t < Tq
    first_t = tile * BLOCK_M // GROUPS
    last_t = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUPS, Tq - 1)
    key_lo, all_lo = first_key, first_key
    key_hi, all_hi = Tk, Tk
    if CAUSAL:  # no row sees past the tile's last position; each sees up to the first one
        key_hi = Tk - Tq + last_t + 1
        all_hi = tl.minimum(Tk, Tk - Tq + first_t + 1)
    if WINDOW:  # nor before the window of its first position (>= -2**31 + 2: no overflow)
        key_lo = tl.maximum(first_key, Tk - Tq + first_t - window + 1)
        all_lo = Tk - Tq + last_t - window + 1  # ... and each sees the last one's window
    block_lo = first_key + (key_lo - first_key) // BLOCK_N * BLOCK_N
    split_lo = (key_lo - first_key) // split_size
    split_hi = tl.cdiv(tl.maximum(key_hi - first_key, 0), split_size)
    return t, ok, block_lo, key_hi, split_lo, split_hi, all_lo, all_hi


@triton.jit
def _in_head(dims, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[1, len(dims)]``: which of the (padded) head dims ``dims`` exist; all of them, with
    no mask to evaluate, when D is a power of two."""
    if D == BLOCK_D:
        return tl.full((1, dims.shape[0]), 1, tl.int1)
    return dims[None, :] < D


# Records of the split state's runtime values (named Triton tuples). The compile-time choices
# stay parameters of their own: a tuple built in a kernel turns a constexpr field into a
# tensor (Triton 3.6 and 3.9), which a static branch cannot test.


class Operand(NamedTuple):
    """The keys or the values of a program's kv head: where their rows are and which of their
    dims the program reads (keys: the whole head, values: the program's chunk)."""

    base: Any  # the head's row 0 (a paged cache: of page 0)
    desc: Any  # the TMA descriptor of the whole tensor [B, Hkv, Tk, D] (TMA_KV)
    row_stride: Any
    col_stride: Any
    page_stride: Any  # (a paged cache)
    cols: Any  # the dims read, ``tl.arange``
    col_start: Any  # the first of them: the TMA box's column


class KeySource(NamedTuple):
    """A program's keys and values, its TMA coordinates (b, kv_head), and, for a paged cache,
    its block table's row (key n is row ``n % PAGE_SIZE`` of page ``pages_ptr[n //
    PAGE_SIZE]``); Tk keys."""

    k: Operand  # (not "keys" and "values": a Triton tuple's own attribute)
    v: Operand
    b: Any
    kv_head: Any
    pages_ptr: Any
    Tk: Any


class RowWindow(NamedTuple):
    """Which keys the tile's rows see (:func:`_tile`): each row's own position ``pos``, keys
    from ``first_key`` (with a window: from the block ``block_lo`` of the first row's
    window, ``window`` keys a row) up to ``key_hi``, all of ``[all_lo, all_hi)`` seen by
    every row."""

    pos: Any
    first_key: Any
    block_lo: Any
    key_hi: Any
    all_lo: Any
    all_hi: Any
    window: Any


@triton.jit
def rescale_acc(acc, rescale, row_max, new_max):
    """The accumulator after a key block moved the rows' maxima: every row by its rescale (a
    row whose maximum held is multiplied by exp(0) = 1)."""
    return acc * rescale[:, None]


@triton.jit
def _split_rows(operand, lo, offs):
    """The pointer loads' split base (64-bit) and a block's offsets from it (32-bit: fewer
    registers than a block of pointers)."""
    rows = operand.base + lo.to(tl.int64) * operand.row_stride
    return rows, offs[:, None] * operand.row_stride + operand.cols[None, :] * operand.col_stride


@triton.jit
def _key_block(
    operand,
    source,
    split_rows,
    n0,
    lo,
    page,
    slot,
    mask,
    PAGE_SIZE: tl.constexpr,
    TMA_KV: tl.constexpr,
):
    """Keys (or values: ``operand``) ``n0 + arange(BLOCK_N)``, dims ``operand.cols``, however
    they arrive: from a paged cache (each key's ``page`` and ``slot``), by TMA boxes of one head's
    BLOCK_N keys, or by pointer loads from ``split_rows`` (:func:`_split_rows` of the split
    starting at key ``lo``). Each way gives the dots the same tile (zeros where ``mask`` is
    off: past Tk and past the head dim), so the same bits."""
    if PAGE_SIZE > 0:
        rows = (page * operand.page_stride + slot * operand.row_stride)[:, None]
        cols = operand.cols[None, :]
        block = tl.load(operand.base + rows + cols * operand.col_stride, mask=mask, other=0.0)
    elif TMA_KV:
        box = operand.desc.load([source.b, source.kv_head, n0, operand.col_start])
        block = box.reshape(mask.shape[0], operand.cols.shape[0])
    else:
        base, offsets = split_rows
        block = tl.load(base + (n0 - lo) * operand.row_stride + offsets, mask=mask, other=0.0)
    return block


@triton.jit
def _split_state(
    q,
    source,
    rows,
    split,
    split_size,
    scale,
    softcap,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA_KV: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    RESCALE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Online softmax of the tile's rows (``rows``: :class:`RowWindow`) over split ``split``,
    from an empty state, their key blocks from ``source`` (:class:`KeySource`).

    The split's key blocks run in ascending order; inside a block the row maximum is exact
    and the row sum of probabilities is one fixed tree (the dot layout, the same in every
    kernel that calls this). Returns the unnormalised state (max, sum, acc) per row, acc for
    the values' dims only (every chunk of value dims computes the same scores).
    ``RESCALE_ACC``: :func:`rescale_acc` (or a candidate of bik.testing the GPU probe times).
    """
    lo = rows.first_key + split * split_size
    hi = tl.minimum(lo + split_size, rows.key_hi)
    if WINDOW:
        lo = tl.maximum(lo, rows.block_lo)
    offs = tl.arange(0, BLOCK_N)
    k_rows = _split_rows(source.k, lo, offs)
    v_rows = _split_rows(source.v, lo, offs)
    row_max = tl.full((BLOCK_M,), NEG_INF, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + offs
        k_mask = (keys[:, None] < source.Tk) & _in_head(source.k.cols, D, BLOCK_D)
        page, slot = keys, keys  # a paged cache: key n is row n % PAGE_SIZE of its page
        if PAGE_SIZE > 0:
            page = tl.load(source.pages_ptr + keys // PAGE_SIZE, mask=keys < source.Tk, other=0)
            page, slot = page.to(tl.int64), keys % PAGE_SIZE
        k = _key_block(source.k, source, k_rows, n0, lo, page, slot, k_mask, PAGE_SIZE, TMA_KV)
        scores = dot_acc(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), UPCAST)
        scores = scores * scale
        if SOFTCAP:  # transformers' order: divide, tanh, multiply
            scores = _tanh(scores / softcap) * softcap
        partial = True
        if WHOLE_BLOCKS:  # a block every row sees whole skips the mask (exact: it keeps all)
            partial = (n0 < rows.all_lo) | (n0 + BLOCK_N > rows.all_hi)
        if partial:
            visible = keys[None, :] < source.Tk
            if CAUSAL:
                visible = visible & (keys[None, :] <= rows.pos[:, None])
            if WINDOW:
                visible = visible & (keys[None, :] > rows.pos[:, None] - rows.window)
            scores = tl.where(visible, scores, NEG_INF)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)  # rows with nothing seen yet
        rescale = tl.exp(row_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v_mask = (keys[:, None] < source.Tk) & _in_head(source.v.cols, D, BLOCK_D)
        v = _key_block(source.v, source, v_rows, n0, lo, page, slot, v_mask, PAGE_SIZE, TMA_KV)
        acc = RESCALE_ACC(acc, rescale, row_max, new_max)
        acc = dot_acc(probs.to(v.dtype), v, acc, UPCAST)
        row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def _merge(row_max, row_sum, acc, part_max, part_sum, part_acc):
    """The running state with one more split's state folded in. Elementwise (and FP
    contraction is off), so its bits do not depend on the register layout of the kernel that
    calls it."""
    new_max = tl.maximum(row_max, part_max)
    safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)
    old_scale = tl.exp(row_max - safe_max)
    part_scale = tl.exp(part_max - safe_max)
    row_sum = row_sum * old_scale + part_sum * part_scale
    acc = acc * old_scale[:, None] + part_acc * part_scale[:, None]
    return new_max, row_sum, acc


@triton.jit
def _with_sink(row_max, row_sum, acc, sinks_ptr, heads, ok):
    """The attention sink joins after the last split: one more state (max = the head's sink
    logit, sum 1, acc 0) folded in by the same :func:`_merge`."""
    sink = tl.load(sinks_ptr + heads, mask=ok, other=NEG_INF)
    return _merge(row_max, row_sum, acc, sink, tl.where(ok, 1.0, 0.0), tl.zeros_like(acc))


@triton.jit
def _finish(row_sum, acc):
    """The normalised output; a row that sees no key (before its first key) gives zeros."""
    empty = row_sum[:, None] == 0.0
    return tl.where(empty, 0.0, acc / tl.where(empty, 1.0, row_sum[:, None]))


@triton.jit
def _program(pid, Hkv, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Grid axis 1 -> (batch, kv head, chunk of value dims)."""
    chunks: tl.constexpr = BLOCK_D // BLOCK_DV
    bh = (pid // chunks).to(tl.int64)
    return bh // Hkv, bh % Hkv, bh, pid % chunks


@triton.jit
def _out_ptrs(out_ptr, b, heads, t, cols, sob, soh, sot, sod, UNIT: tl.constexpr):
    """Where rows (head, position) and value dims ``cols`` of batch ``b`` go in the output."""
    return (
        out_ptr
        + b * (sob * UNIT)
        + heads[:, None] * (soh * UNIT)
        + t[:, None].to(tl.int64) * (sot * UNIT)
        + (cols[None, :] * sod)
    )


@triton.jit(do_not_specialize=_LENGTHS + _STRIDES + ["stable"])
def _attention_kernel(
    # -- tensors: queries, keys and values (pointers, or TMA descriptors with TMA_KV), each
    # row's first key, the output, the sinks, the split-parallel workspace, the paged cache
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    kv_start_ptr,
    out_ptr,
    sinks_ptr,
    ws_acc_ptr,
    ws_max_ptr,
    ws_sum_ptr,
    block_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    # -- sizes (never specialised on: the binary is the same for every length)
    Hkv,
    GROUPS,
    Tq,
    Tk,
    n_splits,
    split_size,
    # -- scores: scale, soft-cap, sliding window
    scale,
    softcap,
    window,
    # -- strides: the block table's, then q, k, v, out by (batch, head, position, dim), the
    # first three in units of UNIT elements
    stable,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    svb,
    svh,
    svt,
    svd,
    sob,
    soh,
    sot,
    sod,
    # -- compiled in: what the scores are (head dim, masks, soft-cap, dot operands, sinks)
    # and how they are computed (the same bits every way: attention_launch.AttentionChoices)
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_PARALLEL: tl.constexpr,
    SINKS: tl.constexpr,
    UNIT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA_KV: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    RESCALE_ACC: tl.constexpr,
    VARLEN: tl.constexpr,
    # -- tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Last tiles first: under a causal mask they have the most keys (better load balance).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b, kv_head, bh, chunk = _program(tl.program_id(1), Hkv, BLOCK_D, BLOCK_DV)
    pages_ptr = block_table_ptr
    if PAGE_SIZE > 0:  # b is a sequence of a paged step: its own key count and pages
        Tk = tl.load(seq_lens_ptr + b)
        pages_ptr = block_table_ptr + b * stable
    first_key = _first_key(kv_start_ptr, b, Tk)
    if VARLEN:  # ... and its own rows of the packed queries
        first_row = tl.load(query_start_ptr + b)
        Tq = tl.load(query_start_ptr + b + 1) - first_row
        q_ptr += first_row.to(tl.int64) * (sqt * UNIT)
        out_ptr += first_row.to(tl.int64) * (sot * UNIT)
    t, ok, block_lo, key_hi, split_lo, split_hi, all_lo, all_hi = _tile(
        tile, first_key, GROUPS, Tq, Tk, split_size, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N
    )
    if VARLEN:  # the grid has tiles for the longest query: a tile past this sequence's rows
        # visits no split (all its rows are masked; nothing is stored)
        split_hi = tl.where(tile * BLOCK_M < Tq * GROUPS, split_hi, split_lo)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = kv_head * GROUPS + rows % GROUPS
    pos = Tk - Tq + t  # each row's own key position
    dims = tl.arange(0, BLOCK_D)
    vdims = chunk * BLOCK_DV + tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr
        + b * (sqb * UNIT)
        + heads[:, None] * (sqh * UNIT)
        + t[:, None].to(tl.int64) * (sqt * UNIT)
        + dims[None, :] * sqd,
        mask=ok[:, None] & _in_head(dims, D, BLOCK_D),
        other=0.0,
    )
    k_base = k_ptr + b * (skb * UNIT) + kv_head * (skh * UNIT)
    v_base = v_ptr + b * (svb * UNIT) + kv_head * (svh * UNIT)
    if PAGE_SIZE > 0:  # skb / svb: the caches' page strides (no batch dim)
        k_base = k_ptr + kv_head * (skh * UNIT)
        v_base = v_ptr + kv_head * (svh * UNIT)
    out_mask = ok[:, None] & _in_head(vdims, D, BLOCK_D)
    # One loop over the splits, ascending: the in-register path runs the tile's splits and
    # merges each as soon as it is complete; the split-parallel path runs the program's one
    # split (a split outside the tile's range is computed, never stored) and stores its state
    # for the combine kernel. Only where the state goes differs.
    split_first, split_last = split_lo, split_hi
    if SPLIT_PARALLEL:
        split_first = tl.program_id(2)
        split_last = split_first + 1
    b32, kv_head32 = b.to(tl.int32), kv_head.to(tl.int32)
    k_row_stride, v_row_stride = skt * UNIT, svt * UNIT
    k_page_stride, v_page_stride = skb * UNIT, svb * UNIT  # (skb / svb: see k_base)
    keys = Operand(k_base, k_desc, k_row_stride, skd, k_page_stride, dims, 0)
    values = Operand(v_base, v_desc, v_row_stride, svd, v_page_stride, vdims, chunk * BLOCK_DV)
    source = KeySource(keys, values, b32, kv_head32, pages_ptr, Tk)
    window_rows = RowWindow(pos, first_key, block_lo, key_hi, all_lo, all_hi, window)
    row_max = tl.full((BLOCK_M,), NEG_INF, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for split in range(split_first, split_last):
        part_max, part_sum, part_acc = _split_state(
            q,
            source,
            window_rows,
            split,
            split_size,
            scale,
            softcap,
            D,
            CAUSAL,
            SOFTCAP,
            WINDOW,
            UPCAST,
            PAGE_SIZE,
            TMA_KV,
            WHOLE_BLOCKS,
            RESCALE_ACC,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            BLOCK_DV,
        )
        if SPLIT_PARALLEL:  # the split's own state, unmerged (the combine kernel merges)
            row_max, row_sum, acc = part_max, part_sum, part_acc
        else:
            row_max, row_sum, acc = _merge(row_max, row_sum, acc, part_max, part_sum, part_acc)
    if SPLIT_PARALLEL:
        # (masks from comparisons only: the interpreter mishandles tensor & scalar bool)
        in_range = (split_first >= split_lo) & (split_first < split_hi)
        keep = t < tl.where(in_range, Tq, 0)
        keep_stats = t < tl.where(in_range & (chunk == 0), Tq, 0)  # one chunk writes them
        part = (bh * n_splits + split_first) * (Tq * GROUPS) + rows
        tl.store(ws_max_ptr + part, row_max, mask=keep_stats)
        tl.store(ws_sum_ptr + part, row_sum, mask=keep_stats)
        tl.store(
            ws_acc_ptr + part[:, None] * D + vdims[None, :],
            acc,
            mask=keep[:, None] & _in_head(vdims, D, BLOCK_D),
        )
    else:
        if SINKS:
            row_max, row_sum, acc = _with_sink(row_max, row_sum, acc, sinks_ptr, heads, ok)
        out = _finish(row_sum, acc).to(out_ptr.dtype.element_ty)
        tl.store(
            _out_ptrs(out_ptr, b, heads, t, vdims, sob, soh, sot, sod, UNIT), out, mask=out_mask
        )


@triton.jit(do_not_specialize=_LENGTHS + ["sob", "soh", "sot"])
def _combine_kernel(
    ws_acc_ptr,
    ws_max_ptr,
    ws_sum_ptr,
    kv_start_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    Hkv,
    GROUPS,
    Tq,
    Tk,
    n_splits,
    split_size,
    window,
    sob,
    soh,
    sot,
    sod,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    UNIT: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    tile = tl.program_id(0)
    b, kv_head, bh, chunk = _program(tl.program_id(1), Hkv, BLOCK_D, BLOCK_DV)
    if PAGE_SIZE > 0:  # a sequence of a paged step: its own key count
        Tk = tl.load(seq_lens_ptr + b)
    first_key = _first_key(kv_start_ptr, b, Tk)
    t, ok, _, _, split_lo, split_hi, _, _ = _tile(
        tile, first_key, GROUPS, Tq, Tk, split_size, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N
    )
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = kv_head * GROUPS + rows % GROUPS
    vdims = chunk * BLOCK_DV + tl.arange(0, BLOCK_DV)
    out_mask = ok[:, None] & _in_head(vdims, D, BLOCK_D)
    row_max = tl.full((BLOCK_M,), NEG_INF, dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    # The tile's splits in ascending order: the in-register path's merge sequence.
    for split in tl.range(split_lo, split_hi, num_stages=COMBINE_STAGES):
        part = (bh * n_splits + split) * (Tq * GROUPS) + rows
        part_max = tl.load(ws_max_ptr + part, mask=ok, other=NEG_INF)
        part_sum = tl.load(ws_sum_ptr + part, mask=ok, other=0.0)
        part_acc = tl.load(ws_acc_ptr + part[:, None] * D + vdims[None, :], mask=out_mask)
        row_max, row_sum, acc = _merge(row_max, row_sum, acc, part_max, part_sum, part_acc)
    if SINKS:
        row_max, row_sum, acc = _with_sink(row_max, row_sum, acc, sinks_ptr, heads, ok)
    out = _finish(row_sum, acc).to(out_ptr.dtype.element_ty)
    tl.store(_out_ptrs(out_ptr, b, heads, t, vdims, sob, soh, sot, sod, UNIT), out, mask=out_mask)
