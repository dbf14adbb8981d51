"""Tensor parallelism: the K order of a row-parallel linear, and the trainer that uses it.

Plain tensor parallelism sums per-rank K partials, so the bits change with the TP degree
(negative control). ``bik.distributed.chunked_linear`` defines the order in C chunks summed by
a pairwise tree; a TP degree dividing C computes the same tree, so TP 1, 2, 4 and 8 agree, and
``row_parallel_linear`` on 2 gloo ranks gives the single-process chunked result bit for bit.
``bik.patch_model(model, tp_invariant=True)`` runs that order in a model's row-parallel
linears: its logits equal those of the model with every row-parallel linear computed as TP 2,
4 or 8 ranks would (emulated in one process). vLLM at TP 2: tests/integrations/test_vllm_tp.py;
the trainer sharded by bik.distributed.tensor_parallel: tests/integrations/test_tensor_parallel.py.
"""

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise, randn
from hypothesis import given
from hypothesis import strategies as st

import bik
from bik import backends
from bik.contract import TP_CHUNKS
from bik.distributed import (
    chunked_linear,
    combine_partials,
    per_chunk_partial,
    rank_partial,
    row_parallel_linear,
)
from bik.families import FAMILIES, ROW_PARALLEL_NAMES

DTYPES = [torch.float32, torch.bfloat16]


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    m=st.integers(1, 9),
    n=st.integers(1, 70),
    k_per_chunk=st.integers(1, 20),
    bias=st.booleans(),
)
def test_every_tp_degree_gives_the_contract_order(backend, dtype, m, n, k_per_chunk, bias):
    """Random shapes (K = TP_CHUNKS x 1..20 crosses the CPU kernel's 16-lane tails): TP 1, 2,
    4 and 8 emulated give chunked_linear's bits, and a row alone gives its row in the batch,
    on every backend (triton's 16-bit chunks: its tensor-core kernel)."""
    k = TP_CHUNKS * k_per_chunk
    x, weight = randn((m, k), dtype, seed=1), randn((n, k), dtype, seed=2)
    b = randn((n,), dtype, seed=3) if bias else None
    expected = chunked_linear(x, weight, b)
    for degree in (1, 2, 4, 8):
        got = worker.tp_emulation(x, weight, b, chunks=TP_CHUNKS, degree=degree)
        assert_bitwise(got, expected, f"TP degree {degree}")
    assert_bitwise(chunked_linear(x[-1:], weight, b), expected[-1:], "row alone")


def _per_chunk(x, weight, chunks):
    """rank_partial's definition: a bik.linear of the fp32 casts per chunk, tree-summed."""
    step = x.shape[-1] // chunks
    parts = [
        bik.linear(
            x[:, i * step : (i + 1) * step].float(), weight[:, i * step : (i + 1) * step].float()
        )
        for i in range(chunks)
    ]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    m=st.integers(1, 110),
    n=st.integers(1, 140),
    chunks=st.sampled_from([1, 2, 4, 8]),
    k_per_chunk=st.integers(1, 40),
    strided=st.booleans(),
)
def test_the_one_call_chunked_kernel_is_the_per_chunk_order(
    dtype, m, n, chunks, k_per_chunk, strided
):
    """The cpu backend's chunked kernel (one call, inputs read in their dtype) against the
    per-chunk bik.linear calls it replaces: random shapes cross the row blocks (6), the row
    chunk (96), the 64-column panels and the 16-deep packing tiles; x may be a strided view."""
    k = chunks * k_per_chunk
    x, weight = randn((m, 2 * k if strided else k), dtype, seed=1), randn((n, k), dtype, seed=2)
    x = x[:, ::2] if strided else x
    if backends.resolve(x.device).chunked_matmul is None:
        pytest.skip(f"the {backends.resolve(x.device).name} backend has no chunked kernel")
    assert_bitwise(rank_partial(x, weight, chunks), _per_chunk(x, weight, chunks))


def test_under_autograd_rank_partial_runs_per_chunk_with_the_same_bits():
    x, weight = randn((5, 64), torch.bfloat16, seed=1), randn((24, 64), torch.bfloat16, seed=2)
    inference = rank_partial(x, weight, TP_CHUNKS)
    recorded = rank_partial(x.clone().requires_grad_(), weight, TP_CHUNKS)
    assert recorded.requires_grad
    assert_bitwise(recorded.detach(), inference)


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
        got = worker.tp_emulation(x, weight, bias, chunks=4, degree=degree)
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
        # Issue 42, item 4: a bias of the same shape but other values gave each rank its own
        # output.
        assert result["disagree", "bias values"].startswith(
            "row_parallel_linear: every rank must pass the same bias values, got rank 0: "
        )


def test_rank_partial_and_combine_partials_check_their_arguments():
    """Issue 42, item 4: chunks=0 killed the process (SIGFPE), another K read out of bounds,
    chunks=3 returned a wrong sum; combine_partials took 3 partials, broadcast mismatched
    shapes and recursed on an empty list."""
    x, weight, bias = worker.tp_inputs(torch.float32)
    for chunks, match in ((0, "positive int"), (3, "power of two"), (512, "not divisible")):
        with pytest.raises(ValueError, match=f"^chunks: .*{match}"):
            rank_partial(x, weight, chunks)
        with pytest.raises(ValueError, match=f"^chunks: .*{match}"):
            per_chunk_partial(x, weight, chunks)
    with pytest.raises(ValueError, match=r"^weight: .*K, the last dim of x"):
        rank_partial(x, weight[:, :128], 2)
    with pytest.raises(TypeError, match=r"^x: "):
        rank_partial(x.long(), weight, 2)
    partial = rank_partial(x, weight, 2)
    assert_bitwise(
        combine_partials([partial], bias, x.dtype), chunked_linear(x, weight, bias, chunks=2)
    )
    for partials, error, match in (
        ([], ValueError, r"^partials: expected a non-empty list"),
        ([partial] * 3, ValueError, r"^partials: expected a power-of-two count"),
        ([partial, partial[:, :1]], ValueError, r"^partials\[1\]: expected the shape"),
        ([partial, partial.bfloat16()], TypeError, r"^partials\[1\]: expected an fp32 tensor"),
    ):
        with pytest.raises(error, match=match):
            combine_partials(partials, None, x.dtype)
    with pytest.raises(ValueError, match=r"^bias: .*N, the last dim of the partials"):
        combine_partials([partial], bias[:5], x.dtype)
    with pytest.raises(TypeError, match=r"^dtype: expected a floating torch\.dtype"):
        combine_partials([partial], None, torch.int32)


def test_row_parallel_linear_refuses_inputs_that_need_gradients():
    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="row_parallel_linear: forward only"):
        row_parallel_linear(x, w)


def _tiny_model(dtype=torch.float32, family="qwen3", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = FAMILIES[family].tiny_config(**overrides)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _emulate_tp(model, degree):
    """Every row-parallel linear of a patched ``model`` computed as ``degree`` TP ranks would
    (each rank's K slice in TP_CHUNKS / degree chunks, partials summed in rank order)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROW_PARALLEL_NAMES:
            module.forward = lambda x, m=module: worker.tp_emulation(
                x, m.weight, m.bias, chunks=TP_CHUNKS, degree=degree
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tp_invariant_model_equals_every_tp_degree(dtype):
    ids = torch.randint(3, 256, (3, 21), generator=torch.Generator().manual_seed(0))
    model = _tiny_model(dtype)
    report = bik.patch_model(model, backend="cpu", tp_invariant=True)
    chunked = [name for name, kind in report.patched.items() if "chunked_linear" in kind]
    assert report.tp_invariant and len(chunked) == 4  # o_proj and down_proj of 2 layers
    assert all(name.rsplit(".", 1)[-1] in ROW_PARALLEL_NAMES for name in chunked)
    with torch.no_grad():
        expected = model(ids).logits
        assert_bitwise(model(ids[1:2]).logits, expected[1:2], "a row alone")
        for degree in (2, 4, 8):
            twin = _tiny_model(dtype)
            bik.patch_model(twin, backend="cpu", tp_invariant=True)
            _emulate_tp(twin, degree)
            assert_bitwise(twin(ids).logits, expected, f"TP degree {degree}")
        if dtype == torch.float32:  # in bf16 the tiny model's roundings may hide it
            # Negative control: bik's default order (one chain over K) gives other logits.
            bik.unpatch_model(model)
            bik.patch_model(model, backend="cpu")
            assert not torch.equal(model(ids).logits, expected)


def _emulate_moe_tp(model, degree):
    """``_emulate_tp``, and every experts module's down projection as ``degree`` TP ranks
    would compute it (each rank its intermediate slice's TP_CHUNKS / degree chunks)."""
    _emulate_tp(model, degree)
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.forward = lambda x, experts, weights, m=module: worker.moe_tp_emulation(
                x, experts, weights, m.gate_up_proj, m.down_proj, degree=degree
            )


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tp_invariant_moe_model_equals_every_tp_degree(family, dtype):
    """A mixture-of-experts model patched with tp_invariant: the experts' down projections
    run in the TP-invariant order too (vLLM splits them along the intermediate size), so the
    logits equal those of the model whose experts and row-parallel linears are computed as
    TP 2, 4 and 8 ranks would; the plain grouped down projection gives other logits."""
    ids = torch.randint(3, 256, (3, 13), generator=torch.Generator().manual_seed(0))
    model = _tiny_model(dtype, family)
    report = bik.patch_model(model, backend="cpu", tp_invariant=True)
    experts = [name for name in report.patched if name.endswith("mlp.experts")]
    assert experts and all("down projection in" in report.patched[name] for name in experts)
    with torch.no_grad():
        expected = model(ids).logits
        assert_bitwise(model(ids[1:2]).logits, expected[1:2], "a row alone")
        for degree in (2, 4, 8):
            twin = _tiny_model(dtype, family)
            bik.patch_model(twin, backend="cpu", tp_invariant=True)
            _emulate_moe_tp(twin, degree)
            assert_bitwise(twin(ids).logits, expected, f"TP degree {degree}")
        if dtype == torch.float32:
            # Negative control: the experts' down projection as one grouped linear.
            for name in experts:
                model.get_submodule(name).forward.down_chunks = None
            assert not torch.equal(model(ids).logits, expected)


def test_tp_invariant_backward_is_deterministic():
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for _ in range(2):
        model = _tiny_model()
        bik.patch_model(model, backend="cpu", tp_invariant=True)
        model(ids).logits.float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(g is not None for g in grads[0])
    for first, second in zip(*grads):
        assert_bitwise(first, second, "gradient rerun")


def test_tp_invariant_bad_arguments():
    with pytest.raises(TypeError, match=r"^tp_invariant: expected a bool, got 'yes'$"):
        bik.patch_model(_tiny_model(), tp_invariant="yes")
    with pytest.raises(ValueError, match=r"down_proj has K = 100 input features, not divisible by"):
        bik.patch_model(_tiny_model(intermediate_size=100), tp_invariant=True)
    with pytest.raises(ValueError, match=r"mlp.experts has K = 36 input features, not divisible"):
        bik.patch_model(
            _tiny_model(family="qwen3_moe", moe_intermediate_size=36), tp_invariant=True
        )
