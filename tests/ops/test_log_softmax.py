"""log_softmax and token_logprobs: batch invariance, accuracy, backward, errors, control."""

import pytest
import torch
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, embed_row, randn
from hypothesis import given
from hypothesis import strategies as st

import bik


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 30),
    vocab=st.integers(1, 9000),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    data=st.data(),
)
def test_row_is_batch_invariant(backend, dtype, rows, vocab, temperature, data):
    position = data.draw(st.integers(0, rows - 1))
    row, others = (
        randn((1, vocab), dtype, 1, scale=4.0),
        randn((rows - 1, vocab), dtype, 2, scale=9.0),
    )
    token = torch.randint(vocab, (1,), generator=torch.Generator().manual_seed(3)).to(row.device)
    batch = embed_row(row, others, position)
    tokens = embed_row(token, torch.zeros(rows - 1, dtype=torch.int64, device=row.device), position)
    assert_bitwise(
        bik.log_softmax(batch)[position : position + 1], bik.log_softmax(row), "log_softmax"
    )
    alone = bik.token_logprobs(row, token, temperature)
    assert_bitwise(
        bik.token_logprobs(batch, tokens, temperature)[position : position + 1],
        alone,
        "token_logprobs",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 1000, 4096, 10000])
def test_accuracy_against_float64(backend, dtype, vocab):
    x = randn((3, 2, vocab), dtype, 4, scale=5.0)
    expected = torch.log_softmax(x.double(), -1)
    assert_close_to_reference(bik.log_softmax(x), expected, dtype, "log_softmax")
    out32 = bik.log_softmax(x, dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert_close_to_reference(out32, expected, torch.float32, "log_softmax fp32 out")
    tokens = torch.randint(vocab, (3, 2), generator=torch.Generator().manual_seed(5)).to(x.device)
    want = torch.log_softmax(x.double() / 0.6, -1).gather(-1, tokens[..., None])[..., 0]
    got = bik.token_logprobs(x, tokens, temperature=0.6)
    assert got.dtype == torch.float32 and got.shape == (3, 2)
    assert_close_to_reference(got, want, torch.float32, "token_logprobs")


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_equals_gathered_log_softmax(backend, dtype):
    # One formula: the token kernel and the full log_softmax agree bit for bit.
    x = randn((7, 5000), dtype, 6, scale=3.0)
    tokens = torch.randint(5000, (7,), generator=torch.Generator().manual_seed(7)).to(x.device)
    full = bik.log_softmax(x, dtype=torch.float32).gather(-1, tokens[:, None])[:, 0]
    assert_bitwise(bik.token_logprobs(x, tokens), full, "token vs gathered")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(backend, dtype):
    x, grad = randn((5, 300), dtype, 8, scale=3.0), randn((5, 300), dtype, 9)
    leaf, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    bik.log_softmax(leaf).backward(grad)
    torch.log_softmax(ref, -1).backward(grad.double())
    assert_close_to_reference(leaf.grad, ref.grad, dtype, "log_softmax grad")

    tokens = torch.arange(5, device=x.device) * 7
    leaf, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    token_grad = randn((5,), torch.float32, 10)
    bik.token_logprobs(leaf, tokens, 0.8).backward(token_grad)
    want = torch.log_softmax(ref / 0.8, -1).gather(-1, tokens[:, None])[:, 0]
    want.backward(token_grad.double())
    assert_close_to_reference(leaf.grad, ref.grad, dtype, "token_logprobs grad")


def test_empty_and_nonfinite(backend):
    assert bik.log_softmax(
        torch.empty(0, 5, device=randn((1,), torch.float32, 0).device)
    ).shape == (0, 5)
    x = randn((5, 40), torch.float32, 11)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4, :20] = float("-inf")
    out, expected = bik.log_softmax(x), torch.log_softmax(x, -1)
    assert torch.equal(out.isnan(), expected.isnan()), (out, expected)
    finite = expected.isfinite()
    assert torch.equal(out.isfinite(), finite)
    assert torch.allclose(out[finite], expected[finite], atol=1e-5)
    assert torch.equal(out[0], bik.log_softmax(x[:1])[0])


def _tokens(*shape, value=0):
    return torch.full(shape, value, dtype=torch.int64)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: bik.log_softmax(torch.ones(2, 3), dim=0), ValueError, "dim: expected the last"),
        (lambda: bik.log_softmax(torch.ones(2, 3), dtype=torch.int32), TypeError, "dtype"),
        (lambda: bik.log_softmax(torch.ones(2, dtype=torch.int64)), TypeError, "x: expected dtype"),
        (
            lambda: bik.token_logprobs(torch.ones(2, 3), _tokens(3)),
            ValueError,
            "tokens: expected shape",
        ),
        (
            lambda: bik.token_logprobs(torch.ones(2, 3), _tokens(2, value=3)),
            ValueError,
            r"tokens: expected values in \[0, 2\] \(ids of the vocabulary",
        ),
        (lambda: bik.token_logprobs(torch.ones(2, 3), _tokens(2, value=-1)), ValueError, "tokens"),
        (
            lambda: bik.token_logprobs(torch.ones(2, 3), torch.zeros(2)),
            TypeError,
            "tokens: expected dtype",
        ),
        (
            lambda: bik.token_logprobs(torch.ones(2, 3), _tokens(2), temperature=0.0),
            ValueError,
            "temperature",
        ),
        (
            lambda: bik.token_logprobs(torch.ones(2, 3), _tokens(2).to("meta")),
            ValueError,
            "tokens: expected device",
        ),
    ],
)
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()
