"""rms_norm: batch invariance, accuracy, backward, errors, control."""

import pytest
import torch
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, embed_row, randn
from hypothesis import given
from hypothesis import strategies as st

import bik
from bik.backends import reference


@given(
    dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), d=st.integers(1, 5000), data=st.data()
)
def test_row_is_batch_invariant(backend, dtype, rows, d, data):
    # d up to 5000 crosses the 4096-wide chunk, so multi-chunk rows and chunk tails are covered.
    position = data.draw(st.integers(0, rows - 1))
    weight = randn((d,), dtype, 1)
    row, others = randn((1, d), dtype, 2), randn((rows - 1, d), dtype, 3, scale=5.0)
    alone = bik.rms_norm(row, weight)
    batched = bik.rms_norm(embed_row(row, others, position), weight)
    assert_bitwise(batched[position : position + 1], alone, f"row {position} of {rows}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 100, 4096, 4500])
def test_accuracy_against_float64(backend, dtype, d):
    x, w = randn((5, 3, d), dtype, 4, scale=3.0), randn((d,), dtype, 5)
    expected = reference.rms_norm(x.double(), w.double(), 1e-6)
    out = bik.rms_norm(x, w)
    assert out.dtype == dtype
    assert_close_to_reference(out, expected, dtype, "rms_norm")


def test_weight_may_have_another_dtype(backend):
    x, w = randn((4, 64), torch.bfloat16, 6), randn((64,), torch.float32, 7)
    expected = reference.rms_norm(x.double(), w.double(), 1e-5)
    assert_close_to_reference(bik.rms_norm(x, w, eps=1e-5), expected, torch.bfloat16)


def test_reruns_and_strided_rows(backend):
    x, w = randn((64, 33), torch.float16, 8), randn((32,), torch.float16, 9)
    view = x[::2, 1:]  # strided rows, offset start
    assert_bitwise(bik.rms_norm(view, w), bik.rms_norm(view.contiguous(), w), "strided")
    assert_bitwise(bik.rms_norm(view, w), bik.rms_norm(view, w), "rerun")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(backend, dtype):
    x, w, grad = randn((6, 48), dtype, 10), randn((48,), dtype, 11), randn((6, 48), dtype, 12)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    bik.rms_norm(*leaves).backward(grad)
    ref = [x.double().requires_grad_(), w.double().requires_grad_()]
    reference.rms_norm(*ref, 1e-6).backward(grad.double())
    for got, want, name in zip(leaves, ref, ("x", "weight")):
        assert_close_to_reference(got.grad, want.grad, dtype, f"grad {name}")


def test_empty_and_nonfinite(backend):
    w = randn((8,), torch.float32, 13)
    assert bik.rms_norm(torch.empty(0, 8, device=w.device), w).shape == (0, 8)
    x = randn((4, 8), torch.float32, 14)
    x[1, 2], x[3, 0] = float("nan"), float("inf")
    out, expected = bik.rms_norm(x, w), reference.rms_norm(x, w, 1e-6)
    assert torch.equal(out.isnan(), expected.isnan())
    assert not out[[0, 2]].isnan().any()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: bik.rms_norm(torch.ones(2, 3), torch.ones(4)),
            ValueError,
            "weight: expected size 3",
        ),
        (
            lambda: bik.rms_norm(torch.ones(2, 3), torch.ones(1, 3)),
            ValueError,
            "weight: expected 1 dims",
        ),
        (
            lambda: bik.rms_norm(torch.ones(2, 3, dtype=torch.int32), torch.ones(3)),
            TypeError,
            "x: expected dtype",
        ),
        (lambda: bik.rms_norm(torch.ones(2, 3), torch.ones(3), eps=-1.0), ValueError, "eps"),
        (
            lambda: bik.rms_norm(torch.ones(2, 3), torch.ones(3, device="meta")),
            ValueError,
            "weight: expected device",
        ),
    ],
)
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_control_reduction_order_changes_bits():
    # torch's CPU rms_norm happens to be row-invariant, so the control shows instead that the
    # bitwise comparison is sensitive to reduction order: the same squares summed in another
    # order give other bits for at least one row.
    x = randn((64, 4096), torch.float32, 15, scale=3.0)
    forward = (x * x).sum(-1)
    backward = (x * x).flip(-1).cumsum(-1)[:, -1]
    assert not torch.equal(forward, backward)
