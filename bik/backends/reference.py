"""The "reference" backend: plain, differentiable torch.

It is the accuracy oracle (run it on float64 inputs for a ground truth) and what the op
backward passes differentiate. It is NOT batch-invariant: torch picks kernels and reduction
orders by shape. Kernel signatures match every other backend (see bik.backends.base).
"""

import torch

from .base import AttentionOptions, Backend


def _at_least_fp32(t):
    """fp32 math for low-precision inputs; float64 inputs (the oracle) stay float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def matmul(a, b, bias):
    """``a [B, M, K] @ b [B or 1, K, N]`` or ``a [M, K] @ b [K, N]`` (+ bias [N]) in a's dtype."""
    out = torch.matmul(a, b)
    return out if bias is None else out + bias


def rms_norm(x, weight, eps):
    """Rows of ``x [R, D]`` scaled to unit RMS then by ``weight``; fp32 math."""
    wide = _at_least_fp32(x)
    inv_rms = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (wide * inv_rms * weight.to(wide.dtype)).to(x.dtype)


def log_softmax(x, temperature, out_dtype):
    """``log_softmax(x / temperature)`` (fp32 or wider math) over the last dim of ``x [R, V]``."""
    return torch.log_softmax(_at_least_fp32(x) / temperature, dim=-1).to(out_dtype)


def token_logprobs(logits, tokens, temperature):
    """``log_softmax(logits [R, V] / temperature)`` gathered at ``tokens [R]`` (fp32 or wider)."""
    logp = log_softmax(logits, temperature, _at_least_fp32(logits).dtype)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def attention_mask(tq, tk, kv_start, causal, window=None):
    """Boolean ``[B, 1, Tq, Tk]``: key j is visible to query i (at position p = Tk - Tq + i)
    iff j >= kv_start[b] and, when causal, j <= p and, with a sliding ``window``,
    j > p - window."""
    keys = torch.arange(tk, device=kv_start.device)
    visible = keys[None, None, :] >= kv_start[:, None, None].long()
    if causal:
        positions = torch.arange(tk - tq, tk, device=kv_start.device)
        visible = visible & (keys[None, None, :] <= positions[None, :, None])
        if window is not None:
            visible = visible & (keys[None, None, :] > positions[None, :, None] - window)
    return visible.unsqueeze(1)


def attention(q, k, v, kv_start, options: AttentionOptions, sinks=None):
    """Softmax attention, GQA by head groups; queries with no visible key give zeros.

    ``options.softcap``: scores ``s`` become ``softcap * tanh(s / softcap)`` before masking.
    ``options.window``: a causal sliding window, query at position p sees keys in
    ``(p - window, p]``. ``sinks [Hq]``: one more logit per head in the softmax, attending no
    value (gpt-oss; None: off). ``options.split_size`` is ignored: plain torch has no fixed
    split structure.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    visible = attention_mask(q.shape[2], k.shape[2], kv_start, options.causal, options.window)
    scores = _at_least_fp32(torch.matmul(q, k.transpose(-1, -2))) * options.scale
    if options.softcap is not None:  # transformers' Gemma 2 order: divide, tanh, multiply
        scores = torch.tanh(scores / options.softcap) * options.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # gpt-oss: the sink as one more column of logits, dropped after the softmax
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = probs.masked_fill(~visible.any(-1, keepdim=True), 0.0)  # no visible key -> 0
    return torch.matmul(probs.to(v.dtype), v)


def _repeat_heads(t, groups):
    """``[B, H, T, D] -> [B, H * groups, T, D]``, each head repeated ``groups`` times in a row.

    expand + reshape (not repeat_interleave) so the backward is a plain sum over the group.
    """
    b, h, t_len, d = t.shape
    return t.unsqueeze(2).expand(b, h, groups, t_len, d).reshape(b, h * groups, t_len, d)


BACKEND = Backend(
    name="reference",
    device_types=(),  # plain torch runs on every device
    order="plain torch, float64-capable: orders chosen by shape and threads (NOT invariant)",
    matmul=matmul,
    rms_norm=rms_norm,
    log_softmax=log_softmax,
    token_logprobs=token_logprobs,
    attention=attention,
    attention_sinks=True,
    invariant=False,
)
