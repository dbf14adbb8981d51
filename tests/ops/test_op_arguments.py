"""Scalar arguments: real scalars of any kind are accepted with the same bits, bad ones are
refused with a message naming the argument; degenerate shapes give empty results."""

import numpy as np
import pytest
import torch
from conftest import DEVICE
from helpers import randn

import bik


def test_real_scalars_of_any_kind_give_the_bits_of_a_float(backend):
    logits, tokens = randn((4, 50), torch.float32, 1), torch.tensor([1, 2, 3, 4], device=DEVICE)
    q, kv = randn((1, 2, 5, 8), torch.float32, 2), randn((1, 2, 5, 8), torch.float32, 3)
    x, w = randn((3, 16), torch.float32, 4), randn((16,), torch.float32, 5)
    t = float(np.float32(0.7))
    for temperature in (np.float32(0.7), torch.tensor(t), np.float64(t)):
        assert torch.equal(
            bik.token_logprobs(logits, tokens, temperature), bik.token_logprobs(logits, tokens, t)
        )
    for scale in (np.float32(0.25), torch.tensor(0.25), 0.25):
        assert torch.equal(
            bik.attention(q, kv, kv, scale=scale), bik.attention(q, kv, kv, scale=0.25)
        )
    assert torch.equal(
        bik.rms_norm(x, w, np.float32(1e-5)), bik.rms_norm(x, w, float(np.float32(1e-5)))
    )
    assert torch.equal(
        bik.attention(q, kv, kv, causal=np.bool_(False)), bik.attention(q, kv, kv, causal=False)
    )
    for softcap in (np.float32(1.5), torch.tensor(1.5), 1.5, np.int64(2)):
        assert torch.equal(
            bik.attention(q, kv, kv, softcap=softcap),
            bik.attention(q, kv, kv, softcap=float(softcap)),
        )
    for window in (np.int64(3), np.int32(3)):
        assert torch.equal(
            bik.attention(q, kv, kv, window=window), bik.attention(q, kv, kv, window=3)
        )


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda q: bik.attention(q, q, q, scale=float("inf")),
            ValueError,
            "scale: expected a positive number that is finite",
        ),
        (lambda q: bik.attention(q, q, q, scale=1e300), ValueError, "scale: .*finite and not 0"),
        (lambda q: bik.attention(q, q, q, scale=float("nan")), ValueError, "scale"),
        (lambda q: bik.attention(q, q, q, scale=1e-50), ValueError, "scale: .*not 0 in float32"),
        (lambda q: bik.attention(q, q, q, scale="0.5"), TypeError, "scale: expected a real number"),
        (
            lambda q: bik.attention(q, q, q, scale=torch.ones(2)),
            TypeError,
            "scale: expected a real number",
        ),
        (
            lambda q: bik.attention(q, q, q, causal="no"),
            TypeError,
            "causal: expected True or False",
        ),
        (lambda q: bik.attention(q, q, q, causal=1), TypeError, "causal: expected True or False"),
        (lambda q: bik.attention(q, q, q, softcap=0), ValueError, "softcap: expected a positive"),
        (lambda q: bik.attention(q, q, q, softcap="1"), TypeError, "softcap: expected a real"),
        (
            lambda q: bik.attention(q, q, q, window=1.0),
            TypeError,
            "window: expected a positive int",
        ),
        (lambda q: bik.attention(q, q, q, window=0), ValueError, "window: expected a positive int"),
        (lambda q: bik.log_softmax(q, dim=True), ValueError, "dim: expected the last dim"),
        (
            lambda q: bik.token_logprobs(
                q, torch.zeros(q.shape[:-1], dtype=torch.long), temperature=True
            ),
            TypeError,
            "temperature",
        ),
        (
            lambda q: bik.token_logprobs(
                q, torch.zeros(q.shape[:-1], dtype=torch.long), temperature=float("inf")
            ),
            ValueError,
            "temperature",
        ),
        (
            lambda q: bik.rms_norm(q, torch.ones(q.shape[-1]), eps=float("nan")),
            ValueError,
            "eps: expected a number >= 0",
        ),
        (
            lambda q: bik.rms_norm(q, torch.ones(q.shape[-1]), eps=-1e-6),
            ValueError,
            "eps: expected a number >= 0",
        ),
    ],
)
def test_bad_scalars_are_refused_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.ones(1, 2, 3, 4))


def test_head_dim_zero_gives_an_empty_result(backend):
    q = torch.ones(2, 4, 3, 0)
    kv = torch.ones(2, 2, 5, 0)
    out = bik.attention(q, kv, kv)
    assert out.shape == (2, 4, 3, 0)
    assert bik.attention(q, kv, kv, scale=0.5).shape == (2, 4, 3, 0)
