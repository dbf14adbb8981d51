"""The "cpu" backend: C++ kernels from csrc/cpu (pybind11 + OpenMP), same fixed orders.

Each output element is computed by one thread in one order (see csrc/cpu/common.h), so the
bits do not depend on the batch, on chunking or padding, or on the number of threads.
"""

import torch

try:
    from . import _cpu
except ImportError as error:
    raise ImportError(
        "bik cpu backend is not built: reinstall with a C++17 compiler present "
        "(`pip install -e .` in the bik checkout builds csrc/cpu)"
    ) from error

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def check_device(device):
    if device.type != "cpu":
        raise RuntimeError(f"bik cpu backend: runs CPU tensors only, got device {device}")


def _inner_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def matmul(a, b, bias):
    """``a [B, M, K] @ b [B or 1, K, N] (+ bias [N])`` -> ``[B, M, N]`` in a's dtype."""
    batch, m, k = a.shape
    n = b.shape[2]
    a = _inner_contiguous(a)
    out = torch.empty(batch, m, n, dtype=a.dtype)
    _cpu.matmul(
        _DTYPE_CODES[a.dtype], a.data_ptr(), b.data_ptr(),
        0 if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
        batch, m, n, k, a.stride(0), a.stride(1), b.stride(0) if b.shape[0] > 1 else 0,
        b.stride(1), b.stride(2),
    )
    return out


def rms_norm(x, weight, eps):
    x, weight = _inner_contiguous(x), weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _cpu.rms_norm(_DTYPE_CODES[x.dtype], _DTYPE_CODES[weight.dtype], x.data_ptr(),
                  weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0), eps)
    return out


def log_softmax(x, temperature, out_dtype):
    x = _inner_contiguous(x)
    out = torch.empty(x.shape, dtype=out_dtype)
    _cpu.log_softmax(_DTYPE_CODES[x.dtype], _DTYPE_CODES[out_dtype], x.data_ptr(), out.data_ptr(),
                     x.shape[0], x.shape[1], x.stride(0), temperature)
    return out


def token_logprobs(logits, tokens, temperature):
    logits, tokens = _inner_contiguous(logits), tokens.to(torch.int64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.float32)
    _cpu.token_logprobs(_DTYPE_CODES[logits.dtype], logits.data_ptr(), tokens.data_ptr(),
                        out.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                        temperature)
    return out


def attention(q, k, v, causal, scale, kv_start, split_size):
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    kv_start = kv_start.to(torch.int32).contiguous()
    batch, hq, tq, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    _cpu.attention(
        _DTYPE_CODES[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_start.data_ptr(),
        out.data_ptr(), (batch, hq, k.shape[1], tq, k.shape[2], d, split_size),
        q.stride()[:3], k.stride()[:3], v.stride()[:3], scale, causal,
    )
    return out
