"""The forwards patch_model installs on Linear, RMSNorm, rotary and activation modules.

Each is a plain object holding its module and the patch-time backend, not a closure or a
bound method, so deepcopy and pickle keep a patched model.
"""

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from .. import packed_weights
from ..distributed import chunked_linear
from ..distributed.sharded import local_weight, row_parallel_shard, tp_group
from ..layers.rotary import rotary_cos_sin
from ..ops.activations import gelu_tanh, silu
from ..ops.matmul import linear
from ..ops.rms_norm import gemma_rms_norm, rms_norm_like_transformers
from .autocast import autocast_inputs, run
from .fused_projections import active_group


def fusable_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a bik-patched plain linear (not tensor-parallel) over a plain
    weight: one bik.hf.fused_projections may compute with its sibling projections."""
    forward = module.forward
    return (
        isinstance(forward, PatchedForward)
        and forward.kind == "linear"
        and type(module.weight) in (torch.Tensor, torch.nn.Parameter)
    )


class PatchedForward:
    """A Linear's or RMSNorm's forward (``kind``: 'linear', 'row_parallel_linear' (the
    tensor-parallel-invariant order, bik.distributed.chunked_linear), 'rms_norm',
    'gemma_rms_norm'). A linear sharded by ``bik.distributed.tensor_parallel`` runs on this
    rank's shards; a sharded row-parallel one gathers the ranks' partials."""

    # patch_model(pack_weights=True) sets it: the weight is marked again at each call, so a
    # deep copy of the model (whose Parameters drop their marks) keeps its weights packed.
    pack_weight = False

    def __init__(self, module: torch.nn.Module, kind: str, backend: str):
        self.module, self.kind, self.backend = module, kind, backend

    def _linear_op(self) -> Callable[..., torch.Tensor]:
        if self.kind == "linear":
            return linear
        group = tp_group(cast(torch.Tensor, self.module.weight))
        return (
            chunked_linear if group is None else functools.partial(row_parallel_shard, group=group)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, weight = self.module, cast(torch.Tensor, local_weight(self.module))
        if self.kind in ("linear", "row_parallel_linear"):
            if self.pack_weight:
                packed_weights.mark(weight)
            bias = local_weight(m, "bias")
            autocast_on, (x, weight, bias) = autocast_inputs(x.device.type, x, weight, bias)
            group = active_group(m)
            if group is not None and autocast_on is None and not torch.is_grad_enabled():
                out = group.output(m, x, functools.partial(run, self.backend, None, linear))
                if out is not None:
                    return out
            return run(self.backend, autocast_on, self._linear_op(), x, weight, bias)
        autocast_on, _ = autocast_inputs(x.device.type)
        if self.kind == "gemma_rms_norm":  # x * inv_rms * (1 + w), fp32 math, one rounding
            return run(self.backend, autocast_on, gemma_rms_norm, x, weight, m.eps)
        eps = m.variance_epsilon
        return run(self.backend, autocast_on, rms_norm_like_transformers, x, weight, eps)


class EagerRotary:
    """A rotary embedding's forward, run eagerly even inside torch.compile. Its cos/sin are
    the one step of the model whose bits a compiler changes (inductor's vectorised cos/sin
    differ from eager's); the rest of the forward compiles to eager's bits, so compiled
    rollouts and eager training agree. Costs one graph break per forward.

    In the families bik supports, RoPE with fixed frequencies takes its cos/sin from
    bik.layers.rotary, the formula bik's vLLM layer uses too; dynamic variants (recomputed per
    length), multimodal RoPE (Qwen3.5) and other families run transformers' code."""

    def __init__(self, module: torch.nn.Module, bik_formula: bool):
        self.module = module
        rope_type = getattr(module, "rope_type", "default")
        self.bik_formula = (
            bik_formula
            and not any(kind in rope_type for kind in ("dynamic", "longrope"))
            and not hasattr(module, "mrope_section")  # Qwen3.5's multimodal layout
        )

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bik_formula and not (args or kwargs):
            return _bik_cos_sin(self.module, x, position_ids)
        return _eager_forward(self.module, x, position_ids, *args, **kwargs)


@torch.compiler.disable
def _bik_cos_sin(module, x, position_ids):
    return rotary_cos_sin(module.inv_freq, position_ids, module.attention_scaling, x.dtype)


@torch.compiler.disable
def _eager_forward(module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


class Activation:
    """An activation module's forward: bik.silu or bik.gelu_tanh, whose bits do not depend on
    the tensor's layout (torch's fp32 kernels' do); bik's vLLM layer calls bik.silu too."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x) if self.kind == "silu" else gelu_tanh(x)
