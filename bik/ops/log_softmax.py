"""log_softmax over the last dim and token log-probs, both fp32 math, one row at a time.

Backends find each row's max and sum of exponentials in an order fixed by the row length
alone: an online softmax over fixed-size chunks in ascending order (per-lane partials, then
one fixed reduction tree across lanes), or, in Triton, statistics of fixed-width segments
folded in ascending segment order (bik.contract states each).
``token_logprobs`` is THE log-prob formula of bik: the sampler and the trainer both call it.
"""

import torch

from .. import _checks, backends
from ..backends import reference
from . import _recompute
from ._dispatch import as_rows, custom_op, run, shaped


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.log_softmax`` over the last dim with fp32 math; output dtype ``dtype`` or x's."""
    _checks.floating("x", x)
    _checks.rank("x", x, (1,))
    if isinstance(dim, bool) or dim not in (-1, x.dim() - 1):
        raise ValueError(f"dim: expected the last dim (-1 or {x.dim() - 1}), got {dim!r}")
    if dtype is not None and dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected None, float32, bfloat16 or float16, got {dtype}")
    return run(_log_softmax_op, _log_softmax, x, dtype or x.dtype)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)`` over the full vocabulary, gathered at ``tokens``.

    logits ``[..., V]``, tokens ``[...]`` (integer, in ``[0, V)``); returns fp32 ``[...]``.
    """
    _checks.floating("logits", logits)
    _checks.rank("logits", logits, (1,))
    _checks.tensor("tokens", tokens)
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens: expected dtype int64 or int32, got {tokens.dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens: expected shape {tuple(logits.shape[:-1])} (logits without its last dim), "
            f"got {tuple(tokens.shape)}"
        )
    _checks.same_device("tokens", tokens, "logits", logits)
    vocab = logits.shape[-1]
    _checks.values_in_range("tokens", tokens, 0, vocab - 1, "ids of the vocabulary of logits")
    temperature = _checks.positive_number("temperature", temperature)
    return run(_token_logprobs_op, _token_logprobs, logits, tokens, temperature)


def _log_softmax(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    rows = as_rows(x)
    if rows.numel() == 0:
        return x.new_empty(x.shape, dtype=out_dtype)
    return shaped(backends.kernel(x.device, "log_softmax")(rows, 1.0, out_dtype), x.shape)


_log_softmax_op = custom_op("bik::log_softmax", _log_softmax, row_args=(0,))


@_log_softmax_op.register_fake
def _(x, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


def _log_softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _log_softmax_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    formula = lambda x_: reference.log_softmax(x_, 1.0, torch.float32)
    (grad_x,) = _recompute.grads(formula, (x,), (True,), grad)
    return grad_x, None


_log_softmax_op.register_autograd(_log_softmax_backward, setup_context=_log_softmax_setup)


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    if tokens.numel() == 0:
        return logits.new_empty(tokens.shape, dtype=torch.float32)
    kernel = backends.kernel(logits.device, "token_logprobs")
    out = kernel(as_rows(logits), tokens.reshape(-1), temperature)
    return shaped(out, tokens.shape)


_token_logprobs_op = custom_op("bik::token_logprobs", _token_logprobs, row_args=(0, 1))


@_token_logprobs_op.register_fake
def _(logits, tokens, temperature):
    return logits.new_empty(tokens.shape, dtype=torch.float32)


def _token_logprobs_setup(ctx, inputs, output):
    logits, tokens, ctx.temperature = inputs
    ctx.save_for_backward(logits, tokens)


def _token_logprobs_backward(ctx, grad):
    logits, tokens = ctx.saved_tensors
    rows, flat_tokens = as_rows(logits), tokens.reshape(-1)
    formula = lambda x_: reference.token_logprobs(x_, flat_tokens, ctx.temperature)
    (grad_rows,) = _recompute.grads(formula, (rows,), (True,), grad.reshape(-1))
    return grad_rows.reshape(logits.shape), None, None


_token_logprobs_op.register_autograd(_token_logprobs_backward, setup_context=_token_logprobs_setup)
