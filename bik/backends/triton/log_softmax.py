"""log_softmax and token log-probs: one row per program, online softmax over fixed chunks."""

import torch
import triton
import triton.language as tl

from ...contract import row_chunk

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _row_stats(x_row, V, temperature, BLOCK: tl.constexpr):
    """(max, log(sum(exp(x/T - max)))) of one row in a fixed order: per-lane online softmax
    over ascending chunks, then one fixed reduction tree across the lanes."""
    cols = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), NEG_INF, dtype=tl.float32)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, V, BLOCK):
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < V, other=NEG_INF).to(tl.float32)
        x = x / temperature
        new_max = tl.maximum(lane_max, x, propagate_nan=tl.PropagateNan.ALL)
        safe_max = tl.where(new_max == NEG_INF, 0.0, new_max)  # lanes that saw only -inf
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe_row_max = tl.where(row_max == NEG_INF, 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp(lane_max - safe_row_max), axis=0)
    return row_max, tl.log(total)


@triton.jit
def _log_prob(x, temperature, row_max, log_total):
    """The one log-prob expression both kernels share, so their bits agree."""
    return (x.to(tl.float32) / temperature - row_max) - log_total


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * stride_x, y_ptr + row * stride_y
    row_max, log_total = _row_stats(x_row, V, temperature, BLOCK)
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        ok = c0 + cols < V
        x = tl.load(x_row + c0 + cols, mask=ok, other=0.0)
        y = _log_prob(x, temperature, row_max, log_total)
        tl.store(y_row + c0 + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _token_logprobs_kernel(x_ptr, tok_ptr, out_ptr, V, stride_x, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    row_max, log_total = _row_stats(x_row, V, temperature, BLOCK)
    x = tl.load(x_row + tl.load(tok_ptr + row))
    tl.store(out_ptr + row, _log_prob(x, temperature, row_max, log_total))


def _rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def log_softmax(x, temperature, out_dtype):
    """fp32 ``log_softmax(x [R, V] / temperature)`` in ``out_dtype``."""
    x = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows, vocab = x.shape
    _log_softmax_kernel[(rows,)](
        x, out, vocab, x.stride(0), out.stride(0), temperature, BLOCK=row_chunk(vocab)
    )
    return out


def token_logprobs(logits, tokens, temperature):
    """``log_softmax(logits [R, V] / temperature)[r, tokens[r]]`` as fp32 ``[R]``."""
    logits = _rows(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _token_logprobs_kernel[(rows,)](
        logits,
        tokens.contiguous(),
        out,
        vocab,
        logits.stride(0),
        temperature,
        BLOCK=row_chunk(vocab),
    )
    return out
