"""Tensor parallelism: the K order of a row-parallel linear, and bik.distributed's prototype.

Plain tensor parallelism sums per-rank K partials, so the bits change with the TP degree
(negative control). ``bik.distributed.chunked_linear`` defines the order in C chunks summed by
a pairwise tree; a TP degree dividing C computes the same tree, so TP 1, 2 and 4 agree, and
``row_parallel_linear`` on 2 gloo ranks gives the single-process chunked result bit for bit.
"""

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise

import bik
from bik.distributed import chunked_linear, row_parallel_linear

DTYPES = [torch.float32, torch.bfloat16]


def _tp_emulation(x, weight, bias, *, chunks, degree):
    """TP degree ``degree`` in one process: each rank's chunked partial of its K slice (fp32),
    the partials tree-summed in rank order, bias added once."""
    per_rank = chunks // degree
    partials = [
        chunked_linear(
            worker.k_slice(x, r, degree).float(),
            worker.k_slice(weight, r, degree).float(),
            chunks=per_rank,
        )
        for r in range(degree)
    ]
    while len(partials) > 1:  # the top of the tree: neighbours pairwise, in rank order
        partials = [partials[i] + partials[i + 1] for i in range(0, len(partials), 2)]
    return (partials[0] + bias.float()).to(x.dtype)


def test_plain_tensor_parallel_order_depends_on_the_degree():
    """Negative control: one bik.linear over all of K (TP 1) vs two K halves summed (TP 2)."""
    x, weight, bias = worker.tp_inputs(torch.float32)
    halves = sum(bik.linear(worker.k_slice(x, r, 2), worker.k_slice(weight, r, 2)) for r in (0, 1))
    assert not torch.equal(bik.linear(x, weight, bias), halves + bias)


def test_one_chunk_is_bik_linear():
    x, weight, bias = worker.tp_inputs(torch.float32)
    assert_bitwise(chunked_linear(x, weight, bias, chunks=1), bik.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_chunked_order_is_the_same_at_every_tp_degree(dtype):
    x, weight, bias = worker.tp_inputs(dtype)
    expected = chunked_linear(x, weight, bias, chunks=4)
    for degree in (1, 2, 4):
        got = _tp_emulation(x, weight, bias, chunks=4, degree=degree)
        assert_bitwise(got, expected, f"TP degree {degree}")
    # A different number of chunks is a different order (in bf16 the final rounding happens to
    # hide it for these inputs).
    if dtype == torch.float32:
        assert not torch.equal(chunked_linear(x, weight, bias, chunks=2), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_chunked_linear_is_accurate_and_row_invariant(dtype):
    x, weight, bias = worker.tp_inputs(dtype)
    out = chunked_linear(x, weight, bias, chunks=4)
    ref = x.double() @ weight.double().T + bias.double()
    tol = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 1.6e-2)}[dtype]
    assert out.dtype == dtype
    assert ((out.double() - ref).abs() <= tol[0] + tol[1] * ref.abs()).all()
    for row in range(x.shape[0]):
        alone = chunked_linear(x[row : row + 1], weight, bias, chunks=4)
        assert_bitwise(alone, out[row : row + 1], f"row {row}")


def test_bad_arguments():
    x, weight, bias = worker.tp_inputs(torch.float32)
    for chunks in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match="chunks"):
            chunked_linear(x, weight, chunks=chunks)
    with pytest.raises(ValueError, match="not divisible"):
        chunked_linear(x[:, :250], weight[:, :250], chunks=4)
    with pytest.raises(ValueError, match="weight"):
        chunked_linear(x, weight[:, :128], chunks=2)
    with pytest.raises(TypeError, match="bias"):
        chunked_linear(x, weight, bias.double(), chunks=2)
    with pytest.raises(ValueError, match="bias"):
        chunked_linear(x, weight, bias[:5], chunks=2)
    with pytest.raises(TypeError, match="x_shard"):
        row_parallel_linear(x.long(), weight)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each of 2 gloo ranks computed (distributed_worker.run_tp_rank)."""
    return worker.spawn_tp(2, str(tmp_path_factory.mktemp("tp")))


def test_row_parallel_linear_on_two_ranks(results):
    for dtype in DTYPES:
        x, weight, bias = worker.tp_inputs(dtype)
        for per_rank in (1, 2):
            expected = chunked_linear(x, weight, bias, chunks=2 * per_rank)
            for rank, result in enumerate(results):
                got = result[dtype, per_rank]
                assert_bitwise(got, expected, f"{dtype} rank {rank}, {per_rank} chunk(s) each")
    # Plain TP at degree 2 (the all-reduce of two partials) already is the 2-chunk order, not
    # the single-process one: its bits change with the degree.
    x, weight, bias = worker.tp_inputs(torch.float32)
    for result in results:
        assert_bitwise(result["plain"], chunked_linear(x, weight, bias, chunks=2), "plain TP")
        assert not torch.equal(result["plain"], bik.linear(x, weight, bias))


def test_row_parallel_linear_refuses_ranks_that_disagree(results):
    """Issue 25, item 8: ranks with other chunks_per_rank summed partials of different trees
    (a result equal to no chunked_linear); other row counts aborted one rank and left the
    other with uninitialised gather buffers. Every rank now raises, naming each rank's value."""
    for result in results:
        assert result["disagree", "chunks_per_rank"] == (
            "row_parallel_linear: every rank must pass the same chunks_per_rank, got "
            "rank 0: 1, rank 1: 2"
        )
        assert result["disagree", "rows"] == (
            "row_parallel_linear: every rank must pass the same x_shard shape, got "
            "rank 0: (6, 128), rank 1: (5, 128)"
        )


def test_row_parallel_linear_refuses_inputs_that_need_gradients():
    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="row_parallel_linear: forward only"):
        row_parallel_linear(x, w)
