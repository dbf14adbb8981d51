"""log_softmax and token log-probs: per-segment statistics, then one ascending fold per row.

A row of V entries is cut into segments of :func:`segment_width` entries (a function of V
only), and the work runs in up to three launches:

1. ``_segment_stats_kernel``, one program per (row, segment): the segment's max by a fixed
   tree, then the sum of ``exp(x / T - max)`` by a fixed tree: one exp per element. Both
   ops run this same kernel on the row, so they share its statistics bit for bit.
2. The fold (:func:`_row_stats`): a row's segment statistics merged in ascending segment
   order by :func:`_merge`, giving (max, log of the sum). It is elementwise scalar work, so
   it gives the same bits wherever it runs: once per row in ``_row_stats_kernel`` (one row
   per lane) for long rows, inside each write program for rows of at most
   :data:`FUSED_MERGE_MAX` segments, and inside ``_token_logprobs_kernel``.
3. ``_log_softmax_kernel``, one program per (row, segment), writes ``_log_prob`` of every
   entry; ``_token_logprobs_kernel`` (one row per lane) writes it at the token. One
   expression, so ``token_logprobs`` equals the gathered fp32 ``log_softmax`` bit for bit.

Segments (not whole rows) are the unit of parallel work, so a few long rows (a vocabulary of
151936 is 38 segments) still fill a GPU. The trees follow the register layout, which the
segment width, ``num_warps`` (from the width) and the vector width (from V) fix; V is a
constexpr and the row stride arrives in vector units, not specialised (see ``_rows``): nothing
depends on the number of rows.
"""

import torch
import triton
import triton.language as tl

from ...contract import LOG_SOFTMAX_SEGMENT, row_chunk
from ._common import I32, Launch, aligned, alignments, cdiv
from ._rows import kernel_rows, stride_in_vectors, vector_width

NEG_INF = tl.constexpr(float("-inf"))

ROWS = 128
"""Rows per program of the per-row kernels (one row per lane, 4 warps)."""

FUSED_MERGE_MAX = 4
"""Up to this many segments per row, each write program folds its row's statistics itself
(one launch fewer); beyond, one fold per row runs first. Either way the same fold, same bits."""


@triton.jit
def _scaled(x, temperature, SCALED: tl.constexpr):
    """``x / temperature`` in fp32 (skipped at temperature 1, where it is exact anyway)."""
    x = x.to(tl.float32)
    if SCALED:
        x = x / temperature
    return x


@triton.jit
def _merge(max_a, sum_a, max_b, sum_b):
    """(max, sum of exp(x - max)) of two parts from each part's pair: the one merge function.
    An all -inf part (max -inf, sum 0) adds nothing; NaN propagates."""
    new_max = tl.maximum(max_a, max_b, propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(new_max == NEG_INF, 0.0, new_max)  # both parts saw only -inf
    return new_max, sum_a * tl.exp(max_a - safe) + sum_b * tl.exp(max_b - safe)


@triton.jit
def _row_stats(max_row, sum_row, ok, SEGMENTS: tl.constexpr):
    """(max, log(sum(exp(x/T - max)))) of a row from its segment statistics, folded with
    :func:`_merge` in ascending segment order. Pointers may be scalars (one row) or vectors
    (one row per lane, masked by ``ok``): the ops are elementwise, so the bits are the same."""
    row_max = tl.load(max_row, mask=ok, other=0.0)
    row_sum = tl.load(sum_row, mask=ok, other=1.0)
    # Unrolled by 8 so that the loads of 8 segments are in flight at once.
    for s in tl.range(1, SEGMENTS, loop_unroll_factor=8):
        seg_max = tl.load(max_row + s, mask=ok, other=0.0)
        seg_sum = tl.load(sum_row + s, mask=ok, other=1.0)
        row_max, row_sum = _merge(row_max, row_sum, seg_max, seg_sum)
    return row_max, tl.log(row_sum)


@triton.jit
def _log_prob(x, temperature, row_max, log_total, SCALED: tl.constexpr):
    """The one log-prob expression both ops share, so their bits agree."""
    return (_scaled(x, temperature, SCALED) - row_max) - log_total


@triton.jit(do_not_specialize=["stride_x"])
def _segment_stats_kernel(
    x_ptr,
    max_ptr,
    sum_ptr,
    stride_x,
    temperature,
    V: tl.constexpr,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    VEC: tl.constexpr,
    SCALED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    cols = segment * SEGMENT + tl.arange(0, SEGMENT)
    # The row stride arrives in units of VEC elements (provably aligned, never specialised).
    x = tl.load(x_ptr + row * stride_x * VEC + cols, mask=cols < V, other=NEG_INF)
    x = _scaled(x, temperature, SCALED)
    # Two fixed trees over the segment (each thread's elements in register order, then lanes,
    # then warps): the max, then the sum of exponentials relative to it (one exp per element).
    seg_max = tl.max(x, axis=0)
    safe = tl.where(seg_max == NEG_INF, 0.0, seg_max)  # an all -inf segment sums to 0
    seg_sum = tl.sum(tl.exp(x - safe), axis=0)
    tl.store(max_ptr + row * SEGMENTS + segment, seg_max)
    tl.store(sum_ptr + row * SEGMENTS + segment, seg_sum)


@triton.jit(do_not_specialize=["R"])
def _row_stats_kernel(
    max_ptr, sum_ptr, row_max_ptr, log_total_ptr, R, SEGMENTS: tl.constexpr, ROWS: tl.constexpr
):
    # One row per lane: a row's fold is the same elementwise sequence in any lane or program.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    row_max, log_total = _row_stats(
        max_ptr + rows * SEGMENTS, sum_ptr + rows * SEGMENTS, ok, SEGMENTS
    )
    tl.store(row_max_ptr + rows, row_max, mask=ok)
    tl.store(log_total_ptr + rows, log_total, mask=ok)


@triton.jit(do_not_specialize=["stride_x"])
def _log_softmax_kernel(
    x_ptr,
    max_ptr,
    sum_ptr,
    row_max_ptr,
    log_total_ptr,
    y_ptr,
    stride_x,
    temperature,
    V: tl.constexpr,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    VEC: tl.constexpr,
    SCALED: tl.constexpr,
    MERGE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    if MERGE:  # few segments: every program folds its row's statistics itself
        row_max, log_total = _row_stats(
            max_ptr + row * SEGMENTS, sum_ptr + row * SEGMENTS, True, SEGMENTS
        )
    else:  # many: _row_stats_kernel folded them once per row
        row_max, log_total = tl.load(row_max_ptr + row), tl.load(log_total_ptr + row)
    cols = segment * SEGMENT + tl.arange(0, SEGMENT)
    ok = cols < V
    x = tl.load(x_ptr + row * stride_x * VEC + cols, mask=ok, other=0.0)
    y = _log_prob(x, temperature, row_max, log_total, SCALED)
    tl.store(y_ptr + row * V + cols, y.to(y_ptr.dtype.element_ty), mask=ok)  # y is contiguous


@triton.jit(do_not_specialize=["R", "stride_x"])
def _token_logprobs_kernel(
    x_ptr,
    tok_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    R,
    stride_x,
    temperature,
    SEGMENTS: tl.constexpr,
    VEC: tl.constexpr,
    SCALED: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # one row per lane
    ok = rows < R
    row_max, log_total = _row_stats(
        max_ptr + rows * SEGMENTS, sum_ptr + rows * SEGMENTS, ok, SEGMENTS
    )
    token = tl.load(tok_ptr + rows, mask=ok, other=0)
    x = tl.load(x_ptr + rows * stride_x * VEC + token, mask=ok, other=0.0)
    tl.store(out_ptr + rows, _log_prob(x, temperature, row_max, log_total, SCALED), mask=ok)


def segment_width(vocab: int, segment: int = LOG_SOFTMAX_SEGMENT) -> int:
    """Entries per segment for rows of ``vocab``: the whole row (next power of two) up to
    ``segment`` (a power of two), else ``segment``. A function of V only."""
    assert segment & (segment - 1) == 0, "segment: expected a power of two"
    return row_chunk(vocab, cap=segment)


def _warps(width: int) -> int:
    # 32 elements per thread (four 16-byte bf16 loads), 1 to 4 warps.
    return min(4, max(1, width // 1024))


def _stats_launch(x, temperature, segment):
    """The statistics launch of ``x [R, V]``, its two fp32 ``[R, segments]`` outputs, and the
    constexprs that describe the row."""
    rows, vocab = x.shape
    width = segment_width(vocab, segment)
    segments = cdiv(vocab, width)
    vec = vector_width(vocab, x.dtype)
    seg_max = torch.empty(rows, segments, dtype=torch.float32, device=x.device)
    seg_sum = torch.empty(rows, segments, dtype=torch.float32, device=x.device)
    shape = dict(V=vocab, SEGMENT=width, SEGMENTS=segments, VEC=vec, SCALED=temperature != 1.0)
    launch = Launch(
        _segment_stats_kernel,
        (rows, segments),
        dict(
            x_ptr=x,
            max_ptr=seg_max,
            sum_ptr=seg_sum,
            stride_x=stride_in_vectors(x, vec),
            temperature=float(temperature),  # one binary whatever number type was passed
            **shape,
        ),
        num_warps=_warps(width),
        num_stages=1,
    )
    return launch, seg_max, seg_sum, shape


def log_softmax_launches(x, out, temperature, segment: int = LOG_SOFTMAX_SEGMENT) -> list[Launch]:
    """The launches writing ``out [R, V] = log_softmax(x [R, V] / temperature)`` (``out``
    contiguous, ``x`` as :func:`~._rows.kernel_rows` returns it): segment statistics, the row fold
    when the row has more than :data:`FUSED_MERGE_MAX` segments, then the write. Works on
    meta tensors; ``segment`` is the production width unless a test shrinks it."""
    stats, seg_max, seg_sum, shape = _stats_launch(x, temperature, segment)
    assert out.is_contiguous() and out.shape == x.shape
    rows, merge = x.shape[0], shape["SEGMENTS"] <= FUSED_MERGE_MAX
    row_max = torch.empty(0 if merge else rows, dtype=torch.float32, device=x.device)
    log_total = torch.empty_like(row_max)
    fold = Launch(
        _row_stats_kernel,
        (cdiv(rows, ROWS),),
        dict(
            max_ptr=seg_max,
            sum_ptr=seg_sum,
            row_max_ptr=row_max,
            log_total_ptr=log_total,
            R=rows,
            SEGMENTS=shape["SEGMENTS"],
            ROWS=ROWS,
        ),
        num_warps=ROWS // 32,
        num_stages=1,
    )
    write = Launch(
        _log_softmax_kernel,
        stats.grid,
        dict(
            x_ptr=x,
            max_ptr=seg_max,
            sum_ptr=seg_sum,
            row_max_ptr=row_max if not merge else seg_max,
            log_total_ptr=log_total if not merge else seg_sum,
            y_ptr=out,
            stride_x=stats.args["stride_x"],
            temperature=float(temperature),  # one binary whatever number type was passed
            MERGE=merge,
            **shape,
        ),
        num_warps=stats.num_warps,
        num_stages=1,
    )
    tensors = (x, out, seg_max, seg_sum, row_max, log_total)
    plan_key = _plan_key(shape, stats.args["stride_x"], rows, *tensors)
    launches = [stats, write] if merge else [stats, fold, write]
    for launch in launches:
        launch.plan_key = plan_key
    return launches


def token_logprobs_launches(
    logits, tokens, out, temperature, segment: int = LOG_SOFTMAX_SEGMENT
) -> list[Launch]:
    """The launches writing ``out [R] = log_softmax(logits / temperature)[r, tokens[r]]``
    (fp32): the same statistics as :func:`log_softmax_launches`, then fold-and-gather."""
    stats, seg_max, seg_sum, shape = _stats_launch(logits, temperature, segment)
    rows = logits.shape[0]
    gather = Launch(
        _token_logprobs_kernel,
        (cdiv(rows, ROWS),),
        dict(
            x_ptr=logits,
            tok_ptr=tokens,
            max_ptr=seg_max,
            sum_ptr=seg_sum,
            out_ptr=out,
            R=rows,
            stride_x=stats.args["stride_x"],
            temperature=float(temperature),  # one binary whatever number type was passed
            SEGMENTS=shape["SEGMENTS"],
            VEC=shape["VEC"],
            SCALED=shape["SCALED"],
            ROWS=ROWS,
        ),
        num_warps=ROWS // 32,
        num_stages=1,
    )
    plan_key = _plan_key(shape, stats.args["stride_x"], rows, logits, tokens, out, seg_max, seg_sum)
    stats.plan_key = gather.plan_key = plan_key
    return [stats, gather]


def _plan_key(shape: dict, stride: int, rows: int, *tensors: torch.Tensor) -> tuple:
    """What decides one call's binaries (LaunchPlans; tested against the arguments' key): the
    row's constexprs, every tensor's dtype and alignment, 32-bit row counts and strides."""
    dtypes = tuple(t.dtype for t in tensors)
    return tuple(shape.items()), dtypes, alignments(*tensors), stride in I32, rows in I32


def log_softmax(x, temperature, out_dtype, segment: int = LOG_SOFTMAX_SEGMENT):
    """fp32 ``log_softmax(x [R, V] / temperature)`` in ``out_dtype``."""
    x, _ = kernel_rows(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    for launch in log_softmax_launches(x, out, temperature, segment):
        launch()
    return out


def token_logprobs(logits, tokens, temperature, segment: int = LOG_SOFTMAX_SEGMENT):
    """``log_softmax(logits [R, V] / temperature)[r, tokens[r]]`` as fp32 ``[R]``."""
    logits, _ = kernel_rows(logits)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    tokens = aligned(tokens.contiguous())
    for launch in token_logprobs_launches(logits, tokens, out, temperature, segment):
        launch()
    return out
