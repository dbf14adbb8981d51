"""The triton backend's TP-invariant chunked matmul (``chunked_matmul``): every chunk's
tensor-core chain and the whole pairwise tree in one launch for 16-bit inputs (at decode, a
program per chunk and a plane tree: the same bits), the per-chunk composition's bits for fp32.

A row alone gives its row in any batch (tails of the 64-row tile included); the decode form
(planes) gives the in-register form's bits; the result is close to float64; the autograd path
(the custom op) gives the inference bits and the per-chunk composition's gradients. Negative
control: another chunk count is another order. TP degrees 1, 2, 4 and 8 give chunked_linear's
bits on every backend: tests/integrations/test_distributed_tp.py. Interpreted on the CPU,
compiled on a GPU (where the bits are the tensor cores'); the sm_90a binary:
tests/backends/test_sm90.py.
"""

import importlib

import pytest
import torch
from conftest import invariant_backends
from helpers import assert_bitwise, assert_close_to_reference, embed_row, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik.contract import TP_CHUNKS
from bik.distributed import per_chunk_partial, rank_partial

if "triton" not in invariant_backends():
    pytest.skip("the triton backend cannot run here", allow_module_level=True)

chunked = importlib.import_module("bik.backends.triton.chunked")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _triton():
    with bik.use_backend("triton"):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_alone_gives_its_row_in_any_batch(dtype):
    """Rows before, inside and past the first 64-row tile (its tail)."""
    k, n = TP_CHUNKS * 24, 72
    weight = randn((n, k), dtype, seed=2)
    row, others = randn((1, k), dtype, seed=4), randn((99, k), dtype, seed=5)
    alone = rank_partial(row, weight, TP_CHUNKS)
    for position in (0, 63, 64, 99):
        batched = rank_partial(embed_row(row, others, position), weight, TP_CHUNKS)
        assert_bitwise(batched[position : position + 1], alone, f"row {position}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_close_to_float64(dtype):
    x, weight = randn((7, TP_CHUNKS * 33), dtype, seed=1), randn((40, TP_CHUNKS * 33), dtype, 2)
    reference = x.double() @ weight.double().t()
    assert_close_to_reference(rank_partial(x, weight, TP_CHUNKS), reference, torch.float32)


@settings(max_examples=8)
@given(
    chunks=st.sampled_from([1, 2, 4, 8]),
    m=st.integers(1, 70),
    k_per_chunk=st.integers(1, 30),
    strided=st.booleans(),
)
def test_fp32_is_the_per_chunk_composition(chunks, m, k_per_chunk, strided):
    """fp32: one tile-kernel matmul per chunk (what every backend's fp32 chunk is)."""
    k = chunks * k_per_chunk
    x = randn((m, 2 * k if strided else k), torch.float32, seed=1)
    x = x[:, ::2] if strided else x
    weight = randn((33, k), torch.float32, seed=2)
    assert_bitwise(rank_partial(x, weight, chunks), per_chunk_partial(x, weight, chunks))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_autograd_runs_the_same_kernel_and_the_composition_gradients(dtype):
    x, weight = randn((5, TP_CHUNKS * 16), dtype, seed=1), randn((24, TP_CHUNKS * 16), dtype, 2)
    inference = rank_partial(x, weight, TP_CHUNKS)
    grad = randn((5, 24), torch.float32, seed=3)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    recorded = rank_partial(*leaves, TP_CHUNKS)
    assert_bitwise(recorded.detach(), inference, "forward under autograd")
    recorded.backward(grad)
    composed = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    per_chunk_partial(*composed, TP_CHUNKS).backward(grad)
    for name, got, want in zip(("x", "weight"), leaves, composed):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad), f"grad of {name}"


@settings(max_examples=8)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    m=st.integers(1, 130),
    n=st.integers(1, 140),
    k_per_chunk=st.integers(1, 40),
    chunks=st.sampled_from([1, 2, 4, 8]),
)
def test_decode_planes_give_the_in_register_trees_bits(dtype, m, n, k_per_chunk, chunks):
    """Few output tiles (decode) run a program per chunk into planes and a plane tree; more
    run each tile's chunks in turn: the same bits, so the row count may pick either."""
    k = chunks * k_per_chunk
    a, weight = randn((m, k), dtype, seed=1), randn((n, k), dtype, seed=2)
    planes = chunked.chunked_matmul(a, weight.t(), chunks, planes=True)
    assert_bitwise(planes, chunked.chunked_matmul(a, weight.t(), chunks, planes=False))


def test_another_chunk_count_is_another_order():
    """Negative control: the chunks are part of the order (8 vs 4 chunks of the same K)."""
    x, weight = randn((16, 512), torch.bfloat16, seed=1), randn((64, 512), torch.bfloat16, 2)
    assert not torch.equal(rank_partial(x, weight, 8), rank_partial(x, weight, 4))


def test_more_chunks_than_the_kernel_takes_are_refused():
    x, weight = randn((2, 64), torch.bfloat16, seed=1), randn((8, 64), torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match=f"^chunks: .* up to {chunked.MAX_CHUNKS}, got 16"):
        rank_partial(x, weight, 16)
