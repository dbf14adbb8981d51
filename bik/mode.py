"""A global batch-invariant mode: aten ops overridden through torch.library.

Inside ``with bik.batch_invariant_mode():`` (or between ``enable_batch_invariant_mode()`` and
``disable_batch_invariant_mode()``) unmodified torch code runs these aten ops on bik's
kernels, for CPU and CUDA tensors: mm, addmm, bmm, _log_softmax, _softmax, mean.dim and the
fused CPU / CUDA flash SDPA kernels. Autograd formulas of these ops call the same overrides.

What it cannot cover (these raise ``NotImplementedError`` or are left to torch):
  * dtypes other than float32 / bfloat16 / float16 in the overridden ops;
  * SDPA with an explicit attn_mask, dropout, or is_causal with Tq != Tk (torch aligns such a
    causal mask top-left; bik's queries are the last Tq keys) -- use bik.attention directly;
  * reductions it does not override (sum, var, norm, cumsum, other attention kernels,
    convolutions): they keep torch's own, shape-dependent order.
"""

import contextlib

import torch

from . import _checks, backends
from .ops.attention import attention
from .ops.log_softmax import log_softmax

_library = None


def _backend(device):
    backend = backends.resolve(device)
    if not backend.invariant:
        raise RuntimeError("batch_invariant_mode needs an invariant backend, not 'reference'")
    return backend


def _supported(op, *tensors):
    for t in tensors:
        if t is not None and t.dtype not in _checks.FLOAT_DTYPES:
            raise NotImplementedError(
                f"bik batch_invariant_mode: aten.{op} on {t.dtype} is not covered"
            )


def _bmm(a, b, bias=None):
    """Batched ``a [B, M, K] @ b [B, K, N]`` through the backend's fixed-order kernel."""
    _supported("mm", a, b, bias)
    if a.shape[1] == 0 or b.shape[2] == 0:
        return a.new_zeros(a.shape[0], a.shape[1], b.shape[2])
    return _backend(a.device).matmul(a, b, bias)


def _mm(a, b):
    return _bmm(a.unsqueeze(0), b.unsqueeze(0))[0]


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and bias.dim() == 1:
        return _bmm(a.unsqueeze(0), b.unsqueeze(0), bias)[0]  # bias in the fp32 epilogue
    return beta * bias + alpha * _mm(a, b)


def _last_dim(fn, x, dim):
    """Apply a last-dim row function along ``dim``."""
    moved = x.movedim(dim, -1)
    return fn(moved).movedim(-1, dim)


def _log_softmax(x, dim, half_to_float):
    _supported("_log_softmax", x)
    _backend(x.device)  # refuses the non-invariant reference backend
    out_dtype = torch.float32 if half_to_float else x.dtype
    return _last_dim(lambda t: log_softmax(t, dtype=out_dtype), x, dim)


def _softmax(x, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else x.dtype
    return _log_softmax(x, dim, True).exp().to(out_dtype)


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    _supported("mean.dim", x)
    dims = sorted(d % x.dim() for d in (dim if dim else range(x.dim())))
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*kept, *dims).reshape(-1, max(1, _numel(x, dims))).float()
    # One fixed-order sum per row: a matmul with a ones column (ascending k, fp32).
    total = _mm(rows, torch.ones(rows.shape[1], 1, device=x.device))[:, 0]
    out = (total / rows.shape[1]).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out.to(dtype or x.dtype)


def _numel(x, dims):
    count = 1
    for d in dims:
        count *= x.shape[d]
    return count


def _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _supported("_scaled_dot_product_flash_attention_for_cpu", q, k, v)
    if attn_mask is not None or dropout_p or (is_causal and q.shape[2] != k.shape[2]):
        raise NotImplementedError(
            "bik batch_invariant_mode: SDPA with attn_mask, dropout, or is_causal with Tq != Tk "
            "is not covered; call bik.attention with kv_start instead"
        )
    _backend(q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = attention(q, k, v, causal=is_causal, scale=scale)
    # logsumexp is only read by the backward formula; plain fp32 math (deterministic).
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if is_causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    return out, torch.logsumexp(scores, dim=-1)


_OVERRIDES = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "_log_softmax": _log_softmax,
    "_softmax": _softmax,
    "mean.dim": _mean_dim,
}


def enable_batch_invariant_mode():
    """Route the covered aten ops of CPU and CUDA tensors through bik (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for key in ("CPU", "CUDA"):
        for op, fn in _OVERRIDES.items():
            library.impl(op, fn, key)
    library.impl("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu, "CPU")
    _library = library


def disable_batch_invariant_mode():
    """Restore torch's own kernels."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def is_batch_invariant_mode_enabled():
    return _library is not None


@contextlib.contextmanager
def batch_invariant_mode():
    """Context manager form of :func:`enable_batch_invariant_mode`; restores the previous state."""
    was_enabled = is_batch_invariant_mode_enabled()
    enable_batch_invariant_mode()
    try:
        yield
    finally:
        if not was_enabled:
            disable_batch_invariant_mode()
