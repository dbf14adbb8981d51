"""A bik-patched Hugging Face model sharded Megatron-style, with bik's order in every split.

``tensor_parallel(model, mesh)`` shards a model patched with ``tp_invariant=True`` over the
T ranks of a 1-D device mesh with torch's tensor-parallel API (``parallelize_module`` and
bik's ``ParallelStyle`` s below):

* column-parallel (q/k/v, gate/up): weight and bias rows split in T contiguous blocks
  (``Shard(0)``). Each output element is one bik matmul over the whole of K, which no other
  column changes, so rank r's output is columns r·N/T .. (r+1)·N/T − 1 of the one-process
  output, bit for bit. A rank's columns are whole heads (``num_heads`` / T query heads,
  ``num_kv_heads`` / T KV heads); the supported families reshape with -1, so attention runs
  on the local heads unchanged.
* row-parallel (o_proj, down_proj): the weight's K split (``Shard(1)``), the bias replicated.
  Rank r owns chunks r·C/T .. (r+1)·C/T − 1 of the TP-invariant order (C =
  ``bik.contract.TP_CHUNKS``): it reduces that subtree (``rank_partial``), the T fp32 partials
  are all-gathered and every rank sums them in rank order by the top of the same tree
  (``combine_partials``): the one-process ``chunked_linear`` bits. Never an all-reduce.
* everything else (embedding, RMSNorms, LM head) stays replicated: plain tensors, the same
  computation on every rank, exact. A replicated weight between the split layers (Qwen3's
  per-head q/k RMSNorm) is applied to this rank's heads only.

Every rank must run the same batch: the activations between the split layers are replicated.
Backward: the partials' gather sends nothing back (every rank computes the same loss from the
same replicated output, so the gradient of its own partial is its own incoming gradient); the
gradients that each rank computes only a share of (a column-parallel layer's input, a q/k norm
weight) are gathered and summed in rank order by the pairwise tree (Megatron's all-reduce, in
a fixed order). The gradients are then deterministic and equal on every rank; they are not
the one-process bits (those sums run in other pieces). FSDP2 composes on a 2-D mesh: TP over
one dim, ``fully_shard`` over the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ..contract import TP_CHUNKS, tp_tree_sum
from ..families import COLUMN_PARALLEL_NAMES, FAMILIES, ROW_PARALLEL_NAMES
from .chunked import _all_gather, combine_partials, rank_partial

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Dense families whose layers cannot be split into whole heads and whole MLP columns.
_UNSPLITTABLE = {
    "phi3": "its fused qkv_proj and gate_up_proj interleave q, k and v (and gate and up) "
    "along N, so a contiguous block of rows is not whole heads",
    "olmo2": "its q/k RMSNorm reduces over all heads of the projection, which no rank holds",
}


def _sum_over_ranks(grad: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The ranks' parts of a gradient summed in rank order by the pairwise tree, in fp32,
    rounded once: every rank gets the same bits (an all-reduce's order is the library's)."""
    return tp_tree_sum(_all_gather(grad.float(), group)).to(grad.dtype)


class _SumGradsInRankOrder(torch.autograd.Function):
    """Identity forward on a tensor every rank holds whole (a column-parallel layer's input, a
    q/k norm's weight). Backward: each rank's gradient covers only its own columns or heads,
    so the ranks' gradients are summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum_over_ranks(grad, ctx.group), None


class _GatherPartials(torch.autograd.Function):
    """The ranks' fp32 partials of a row-parallel layer, stacked in rank order. Backward sends
    nothing: every rank sums the same partials into the same output and computes the same loss
    from it, so the gradient of this rank's partial is its own slice of the incoming one."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        return torch.stack(_all_gather(partial, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


def row_parallel_shard(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group: ProcessGroup,
) -> torch.Tensor:
    """This rank's K slice of a row-parallel linear -> the full output, equal on every rank to
    ``chunked_linear`` of the unsplit operands (TP_CHUNKS chunks). Differentiable. The
    operands were checked when the model was sharded."""
    partial = rank_partial(x_shard, weight_shard, TP_CHUNKS // dist.get_world_size(group))
    partials = _GatherPartials.apply(partial, group)
    return combine_partials(list(partials.unbind(0)), bias, x_shard.dtype)


def local_weight(module: nn.Module, name: str = "weight") -> torch.Tensor | None:
    """The parameter ``name`` of ``module`` as this rank computes with it: a DTensor sharded
    by :func:`tensor_parallel` gives this rank's part (the gradient flows back to it); the
    weight of a module between the split layers is read through the rank-order gradient sum;
    anything else as it is."""
    t = cast(torch.Tensor | None, getattr(module, name))
    if isinstance(t, DTensor):
        return t.to_local()
    # Read from the instance's dict: nn.Module's getattr raises (and catches) for an unset
    # attribute, which costs more per call than the rest of this function.
    group = module.__dict__.get("_bik_tp_sum_grads")
    return t if group is None or t is None else _SumGradsInRankOrder.apply(t, group)


def tp_group(weight: torch.Tensor) -> ProcessGroup | None:
    """The process group of a weight sharded by :func:`tensor_parallel`, else None."""
    return weight.device_mesh.get_group() if isinstance(weight, DTensor) else None


def shard_first_dim(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """Every parameter of ``module`` itself split along its first dim across ``mesh``
    (``Shard(0)``: rank r holds the r-th of equal contiguous blocks), taken from the rank
    ``src_data_rank``."""
    for key, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _ColumnParallel(ParallelStyle):
    """Weight and bias rows split across the mesh (``Shard(0)``); the input stays a plain
    replicated tensor, its gradient summed across ranks in rank order; the output is this
    rank's columns, a plain tensor. The patched forward runs ``bik.linear`` on the local
    shards (:func:`local_weight`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            shard_first_dim(submodule, mesh, self.src_data_rank)

        def sum_grads(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            return (_SumGradsInRankOrder.apply(inputs[0], mesh.get_group()), *inputs[1:])

        return distribute_module(module, device_mesh, shard, sum_grads)


class _SumWeightGrads(ParallelStyle):
    """A module with a replicated weight between the split layers (Qwen3's per-head q/k
    RMSNorm) sees only this rank's heads, so the ranks' gradients of its weight are summed.
    Marked on the module, not hooked on the parameter: FSDP replaces parameters."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module._bik_tp_sum_grads = device_mesh.get_group()  # type: ignore[assignment]
        return module


class _RowParallel(ParallelStyle):
    """The weight's K split across the mesh (``Shard(1)``), the bias replicated (what
    ``distribute_module`` does with a parameter ``shard`` leaves). The patched forward sees a
    sharded weight and runs :func:`row_parallel_shard`: input, this rank's K slice (whole
    heads, or its MLP columns); output, the full result on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            weight = cast(torch.Tensor, submodule.weight)
            sharded = distribute_tensor(weight, mesh, [Shard(1)], src_data_rank=self.src_data_rank)
            submodule.register_parameter(
                "weight", nn.Parameter(sharded, requires_grad=weight.requires_grad)
            )

        return distribute_module(module, device_mesh, shard)


def _check_model(model: nn.Module) -> dict[str, str]:
    """The report of a model ``tensor_parallel`` can shard; a clear error otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    report = getattr(model, "_bik_patch", None)
    if report is None:
        raise ValueError(
            "model: expected a Hugging Face causal LM patched with "
            "bik.patch_model(model, tp_invariant=True), got an unpatched "
            f"{type(model).__name__}"
        )
    if family is None:
        raise ValueError(f"model: family {model_type!r} is not one bik supports")
    if family.moe and not hasattr(model, "_bik_expert_parallel"):
        raise ValueError(
            f"model: {model_type!r} is a mixture-of-experts model: shard its experts with "
            "bik.distributed.expert_parallel(model, mesh) first (tensor_parallel then splits "
            "its attention and dense MLPs)"
        )
    if model_type in _UNSPLITTABLE:
        raise ValueError(
            f"model: a {model_type!r} model cannot be sharded into whole heads: "
            f"{_UNSPLITTABLE[model_type]}"
        )
    if not report.tp_invariant:
        raise ValueError(
            "model: expected a model patched with bik.patch_model(model, tp_invariant=True) "
            "(the row-parallel order every TP degree computes), got one patched without it; "
            "call bik.unpatch_model(model), then patch it with tp_invariant=True"
        )
    if hasattr(model, "_bik_tensor_parallel"):
        raise RuntimeError("model: already sharded by bik.distributed.tensor_parallel")
    return report.patched


def _check_mesh(mesh: DeviceMesh, config: Any) -> int:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(f"mesh: expected a 1-D DeviceMesh (the TP ranks), got {shape}")
    degree = mesh.size()
    if TP_CHUNKS % degree:
        raise ValueError(
            f"mesh: expected a TP degree dividing bik.contract.TP_CHUNKS = {TP_CHUNKS}, "
            f"got a mesh of {degree} ranks"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for key, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % degree:
            raise ValueError(
                f"mesh: a TP degree of {degree} does not divide the model's {key} = "
                f"{count} (each rank computes whole heads)"
            )
    return degree


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` (patched with ``bik.patch_model(model, tp_invariant=True)``) over the
    ranks of the 1-D ``mesh``, in place; returns it.

    Every rank calls it with the same model weights (the sharded ones are taken from the
    mesh's first rank) and then runs the same batches. The logits equal the one-process
    model's bit for bit at every TP degree dividing ``bik.contract.TP_CHUNKS``. Refused
    (ValueError): an unpatched model or one patched without ``tp_invariant``, a family that
    cannot be split into whole heads (fused projections, q/k norms over all heads), a
    mixture-of-experts model whose experts :func:`bik.distributed.expert_parallel` has not
    sharded, a mesh that is not 1-D, a degree that does not divide TP_CHUNKS or the head
    counts; a model sharded already (RuntimeError).
    """
    patched = _check_model(model)
    degree = _check_mesh(mesh, cast(Any, model).config)
    plan: dict[str, ParallelStyle] = {}
    for name in patched:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_PARALLEL_NAMES:
            plan[name] = _ColumnParallel()
        elif leaf in ROW_PARALLEL_NAMES:
            plan[name] = _RowParallel()
    for block in {name.rsplit(".", 1)[0] for name in plan}:  # attention and MLP modules
        for name, module in model.get_submodule(block).named_modules(prefix=block):
            if name not in plan and next(module.parameters(recurse=False), None) is not None:
                plan[name] = _SumWeightGrads()
    parallelize_module(model, mesh, plan)
    model._bik_tensor_parallel = degree  # type: ignore[assignment]  # any value is allowed
    return model
