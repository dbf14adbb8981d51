"""matmul / linear: batch invariance, accuracy, backward, errors, negative control."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, embed_row, randn
from hypothesis import given
from hypothesis import strategies as st

import bik
from bik import backends

# Sizes straddle the 64-wide M/N tiles and the 32-deep K tiles so tails are exercised.
sizes = st.integers(1, 150)


@given(dtype=st.sampled_from(DTYPES), m=sizes, n=sizes, k=sizes, bias=st.booleans(), data=st.data())
def test_row_is_batch_invariant(backend, dtype, m, n, k, bias, data):
    position = data.draw(st.integers(0, m - 1))
    weight = randn((n, k), dtype, seed=1)
    b = randn((n,), dtype, seed=2) if bias else None
    row, others = randn((1, k), dtype, seed=3), randn((m - 1, k), dtype, seed=4)
    alone = bik.linear(row, weight, b)
    batched = bik.linear(embed_row(row, others, position), weight, b)
    assert_bitwise(batched[position : position + 1], alone, f"row {position} of {m}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_gives_one_product_the_bits_of_a_batch_of_one(backend, dtype):
    # Ops hand the kernel 2-D operands (no batch dim to add and drop per call); the batched
    # layout (bmm, grouped experts) must give each product the same bits. Shapes that the
    # Triton TMA kernel takes (16-byte rows) and ones it does not, W^T views and contiguous B.
    kernel = backends.kernel(DEVICE, "matmul")
    for m, n, k in ((37, 24, 48), (5, 20, 33)):
        a, weight, bias = randn((m, k), dtype, 5), randn((n, k), dtype, 6), randn((n,), dtype, 7)
        for b in (weight.t(), weight.t().contiguous()):
            for add in (None, bias):
                one = kernel(a, b, add)
                assert_bitwise(one, kernel(a[None], b[None], add)[0], f"{m}x{n}x{k}")
                assert_bitwise(one, bik.matmul(a, b, add), f"{m}x{n}x{k}, bik.matmul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_equal_batched_rows(backend, dtype):
    # The cpu backend streams the weight in 64-deep K slices for calls of at most 16 rows and
    # packs whole panels above: every row must get the same bits either way, at K tails too.
    for k in (1, 63, 64, 65, 200):
        weight, bias = randn((70, k), dtype, seed=k), randn((70,), dtype, seed=k + 1)
        x = randn((40, k), dtype, seed=k + 2)
        batched = bik.linear(x, weight, bias)
        for m in (1, 15, 16):
            assert_bitwise(bik.linear(x[:m], weight, bias), batched[:m], f"{m} rows, K={k}")


@given(dtype=st.sampled_from(DTYPES), lead=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_leading_dims_match_flat_rows(backend, dtype, lead):
    x, b = randn((*lead, 40), dtype, seed=5), randn((40, 70), dtype, seed=6)
    flat = bik.matmul(x.reshape(-1, 40), b)
    assert_bitwise(bik.matmul(x, b), flat.reshape(*lead, 70), "leading dims")
    assert_bitwise(bik.matmul(x[(0,) * (len(lead) - 1)][0], b), flat[0], "1-D input")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(backend, dtype):
    x, w, b = randn((67, 130), dtype, 7), randn((90, 130), dtype, 8), randn((90,), dtype, 9)
    reference = F.linear(x.double(), w.double(), b.double())
    assert_close_to_reference(bik.linear(x, w, b), reference, dtype, "linear")
    assert bik.linear(x, w, b).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_transposed_weights(backend, dtype):
    # Odd K and N past one 64-wide panel: every weight layout gives the same bits, because
    # packing a weight only moves values (kernels read W^T's rows and a [K, N] b differently).
    w = randn((150, 162), dtype, 10)
    x = randn((5, 81), dtype, 11)
    strided = w[::2, ::2]  # non-contiguous [75, 81]
    expected = bik.linear(x, strided.contiguous())
    assert_bitwise(bik.linear(x, strided), expected, "strided weight")
    assert_bitwise(bik.matmul(x, strided.t()), expected, "transposed b")
    assert_bitwise(bik.matmul(x, strided.t().contiguous()), expected, "[K, N] b")
    assert_close_to_reference(expected, F.linear(x.double(), strided.double()), dtype, "strided")


def test_fp32_is_ieee_not_tf32(backend):
    # 1 + 2**-20 is rounded to 1 by TF32's 10-bit mantissa but kept by IEEE fp32.
    x = torch.zeros(1, 32, device=randn((1,), torch.float32, 0).device)
    x[0, 0] = 1.0 + 2**-20
    w = torch.ones(32, 16, device=x.device)
    assert bik.matmul(x, w)[0, 0].item() == 1.0 + 2**-20


def test_reruns_are_identical(backend):
    x, w = randn((77, 65), torch.bfloat16, 12), randn((33, 65), torch.bfloat16, 13)
    assert_bitwise(bik.linear(x, w), bik.linear(x, w), "rerun")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(backend, dtype):
    x, w, b = (randn(s, dtype, seed) for s, seed in (((9, 40), 14), ((30, 40), 15), ((30,), 16)))
    grad = randn((9, 30), dtype, 17)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    bik.linear(*leaves).backward(grad)
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b)]
    F.linear(*ref_leaves).backward(grad.double())
    for got, ref, name in zip(leaves, ref_leaves, ("x", "weight", "bias")):
        assert_close_to_reference(got.grad, ref.grad, dtype, f"grad {name}")


def test_backward_is_deterministic(backend):
    x, w = randn((50, 70), torch.float32, 18), randn((40, 70), torch.float32, 19)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        bik.linear(*leaves).sum().backward()
        grads.append([t.grad for t in leaves])
    for first, second in zip(*grads):
        assert_bitwise(first, second, "backward rerun")


def test_empty_inputs(backend):
    w = randn((8, 16), torch.float32, 20)
    assert bik.linear(randn((0, 16), torch.float32, 21), w).shape == (0, 8)
    assert bik.linear(randn((3, 0, 16), torch.float32, 21), w).shape == (3, 0, 8)
    zeros_k = bik.matmul(randn((4, 0), torch.float32, 22), randn((0, 5), torch.float32, 23))
    assert torch.equal(zeros_k, torch.zeros_like(zeros_k))


def test_nan_stays_in_its_row(backend):
    x, w = randn((6, 40), torch.float32, 24), randn((70, 40), torch.float32, 25)
    x[2, 3] = float("nan")
    out = bik.linear(x, w)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4, 5]].isnan().any()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: bik.matmul([1.0], torch.ones(1, 1)), TypeError, "a: expected a torch.Tensor"),
        (lambda: bik.matmul(torch.ones(2, 3), torch.ones(4, 5)), ValueError, "b: expected size 3"),
        (lambda: bik.matmul(torch.ones(2, 3), torch.ones(3)), ValueError, "b: expected 2 dims"),
        (
            lambda: bik.matmul(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float16)),
            TypeError,
            "b: expected dtype torch.float32",
        ),
        (
            lambda: bik.matmul(torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2)),
            TypeError,
            "a: expected dtype float32",
        ),
        (
            lambda: bik.linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(5)),
            ValueError,
            "bias: expected size 4",
        ),
        (
            lambda: bik.linear(torch.ones(2, 3), torch.ones(4, 2)),
            ValueError,
            "weight: expected size 3",
        ),
        (
            lambda: bik.matmul(torch.ones(()), torch.ones(1, 1)),
            ValueError,
            "a: expected at least 1",
        ),
        (
            lambda: bik.matmul(torch.ones(2, 3), torch.ones(3, 2, device="meta")),
            ValueError,
            "b: expected device",
        ),
    ],
)
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_negative_control_plain_torch_depends_on_batch_size():
    # Without this, the invariance tests above could pass for a kernel-agnostic reason.
    weight = randn((1000, 512), torch.float32, 26)
    rows = randn((256, 512), torch.float32, 27)
    alone = F.linear(rows[:1], weight)
    assert any(not torch.equal(F.linear(rows[:m], weight)[:1], alone) for m in (2, 8, 64, 256))
