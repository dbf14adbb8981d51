"""The tensor-parallel-invariant linear: a row-parallel layer's K reduction defined in chunks.

A row-parallel linear (the attention output and MLP down projections under tensor
parallelism) splits K across the TP ranks: each rank reduces its slice of K and an all-reduce
sums the partials. Its bits then depend on the TP degree, because the sum has a different
shape for every degree. They stop depending on it when the order is defined for a fixed
number of chunks C (the largest TP degree to support) instead:

  * K is cut into C equal, contiguous chunks; each chunk is one chain from zero into fp32,
    never rounded to 16 bits (the backend's fp32 matmul order on the exact fp32 casts; the
    triton backend's tensor-core chain on 16-bit inputs as they are);
  * the C chunk partials are summed by a balanced pairwise tree (chunks 0..C/2-1 on the left),
    then the bias is added and the result rounded once to the input dtype.

With C and the TP degree T powers of two, rank r holds chunks r*C/T ... (r+1)*C/T - 1, which is
exactly one subtree: the rank computes its subtree locally (``chunked_linear`` of its K slice
with C/T chunks) and the ranks' partials are summed by the top T leaves of the same tree, in
rank order. T = 1, 2, 4 ... C then give the same bits. ``row_parallel_linear`` does this across
processes by gathering the fp32 partials and summing them in that order on every rank (an
all-reduce does not promise an order for more than two ranks). C is ``bik.contract.TP_CHUNKS``
unless a caller fixes another. ``bik.patch_model(model, tp_invariant=True)`` runs
``chunked_linear`` in a model's row-parallel layers and ``bik.vllm`` runs ``rank_partial`` and
``combine_partials`` in vLLM's. See docs/design.md, "Across processes", for what this costs.

``row_parallel_linear`` is forward only: the gather is not differentiated. The sharded
trainer, ``tensor_parallel(model, mesh)`` (bik/distributed/sharded.py), runs ``rank_partial``
and ``combine_partials`` in a model's row-parallel layers, forward and backward.
"""

import hashlib

import torch
import torch.distributed as dist

from .. import _checks, backends
from ..contract import TP_CHUNKS, tp_tree_sum
from ..ops._dispatch import as_rows, custom_op, run, shaped
from ..ops.matmul import linear, matmul


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape and dtype on all ranks), in rank order."""
    t = t.contiguous()
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    return gathered


def _check_chunked_operands(x: torch.Tensor, weight: torch.Tensor, chunks: int) -> None:
    _check_operands("x", x, "weight", weight, None, "K, the last dim of x")
    _checks.chunk_count("chunks", chunks, x.shape[-1])


def _check_partials(partials: list[torch.Tensor]) -> None:
    if not isinstance(partials, (list, tuple)) or not partials:
        raise ValueError(
            f"partials: expected a non-empty list of the ranks' partials, got {partials!r}"
        )
    count = len(partials)
    if count & (count - 1):
        raise ValueError(f"partials: expected a power-of-two count (one per rank), got {count}")
    for rank, partial in enumerate(partials):
        name = f"partials[{rank}]"
        if not isinstance(partial, torch.Tensor) or partial.dtype != torch.float32:
            raise TypeError(f"{name}: expected an fp32 tensor (rank_partial's), got {partial!r}")
        if partial.shape != partials[0].shape:
            raise ValueError(
                f"{name}: expected the shape of partials[0], {tuple(partials[0].shape)}, got "
                f"{tuple(partial.shape)}"
            )


def _check_operands(
    x_name: str,
    x: torch.Tensor,
    w_name: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k_what: str,
) -> None:
    _checks.floating(x_name, x)
    _checks.floating(w_name, weight)
    _checks.rank(w_name, weight, 2)
    _checks.same_dtype(w_name, weight, x_name, x)
    _checks.dim_size(w_name, weight, 1, x.shape[-1], k_what)
    _check_bias(bias, x, weight.shape[0])


def _check_bias(bias: torch.Tensor | None, x: torch.Tensor, n: int) -> None:
    if bias is not None:
        _checks.floating("bias", bias)
        _checks.rank("bias", bias, 1)
        _checks.same_dtype("bias", bias, "x", x)
        _checks.dim_size("bias", bias, 0, n, "N, the first dim of weight")


def _digest(t: torch.Tensor) -> str:
    """A SHA-256 of ``t``'s bytes: ranks compare values without sending them."""
    raw = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _check_ranks_agree(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None,
    chunks_per_rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Every rank must call with the same layout: other chunk counts would sum partials of
    different trees (a result equal to no chunked_linear), other shapes would gather into
    buffers of the wrong size, another bias would make the ranks' outputs differ. One small
    all_gather_object compares them (the bias by a digest of its bytes); every rank raises the
    same ValueError, naming each rank's values."""
    layout = {
        "chunks_per_rank": chunks_per_rank,
        "x_shard shape": tuple(x_shard.shape),
        "weight_shard shape": tuple(weight_shard.shape),
        "dtype": str(x_shard.dtype),
        "bias": None if bias is None else tuple(bias.shape),
        "bias values": None if bias is None else _digest(bias),
    }
    layouts: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, layout, group=group)
    for key in layout:
        values = [entry[key] for entry in layouts if entry is not None]
        if any(value != values[0] for value in values):
            raise ValueError(
                f"row_parallel_linear: every rank must pass the same {key}, got "
                + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            )


def rank_partial(x: torch.Tensor, weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """The fp32 tree sum of ``chunks`` chunk products of ``x [..., K] @ weight[N, K].T``: one
    rank's subtree (``chunks`` = C / T, a power of two dividing K).

    A backend with a chunked kernel (cpu, triton) computes it in one call, reading x and the
    weight in their dtype, forward and backward alike (the custom op ``bik::chunked_matmul``
    when a graph is recorded); other backends run :func:`per_chunk_partial`."""
    _check_chunked_operands(x, weight, chunks)
    if backends.resolve(x.device, "matmul").chunked_matmul is None:
        return per_chunk_partial(x, weight, chunks)
    return run(_chunked_op, _chunked_product, x, weight, chunks)


def _chunked_product(x: torch.Tensor, weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """Validated :func:`rank_partial` through the backend's chunked kernel."""
    n = weight.shape[0]
    rows = as_rows(x)
    if rows.shape[0] == 0 or n == 0:
        return x.new_zeros(*x.shape[:-1], n, dtype=torch.float32)
    kernel = backends.resolve(x.device, "matmul").chunked_matmul
    assert kernel is not None  # rank_partial sends only backends that have one
    return shaped(kernel(rows, weight.t(), chunks), (*x.shape[:-1], n))


_chunked_op = custom_op("bik::chunked_matmul", _chunked_product, row_args=(0,))


@_chunked_op.register_fake
def _(x, weight, chunks):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    # The chunks cut K, so each gradient entry lies in one chunk: the gradients are those of
    # the per-chunk composition, one bik matmul each on the fp32 casts, reduced over the
    # output features (x) or the rows (weight) in that matmul's order.
    x, weight = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul(grad, weight.float()).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_weight = matmul(as_rows(grad).t(), as_rows(x).float()).to(weight.dtype)
    return grad_x, grad_weight, None


_chunked_op.register_autograd(_backward, setup_context=_setup_context)


def per_chunk_partial(x: torch.Tensor, weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """:func:`rank_partial` as one bik.linear per chunk on the fp32 casts, tree-summed here:
    differentiable, and the path of backends without a chunked kernel."""
    _check_chunked_operands(x, weight, chunks)
    step = x.shape[-1] // chunks
    x32, w32 = x.float(), weight.float()  # exact casts: the order is the fp32 kernel's
    parts = [
        linear(x32[..., i * step : (i + 1) * step], w32[:, i * step : (i + 1) * step])
        for i in range(chunks)
    ]
    return tp_tree_sum(parts)


def combine_partials(
    partials: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The ranks' fp32 partials (in rank order, a power-of-two count, one shape) summed by the
    top of the tree, the bias added in fp32, one rounding to ``dtype``."""
    _check_partials(partials)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    if bias is not None:
        _checks.floating("bias", bias)
        _checks.rank("bias", bias, 1)
        _checks.dim_size("bias", bias, 0, partials[0].shape[-1], "N, the last dim of the partials")
    total = tp_tree_sum(partials)
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype)


def chunked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunks: int = TP_CHUNKS,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with K reduced in ``chunks`` equal chunks, tree-summed.

    The single-process form of the order ``row_parallel_linear`` computes at any TP degree
    that divides ``chunks``. ``chunks`` must be a power of two dividing K. Rows stay
    independent (each chunk is a batch-invariant bik matmul). fp32 gives IEEE fp32 results;
    bf16/fp16 inputs return their dtype after one rounding of the fp32 sum. Differentiable
    (bik.linear's backward on each chunk).
    """
    _check_operands("x", x, "weight", weight, bias, "K, the last dim of x")
    _checks.chunk_count("chunks", chunks, x.shape[-1])
    return combine_partials([rank_partial(x, weight, chunks)], bias, x.dtype)


def row_parallel_linear(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunks_per_rank: int = 1,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """A row-parallel linear whose bits equal ``chunked_linear(x, weight, bias,
    chunks=world * chunks_per_rank)`` on the unsplit tensors.

    Rank r passes its contiguous K slice: ``x[..., r*Ks:(r+1)*Ks]`` and
    ``weight[:, r*Ks:(r+1)*Ks]`` with Ks = K / world. The fp32 partials are all-gathered and
    summed in rank order by the tree, then the bias (the full bias, on every rank) is added
    once. Every rank returns the same full output. The world size must be a power of two.
    The ranks' ``chunks_per_rank``, shapes, dtype and bias are compared first (one small
    ``all_gather_object``): a disagreement raises ValueError on every rank. Forward only.
    """
    _check_operands("x_shard", x_shard, "weight_shard", weight_shard, bias, "the K slice of x")
    _checks.chunk_count("chunks_per_rank", chunks_per_rank, x_shard.shape[-1])
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_shard, weight_shard, bias)
    ):  # all_gather records no graph: gradients would silently be missing
        raise RuntimeError(
            "row_parallel_linear: forward only; call it under torch.no_grad() or with inputs "
            "that do not require grad"
        )
    world = dist.get_world_size(group)
    if world & (world - 1):
        raise ValueError(f"group: expected a power-of-two world size, got {world}")
    _check_ranks_agree(x_shard, weight_shard, bias, chunks_per_rank, group)
    partial = rank_partial(x_shard, weight_shard, chunks_per_rank)
    return combine_partials(_all_gather(partial, group), bias, x_shard.dtype)
