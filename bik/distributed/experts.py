"""Expert parallelism for a bik-patched mixture-of-experts model: each rank holds whole experts,
and a token's output has the bits it has in one process.

``expert_parallel(model, mesh)`` shards every experts module of a bik-patched model over the E
ranks of a 1-D device mesh: each parameter's expert dim split in E contiguous blocks
(``Shard(0)``; rank r holds experts r·N/E .. (r+1)·N/E − 1). Every rank runs the same batch
and the same routing (the router is replicated), and computes the (token, expert) pairs
routed to its own experts with the same kernels one process runs on them (a pair's row never
depends on the other rows: bik.ops.grouped_linear), in the patched model's order (the
TP-invariant chunks of the down projection with ``tp_invariant=True``). Each rank writes its
pairs' fp32 rows, the others -0.0 (the identity of addition: -0.0 + x = x for every x,
+0.0 included); the ranks' rows are gathered and added in rank order, which gives every row
exactly its owner's value, whichever rank that is and however the gather delivered it. Then
each token's experts are weighed and summed in rank-of-k order in fp32, as in one process.

Every rank must run the same tokens (data parallelism belongs on another mesh dim); under
:func:`bik.distributed.context_parallel`, where each rank holds its own positions, it raises.

Backward: the gather sends nothing back (every rank computes the same loss from the same
combined rows, so the gradient of its own rows is its share of the incoming one); the
experts' input is read through the rank-order gradient sum (each rank's gradient covers
only its own pairs). The gradients are deterministic and equal on every rank; the input's
is summed in other pieces than in one process (not the one-process bits), the experts' own
are their owner's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ..families import FAMILIES
from ..layers.moe import expert_down_partial, expert_hidden, weigh_expert_outputs
from ..ops.grouped_linear import grouped_linear
from .context import active_group
from .sharded import _GatherPartials, _SumGradsInRankOrder, shard_first_dim

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _ExpertParallel(ParallelStyle):
    """Every parameter of an experts module split along its expert dim (``Shard(0)``); the
    module is marked with the mesh's group, which its patched forward reads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            shard_first_dim(submodule, mesh, self.src_data_rank)

        distribute_module(module, device_mesh, shard)
        module._bik_expert_group = device_mesh.get_group()  # type: ignore[assignment]
        return module


def expert_group(module: nn.Module) -> ProcessGroup | None:
    """The process group an experts module was sharded over by :func:`expert_parallel`."""
    return module.__dict__.get("_bik_expert_group")


def expert_parallel_mlp(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    down_chunks: int | None,
    group: ProcessGroup,
) -> torch.Tensor:
    """bik.layers.moe.expert_mlp with ``gate_up``, ``down`` and the biases holding this
    rank's contiguous block of experts (nn.Linear layout): the same bits on every rank as
    expert_mlp on the whole weights in one process (see the module doc)."""
    if active_group() is not None:
        raise NotImplementedError(
            "bik.distributed.expert_parallel: every rank must run the same tokens; under "
            "context_parallel each runs its own positions (keep the experts whole there)"
        )
    local = gate_up.shape[0]
    first = dist.get_rank(group) * local
    pairs = experts.reshape(-1)
    mine = ((pairs >= first) & (pairs < first + local)).nonzero().squeeze(1)
    local_pairs = pairs[mine] - first
    x = _SumGradsInRankOrder.apply(x, group)
    rows = x.repeat_interleave(experts.shape[1], 0)[mine]
    hidden = expert_hidden(rows, local_pairs, 1, gate_up, gate_up_bias, activation)
    if down_chunks is None:
        out = grouped_linear(hidden, down, local_pairs)
    else:
        out = expert_down_partial(hidden, down, local_pairs, down_chunks).to(x.dtype)
    out32 = out.float()  # as expert_mlp: the rounded output, its bias added in fp32
    if down_bias is not None:
        out32 = out32 + down_bias.float()[local_pairs]
    owned = out32.new_full((pairs.shape[0], out32.shape[1]), -0.0).index_put((mine,), out32)
    gathered = _GatherPartials.apply(owned, group)
    total = gathered[0]
    for rank in range(1, gathered.shape[0]):  # rank order; a row's other ranks add -0.0
        total = total + gathered[rank]
    return weigh_expert_outputs(total, pairs, weights).to(x.dtype)


def _check_model(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """The names of ``model``'s experts modules, after the checks (a clear error)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    report = getattr(model, "_bik_patch", None)
    if report is None or family is None or not family.moe:
        raise ValueError(
            "model: expected a mixture-of-experts model patched with bik.patch_model, got "
            f"{'an unpatched ' if report is None else 'a '}{model_type or type(model).__name__!r}"
        )
    if hasattr(model, "_bik_expert_parallel"):
        raise RuntimeError("model: already sharded by bik.distributed.expert_parallel")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(
            f"mesh: expected a 1-D DeviceMesh (the expert-parallel ranks), got {shape}"
        )
    # bik.hf.moe.Experts, marked (bik.hf imports this module)
    names = [
        n
        for n, m in model.named_modules()
        if getattr(vars(m).get("forward"), "shardable_experts", False)
    ]
    degree = mesh.size()
    for name in names:
        count = next(model.get_submodule(name).parameters()).shape[0]
        if count % degree:
            raise ValueError(
                f"mesh: {degree} expert-parallel ranks do not divide {name}'s {count} experts "
                "(each rank holds whole experts)"
            )
    return names


def expert_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard the experts of ``model`` (a mixture-of-experts model patched with
    ``bik.patch_model``) over the ranks of the 1-D ``mesh``, in place; returns it.

    Every rank calls it with the same weights (the shards are taken from the mesh's first
    rank) and then runs the same batches; the logits equal the one-process model's bit for
    bit at every degree dividing the expert count. Compose with :func:`tensor_parallel` on the
    same mesh for attention (expert parallelism first). Refused (ValueError): a dense or
    unpatched model, a mesh that is not 1-D, a degree that does not divide the experts; a
    model sharded already (RuntimeError)."""
    names = _check_model(model, mesh)
    parallelize_module(model, mesh, {name: _ExpertParallel() for name in names})
    model._bik_expert_parallel = mesh.size()  # type: ignore[assignment]  # any value is allowed
    return model
