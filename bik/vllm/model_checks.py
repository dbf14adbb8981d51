"""The modules of a loaded vLLM model that ``check_model`` (bik.vllm.config) looks at, one
record each, keyed by bik's layer-kind names where the module is one (bik.hf.kinds, and the
engine's layers: bik.vllm.layers.ENGINE_LAYERS), else by what it is.

``check_model`` walks the model's modules; the first record that matches a module decides
what is wrong with it (nothing, for bik's own layers). A record marked ``whole`` is computed by
bik's forward from its weights, so its submodules, which that forward never calls, are not
looked at. A module no record matches computes nothing bik must vouch for (a container, an
unquantized linear: bik's ``apply``, vLLM's attention: bik's backend). With the TP-invariant
order on, every row-parallel linear's K slice must also split into its rank's chunks.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.linear import (
    LinearBase,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

from ..contract import TP_CHUNKS
from . import gdn, mamba2, mla, moe
from .layers import BIK_LAYERS, transformers_module_problem


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What a module's check reads beside the module: the transformers config, the family's
    model type (an MTP draft's is its target's) and whether the TP-invariant order is on."""

    hf_config: Any
    model_type: str
    tp_invariant: bool


Problems = Callable[[str, Any, ModelFacts], list[str]]


def _fine(name: str, module: Any, facts: ModelFacts) -> list[str]:
    return []


def _refused(why: str) -> Problems:
    """Every module of the record is refused, ``why``."""
    return lambda name, module, _: [f"{name} ({type(module).__name__}): {why}"]


def _one(problem: Callable[[str, Any, ModelFacts], str | None]) -> Problems:
    """The problems of a check that finds one problem or None."""

    def problems(name: str, module: Any, facts: ModelFacts) -> list[str]:
        found = problem(name, module, facts)
        return [] if found is None else [found]

    return problems


@dataclasses.dataclass(frozen=True)
class ModuleCheck:
    """matches: whether a module is of this record. problems: why it would not run bik's
    numerics (none: it does). whole: bik's forward computes it from its weights."""

    matches: Callable[[Any], bool]
    problems: Problems = _fine
    whole: bool = False


def _of(*classes: type) -> Callable[[Any], bool]:
    return lambda module: isinstance(module, classes)


def _quantized(module: Any) -> bool:
    return isinstance(module, LinearBase) and not isinstance(
        module.quant_method, UnquantizedLinearMethod
    )


def _scaled_logits(module: Any) -> bool:
    return isinstance(module, LogitsProcessor) and (
        module.soft_cap is not None or module.scale != 1.0
    )


def _from_transformers(module: Any) -> bool:
    return type(module).__module__.startswith("transformers.")


def _experts_problems(name: str, runner: Any, facts: ModelFacts) -> list[str]:
    limit = getattr(facts.hf_config, "swiglu_limit", None)
    return moe.problems(name, runner, facts.model_type, limit, facts.tp_invariant)


MODULE_CHECKS: dict[str, ModuleCheck] = {
    "bik_layers": ModuleCheck(_of(*BIK_LAYERS), whole=True),
    # the recurrent layers' parts bik's forwards never call (the GPU prefill op, the mixer's norm)
    "uncalled_parts": ModuleCheck(_of(*gdn.UNCALLED, *mamba2.UNCALLED)),
    "attention": ModuleCheck(  # latent attention (bik.vllm.mla): bik calls none of its parts
        _of(MLAAttention), _one(lambda name, layer, _: mla.problem(name, layer)), whole=True
    ),
    "mamba2_mixer": ModuleCheck(
        _of(MambaMixer2),
        _one(lambda name, mixer, facts: mamba2.problem(name, mixer, facts.hf_config)),
    ),
    "gated_delta_net": ModuleCheck(
        _of(QwenGatedDeltaNetAttention), _one(lambda name, layer, _: gdn.problem(name, layer))
    ),
    "other_recurrent": ModuleCheck(  # a recurrent layer: its ops are not CustomOps
        _of(MambaBase), _refused("a recurrent layer bik does not compute in vLLM")
    ),
    "experts": ModuleCheck(_of(MoERunner), _experts_problems, whole=True),
    "other_custom_op": ModuleCheck(_of(CustomOp), _refused("not computed by bik")),
    "quantized_linear": ModuleCheck(
        _quantized,
        lambda name, module, _: [
            f"{name} ({type(module).__name__}): quantized ({type(module.quant_method).__name__})"
        ],
    ),
    "transformers_module": ModuleCheck(  # vLLM's Transformers backend: transformers' own code
        _from_transformers,
        _one(
            lambda name, module, facts: transformers_module_problem(name, module, facts.model_type)
        ),
    ),
    "scaled_logits": ModuleCheck(
        _scaled_logits, lambda name, module, _: [f"{name}: logits soft-cap or scale"]
    ),
}


def module_problems(model: Any, facts: ModelFacts) -> list[str]:
    """Every problem of ``model``'s modules, in module order (see the module doc)."""
    problems: list[str] = []
    whole: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{owner}.") for owner in whole):
            continue  # a part of a module bik's forward computes whole: never called
        check = next((c for c in MODULE_CHECKS.values() if c.matches(module)), None)
        if check is not None:
            problems += check.problems(name, module, facts)
            whole += [name] if check.whole else []
        if facts.tp_invariant and isinstance(module, RowParallelLinear):
            problems += _row_parallel_chunks(name, module)
    return problems


def _row_parallel_chunks(name: str, layer: Any) -> list[str]:
    """A row-parallel linear's K slice must split into its rank's TP-invariant chunks."""
    if layer.input_size_per_partition % (TP_CHUNKS // layer.tp_size):
        return [
            f"{name}: K = {layer.input_size} is not divisible by "
            f"bik.contract.TP_CHUNKS = {TP_CHUNKS} (the TP-invariant order's chunks)"
        ]
    return []
