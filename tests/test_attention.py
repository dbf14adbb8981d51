"""attention: prefill == chunked prefill == decode, padding, batch invariance, accuracy,
backward, errors, negative control."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik.backends import reference

SPLITS = st.sampled_from([32, 64, bik.DEFAULT_SPLIT_SIZE])


def qkv(batch, hkv, groups, length, dim, dtype, seed):
    q = randn((batch, hkv * groups, length, dim), dtype, seed)
    k = randn((batch, hkv, length, dim), dtype, seed + 1)
    v = randn((batch, hkv, length, dim), dtype, seed + 2)
    return q, k, v


def chunk_bounds(length, draw):
    cuts = sorted(draw(st.sets(st.integers(1, max(length - 1, 1)), max_size=4)))
    return list(zip([0, *cuts], [*cuts, length]))


# Every decode step is a kernel launch in the interpreter: at most 10 cases (fewer when the
# profile asks for fewer, as make test-fast does).
@settings(max_examples=min(10, settings.default.max_examples))
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 2),
    hkv=st.integers(1, 2),
    groups=st.integers(1, 3),
    length=st.integers(1, 70),
    dim=st.sampled_from([8, 16, 40]),
    split=SPLITS,
    data=st.data(),
)
def test_prefill_equals_chunked_prefill_equals_decode(
    backend, dtype, batch, hkv, groups, length, dim, split, data
):
    q, k, v = qkv(batch, hkv, groups, length, dim, dtype, seed=1)
    full = bik.attention(q, k, v, split_size=split)

    def upto(t, stop):
        return t[:, :, :stop]

    chunks = [
        bik.attention(q[:, :, a:b], upto(k, b), upto(v, b), split_size=split)
        for a, b in chunk_bounds(length, data.draw)
    ]
    assert_bitwise(torch.cat(chunks, dim=2), full, "chunked prefill")
    steps = [
        bik.attention(q[:, :, t : t + 1], upto(k, t + 1), upto(v, t + 1), split_size=split)
        for t in range(length)
    ]
    assert_bitwise(torch.cat(steps, dim=2), full, "token-by-token decode")


@given(
    dtype=st.sampled_from(DTYPES),
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    groups=st.integers(1, 2),
    causal=st.booleans(),
    split=SPLITS,
    data=st.data(),
)
def test_left_padded_batch_rows_equal_unpadded_rows_alone(
    backend, dtype, lengths, groups, causal, split, data
):
    # A batch of different sequences, left-padded with garbage to the longest one: each row's
    # valid outputs equal that sequence computed alone without padding (batch + padding axes).
    width = max(lengths) + data.draw(st.integers(0, 40))
    q, k, v = qkv(len(lengths), 2, groups, width, 16, dtype, seed=4)
    kv_start = torch.tensor([width - n for n in lengths], dtype=torch.int32, device=q.device)
    batched = bik.attention(q, k, v, causal=causal, kv_start=kv_start, split_size=split)
    for row, start in enumerate(kv_start.tolist()):
        alone = bik.attention(
            *(t[row : row + 1, :, start:] for t in (q, k, v)), causal=causal, split_size=split
        )
        assert_bitwise(batched[row : row + 1, :, start:], alone, f"row {row}")
        if causal:  # a padding query sees no key
            assert torch.equal(batched[row, :, :start], torch.zeros_like(batched[row, :, :start]))
    # Decode the last token of each padded row over its padded cache.
    last = bik.attention(q[:, :, -1:], k, v, causal=causal, kv_start=kv_start, split_size=split)
    assert_bitwise(last, batched[:, :, -1:], "padded decode")


@given(dtype=st.sampled_from(DTYPES), length=st.integers(1, 60), extra=st.integers(1, 40))
def test_right_padding_does_not_change_causal_rows(backend, dtype, length, extra):
    q, k, v = qkv(1, 1, 2, length + extra, 16, dtype, seed=7)
    padded = bik.attention(q, k, v)
    alone = bik.attention(*(t[:, :, :length] for t in (q, k, v)))
    assert_bitwise(padded[:, :, :length], alone, "right padding")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq", [1, 17, 70])
def test_accuracy_against_float64(backend, dtype, causal, tq):
    q, k, v = qkv(2, 2, 2, 70, 24, dtype, seed=10)
    q = q[:, :, 70 - tq :]
    kv_start = torch.tensor([0, 9], dtype=torch.int32, device=q.device)
    out = bik.attention(q, k, v, causal=causal, kv_start=kv_start, split_size=32, scale=0.3)
    expected = reference.attention(q.double(), k.double(), v.double(), causal, 0.3, kv_start, None)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_to_reference(out, expected, dtype, "attention")
    if not causal:  # cross-check the oracle itself against torch's SDPA
        sdpa = F.scaled_dot_product_attention(
            q[:1].double(), k[:1].double(), v[:1].double(), scale=0.3, enable_gqa=True
        )
        assert torch.allclose(expected[:1], sdpa)


def test_default_scale_and_split(backend):
    q, k, v = qkv(1, 1, 1, 300, 16, torch.float32, seed=13)
    explicit = bik.attention(q, k, v, scale=1 / math.sqrt(16), split_size=bik.DEFAULT_SPLIT_SIZE)
    assert_bitwise(bik.attention(q, k, v), explicit, "defaults")


def test_reruns_are_identical(backend):
    q, k, v = qkv(2, 2, 2, 50, 16, torch.bfloat16, seed=14)
    assert_bitwise(
        bik.attention(q, k, v, split_size=32), bik.attention(q, k, v, split_size=32), "rerun"
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(backend, dtype):
    q, k, v = qkv(2, 1, 2, 20, 16, dtype, seed=15)
    kv_start = torch.tensor([0, 4], dtype=torch.int32, device=q.device)
    grad = randn(q.shape, dtype, 18)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bik.attention(*leaves, kv_start=kv_start).backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    reference.attention(*ref, True, 0.25, kv_start, None).backward(grad.double())
    for got, want, name in zip(leaves, ref, "qkv"):
        assert_close_to_reference(got.grad, want.grad, dtype, f"grad {name}")


def test_nan_stays_in_its_batch_row(backend):
    q, k, v = qkv(3, 1, 1, 20, 16, torch.float32, seed=19)
    k[1, 0, 5, 0] = float("nan")
    out = bik.attention(q, k, v)
    assert out[1, :, 5:].isnan().all() and not out[1, :, :5].isnan().any()
    assert not out[[0, 2]].isnan().any()


def test_empty_inputs(backend):
    q, k, v = qkv(2, 1, 1, 5, 16, torch.float32, seed=20)
    assert bik.attention(q[:, :, :0], k, v).shape == (2, 1, 0, 16)
    assert bik.attention(q[:0], k[:0], v[:0]).shape == (0, 1, 5, 16)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: bik.attention(_t(1, 2, 3), _t(1, 2, 3, 4), _t(1, 2, 3, 4)),
            ValueError,
            "q: expected 4 dims",
        ),
        (
            lambda: bik.attention(_t(1, 3, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4)),
            ValueError,
            "k: expected a head count",
        ),
        (
            lambda: bik.attention(_t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 4, 4)),
            ValueError,
            "v: expected the shape of k",
        ),
        (
            lambda: bik.attention(_t(1, 2, 3, 4), _t(1, 2, 3, 8), _t(1, 2, 3, 8)),
            ValueError,
            "k: expected size 4 in dim 3",
        ),
        (
            lambda: bik.attention(_t(2, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4)),
            ValueError,
            "k: expected size 2 in dim 0",
        ),
        (
            lambda: bik.attention(_t(1, 2, 5, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4)),
            ValueError,
            "q: expected at most Tk=3",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4),
                _t(1, 2, 3, 4, dtype=torch.float16),
                _t(1, 2, 3, 4, dtype=torch.float16),
            ),
            TypeError,
            "k: expected dtype",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), kv_start=torch.tensor([3])
            ),
            ValueError,
            r"kv_start: expected values in \[0, 2\]",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), kv_start=torch.tensor([-1])
            ),
            ValueError,
            "kv_start: expected values",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), kv_start=torch.tensor([0, 0])
            ),
            ValueError,
            r"kv_start: expected shape \(1,\)",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), kv_start=torch.tensor([0.0])
            ),
            TypeError,
            "kv_start: expected dtype",
        ),
        (
            lambda: bik.attention(_t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), split_size=48),
            ValueError,
            "split_size: expected a positive multiple of 32",
        ),
        (
            lambda: bik.attention(_t(1, 2, 3, 4), _t(1, 2, 3, 4), _t(1, 2, 3, 4), scale=-1.0),
            ValueError,
            "scale",
        ),
        (
            lambda: bik.attention(
                _t(1, 2, 3, 4, dtype=torch.int32), _t(1, 2, 3, 4), _t(1, 2, 3, 4)
            ),
            TypeError,
            "q: expected dtype",
        ),
    ],
)
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_negative_control_plain_torch_decode_differs_from_prefill():
    differs = []
    for length in (64, 100, 200, 333):
        q, k, v = qkv(1, 4, 1, length, 64, torch.float32, seed=length)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1:]
        differs.append(not torch.equal(full, F.scaled_dot_product_attention(q[:, :, -1:], k, v)))
    assert any(differs)
