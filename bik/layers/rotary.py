"""Rotary position embedding (RoPE): the cos/sin tables and their application.

Elementwise only, but both sides of a rollout/training pair must produce the same bits, so
both call these functions: the Hugging Face rotary module (patched by bik.patch_model) and
vLLM's rotary layer (bik.vllm). Each step is a single correctly rounded op per element
(product, cos/sin, product, sum), so an element's bits never depend on the batch or layout.
"""

import torch

from .. import _checks


def rotary_cos_sin(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions[..., None] * inv_freq`` (fp32), each repeated twice along
    the last dim (the "half rotation" layout of Llama/Qwen), times ``scaling``, in ``dtype``.

    inv_freq ``[D/2]``, positions ``[...]`` (integer); returns two ``[..., D]`` tensors.
    """
    _checks.floating("inv_freq", inv_freq)
    _checks.rank("inv_freq", inv_freq, 1)
    _checks.tensor("positions", positions)
    if positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions: expected an integer tensor, got {positions.dtype}")
    scaling = _checks.real_number("scaling", scaling)
    freqs = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in x's dtype, ``rotate_half(x) = [-x2, x1]`` for the
    halves x1, x2 of the last dim; cos and sin broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """Inverse frequencies ``1 / base ** (2i / dim)`` of default RoPE, fp32 ``[dim / 2]``,
    computed as transformers computes them (so both sides start from the same bits)."""
    base = _checks.positive_number("base", base)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"dim: expected a positive even int, got {dim!r}")
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (DeepSeek's): the pairs ``(x0, x1), (x2, x3), ...`` each rotated by one
    frequency, the result laid out as transformers' ``apply_rotary_pos_emb_interleave`` lays
    it out, every pair's first element, then every second (``[x1 cos - x2 sin, x2 cos + x1
    sin]`` with ``x1 = x[..., 0::2]``, ``x2 = x[..., 1::2]``); cos and sin are the half-rotation
    tables (each half the same), of which the first half is read."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
