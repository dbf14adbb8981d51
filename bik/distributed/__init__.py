"""bik across processes: the tensor-parallel-invariant order of a row-parallel layer's K
reduction (``chunked``: ``chunked_linear`` in one process, ``row_parallel_linear`` across
ranks, and the ``rank_partial`` / ``combine_partials`` steps engines run) and the sharded
trainer built on it (``sharded``: ``tensor_parallel(model, mesh)``), with whole experts per
rank for mixture-of-experts models (``experts``: ``expert_parallel(model, mesh)``), and one
sequence split across ranks (``context``: ``context_parallel(model)``).
docs/distributed.md
says what each promises and costs."""

from .chunked import (
    chunked_linear,
    combine_partials,
    per_chunk_partial,
    rank_partial,
    row_parallel_linear,
)
from .context import context_parallel, context_shard
from .experts import expert_parallel
from .sharded import tensor_parallel

__all__ = [
    "chunked_linear",
    "combine_partials",
    "context_parallel",
    "context_shard",
    "expert_parallel",
    "per_chunk_partial",
    "rank_partial",
    "row_parallel_linear",
    "tensor_parallel",
]
