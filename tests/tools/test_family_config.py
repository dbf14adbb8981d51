"""A family builds its own config from a shape (bik.families.Family.config): the tiny presets,
the RL harness's policies and the bench's models all come from it, so no module that builds
models spells a family's config keys (the recurrent layers' heads, latent attention's ranks,
the experts' counts and widths, layer-type patterns)."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bik.families import (
    FAMILIES,
    RECURRENT_KINDS,
    TINY_EXPERTS,
    TINY_SHAPE,
    ExpertShape,
    Family,
    RecurrentHeads,
)
from bik.hf.kinds import KINDS

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = ("rl_harness", "bik/testing", "bik/tools", "benchmarks")
# Keys every family's config has: sizes that a Shape names, not a family's own
COMMON = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
}


def family_keys() -> set[str]:
    """The config keys the family records spell: their features at two sizes, their experts,
    their presets' and vLLM's keys, less the common sizes."""
    keys = set()
    for family in FAMILIES.values():
        for shape in (TINY_SHAPE, replace(TINY_SHAPE, layers=5, full_attention_every=2)):
            keys |= set(family._feature_keys(shape))
        if family.moe:
            keys |= set(family.moe_config(TINY_EXPERTS))
        keys |= {key for key, _ in (*family.tiny_keys, *family.moe_keys, *family.vllm_keys)}
    return keys - COMMON


def spelled(text: str, keys: set[str]) -> set[str]:
    """The keys ``text`` writes into a config: as a keyword argument, a dict key or a pair."""
    found = set()
    for key in keys:
        if re.search(rf'\b{key}=|"{key}":|\("{key}",', text):
            found.add(key)
    return found


def test_the_family_keys_are_found():
    keys = family_keys()
    assert {"linear_num_key_heads", "kv_lora_rank", "mamba_num_heads", "num_experts"} <= keys
    assert "hidden_size" not in keys


@pytest.mark.parametrize("folder", BUILDERS)
def test_no_model_builder_spells_a_family_config_key(folder):
    keys = family_keys()
    found = {
        str(path.relative_to(ROOT)): sorted(spelled(path.read_text(), keys))
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: keys for path, keys in found.items() if keys} == {}


def test_a_spelled_key_is_found():
    """The control: the three ways a builder would write a key, and a read that is none."""
    keys = {"linear_num_key_heads", "layer_types"}
    assert spelled("AutoConfig.for_model('x', linear_num_key_heads=2)", keys) == {
        "linear_num_key_heads"
    }
    assert spelled('{"layer_types": ["mlp"]}', keys) == {"layer_types"}
    assert spelled('(("layer_types", ["mlp"]),)', keys) == {"layer_types"}
    assert spelled('layer_types = getattr(config, "layer_types", None)', keys) == set()


def test_a_hybrids_recurrent_heads_and_full_attention_follow_the_shape():
    shape = replace(
        TINY_SHAPE,
        layers=8,
        recurrent=RecurrentHeads(2, 6, 16, 24),
        full_attention_every=4,
    )
    config = FAMILIES["qwen3_next"].config(shape, ExpertShape(4, 2, 32, 64))
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 6)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (16, 24)
    assert (config.num_experts, config.shared_expert_intermediate_size) == (4, 64)
    mamba = FAMILIES["nemotron_h"].config(replace(TINY_SHAPE, layers=2))
    assert mamba.layer_types == ["linear_attention", "mlp", "full_attention", "mlp"]
    assert (mamba.mamba_num_heads, mamba.n_groups, mamba.mamba_head_dim) == (4, 2, 32)


def test_a_shared_expert_needs_its_width():
    with pytest.raises(ValueError, match="experts: qwen2_moe has a shared expert"):
        FAMILIES["qwen2_moe"].moe_config(ExpertShape(4, 2, 32))


def test_a_familys_recurrent_kind_is_a_recurrent_layer_kind():
    """Family.recurrent is a RecurrentKind record whose name is a layer kind of bik.hf.kinds
    that carries a state (and every such layer kind has its record)."""
    recurrent = {kind.name for kind in KINDS if kind.recurrent}
    assert recurrent == {kind.name for kind in RECURRENT_KINDS}
    assert {f.recurrent for f in FAMILIES.values()} - {None} <= set(RECURRENT_KINDS)


def test_a_recurrent_kind_must_be_a_record():
    with pytest.raises(ValueError, match="recurrent: expected None or one of the records"):
        Family("x", "X", "", recurrent="gated_delta_net")  # type: ignore[arg-type]
