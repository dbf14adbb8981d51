"""The TP-invariant order's steps across vLLM's tensor-parallel ranks (bik.distributed.chunked
computes the same order in one process): a rank's fp32 partial of its K slice, the ranks'
partials gathered exactly and summed in rank order by the top of the tree."""

from typing import Any

import torch
from vllm.distributed import get_ep_group, get_tp_group
from vllm.model_executor.layers.linear import RowParallelLinear

from ..contract import TP_CHUNKS
from ..distributed import combine_partials, rank_partial


def gather_tp_ranks(tp_size: int, t: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's ``t``, in rank order (exact copies)."""
    return _gather(get_tp_group(), tp_size, t)


def gather_ep_ranks(ep_size: int, t: torch.Tensor) -> list[torch.Tensor]:
    """Every expert-parallel rank's ``t``, in rank order (exact copies)."""
    return _gather(get_ep_group(), ep_size, t)


def _gather(group: Any, size: int, t: torch.Tensor) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    return list(group.all_gather(t.contiguous(), dim=0).chunk(size, dim=0))


def row_parallel_in_order(layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer`` of this rank's K slice ``x`` in the TP-invariant order: this rank's subtree
    of ``TP_CHUNKS / T`` chunks in fp32, the ranks' partials gathered and tree-summed in rank
    order, the full bias added once (unless the layer skips it), one rounding (check_model
    checks the divisibility). Every rank gets the whole sum, whatever ``reduce_results``
    says: a mixture-of-experts layer's shared expert (reduce_results=False) is summed here."""
    partials = gather_tp_ranks(
        layer.tp_size, rank_partial(x, layer.weight, TP_CHUNKS // layer.tp_size)
    )
    return combine_partials(partials, None if layer.skip_bias_add else layer.bias, x.dtype)
