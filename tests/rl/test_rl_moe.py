"""rl_harness with mixture-of-experts policies: config, the policy's expert sizes, the routing
recorder and routing-flip metrics (hand-made index tensors), and tiny runs: bik on both sides
gives zero mismatch and zero routing flips; swapped kernels or dtype are measured."""

import pytest
import torch
from rl_helpers import TINY as RL_TINY

from bik.hf import MOE_FAMILIES, SUPPORTED_FAMILIES
from rl_harness import config, policy, report, routing, runner
from rl_harness.config import ConfigError
from rl_harness.routing import Recorder, flips, routing_metrics

MOE = [
    *RL_TINY,
    "model.family=qwen3_moe",
    "warmup.steps=4",
    "steps=2",
]  # a short warm-up: MoE backward is slow
KEYS = ("routing_flip_frac", "routing_flip_pair_frac", "routing_flip_count")


def _run(tmp_path, cache, name, sets):
    cfg = config.build({}, sets)
    runner.run(cfg, tmp_path / name, cache_dir=cache, progress=False, name=name)
    return runner.read_metrics(tmp_path / name)


# -- config and policy ---------------------------------------------------------------------


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_every_supported_family_is_a_valid_model_family(family):
    cfg = config.build({}, [f"model.family={family}"])
    assert cfg.model.family == family and cfg.model.moe == (family in MOE_FAMILIES)


@pytest.mark.parametrize(
    "sets, match",
    [
        (
            ["model.family=qwen3_moe", "model.experts=4", "model.experts_per_token=5"],
            r"^model\.experts_per_token: expected at most model\.experts \(4\), got 5",
        ),
        (["model.experts=0"], r"^model\.experts: expected an integer >= 1"),
        (["model.family=gpt2"], r"^model\.family: expected one of"),
        (
            ["model.family=mixtral", "rollout.engine=vllm", "rollout.kernels=native"],
            r"^rollout\.engine=vllm: native vLLM does not report the expert choices .* "
            r"\(model\.family=mixtral\)",
        ),
    ],
)
def test_bad_moe_configs_raise_naming_the_key(sets, match):
    with pytest.raises(ConfigError, match=match):
        config.build({}, sets)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_policy_has_the_configured_experts(family):
    cfg = config.build({}, [*RL_TINY, f"model.family={family}", "model.experts=4"])
    cfg = cfg.replace(**{"model.experts_per_token": 3, "model.layers": 3})
    master = policy.build_master(cfg.model, cfg.seed)
    gates = routing.routers(master)
    layer_routers = [
        getattr(layer.mlp, "gate", None) or layer.mlp.router for layer in master.model.layers
    ]
    assert len(gates) == 3 and all(g is r for g, r in zip(gates, layer_routers))
    for gate in gates:
        assert gate.top_k == 3 and tuple(gate.weight.shape) == (4, 32)


def test_dense_policy_is_built_as_before():
    """The default policy's config keys did not change with the MoE keys (committed runs)."""
    master = policy.build_master(config.build().model, 0)
    c = master.config
    assert (c.model_type, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        "qwen3",
        64,
        256,
        2,
    )
    assert not routing.routers(master) and not hasattr(c, "num_experts")


# -- routing flips on hand-made indices ------------------------------------------------------


def test_flips_compare_expert_sets_not_their_order():
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])  # [1, 2 positions, 2 layers, 2]
    train = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [7, 6]]]])
    assert flips(rollout, train).tolist() == [[[False, False], [True, False]]]
    assert not flips(rollout, rollout.flip(-1)).any()
    with pytest.raises(ValueError, match=r"routing\.flips: expected equal shapes"):
        flips(rollout, train[:, :1])


def test_routing_metrics_match_hand_counts():
    # 2 rows x 4 positions x 2 layers x top-2. Response token t is compared at position t - 1.
    rollout = torch.zeros(2, 4, 2, 2, dtype=torch.long)
    rollout[..., 1] = 1
    train = rollout.clone()
    train[0, 1, 0] = torch.tensor([1, 2])  # row 0, position 1 (token 2), layer 0: a flip
    train[0, 2, :] = torch.tensor([3, 0])  # row 0, position 2 (token 3), both layers
    train[1, 1, 1] = torch.tensor([1, 0])  # the same set in another order: no flip
    train[0, 0, 0] = torch.tensor([5, 6])  # row 0's token 1 is off the response
    train[0, 3, 1] = torch.tensor([7, 6])  # the last position gives no token's log-prob
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    m = routing_metrics(rollout, train, mask)
    # response tokens: row 0 -> 2 (flip, 1 layer), 3 (flip, 2 layers); row 1 -> 1, 2, 3 (none)
    assert m["mismatch/routing_flip_count"] == 2
    assert m["mismatch/routing_flip_frac"] == pytest.approx(2 / 5)
    assert m["mismatch/routing_flip_pair_frac"] == pytest.approx(3 / 10)
    assert routing_metrics(rollout, rollout.clone(), mask) == {f"mismatch/{k}": 0.0 for k in KEYS}
    # the last position is never fed in the rollout; padding it must not count
    padded = routing.pad_positions(rollout[:, :3], 4)
    assert padded[:, 3].eq(routing.UNROUTED).all()
    assert routing_metrics(padded, rollout, mask)["mismatch/routing_flip_count"] == 0
    with pytest.raises(ValueError, match="routing_metrics: expected a mask of shape"):
        routing_metrics(rollout, train, mask[:, :3])


class FakeTopKRouter(torch.nn.Module):
    """A router whose top-k indices are its input (one row per token position)."""

    def forward(self, x):
        return x.float(), x.float(), x


def test_recorder_lays_out_decode_steps_and_micro_batches():
    model = torch.nn.ModuleList([FakeTopKRouter(), FakeTopKRouter()])
    whole = torch.arange(2 * 5 * 2).reshape(2, 5, 2)  # [rows, positions, k]
    with Recorder(model) as recorder:
        for layer in model:  # a prefill of 3 positions, then 2 decode steps
            layer(whole[:, :3].reshape(-1, 2))
        for position in (3, 4):
            for layer in model:
                layer(whole[:, position])
        decoded = recorder.pop(2, calls_along="positions")
        for rows in (slice(0, 1), slice(1, 2)):  # micro-batches of whole sequences
            for layer in model:
                layer(whole[rows].reshape(-1, 2))
        full = recorder.pop(2, calls_along="rows")
    expected = torch.stack([whole, whole], dim=2)  # [rows, positions, layers, k]
    assert torch.equal(decoded, expected) and torch.equal(full, expected)
    model[0](whole[:, 0])  # hooks removed on exit
    assert recorder.calls == [[], []]


# -- runs ----------------------------------------------------------------------------------


def test_moe_with_bik_has_zero_mismatch_and_zero_routing_flips(tmp_path, cache):
    history = _run(tmp_path, cache, "zero", [*MOE, "train.micro_batch_size=3"])
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["mismatch/tokens_unequal_count"] == 0 and m["mismatch/logprob_abs_diff_max"] == 0
        assert all(m[f"mismatch/{k}"] == 0.0 for k in KEYS), m
    summary = (tmp_path / "zero" / "summary.md").read_text()
    assert "routing flips (MoE): mean fraction of response tokens 0.0000" in summary


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear", "gpt_oss"])
def test_2026_family_policies_with_bik_have_zero_mismatch(tmp_path, cache, family):
    """DeepSeek-V3 and Kimi Linear (latent attention; Kimi's Delta Attention beside it) as
    harness policies: the tiny preset's latent ranks, RoPE over model.head_dim; gpt-oss
    (sinks, a sliding window, biased clamped-SwiGLU experts) beside them."""
    history = _run(tmp_path, cache, family, [*MOE, f"model.family={family}"])
    for m in history:
        assert m["mismatch/tokens_unequal_count"] == 0 and m["mismatch/logprob_abs_diff_max"] == 0


def test_moe_kernel_swap_measures_routing_flips(tmp_path, cache):
    history = _run(tmp_path, cache, "native", [*MOE, "rollout.kernels=native"])
    assert history[0]["mismatch/tokens_unequal_count"] > 0
    for m in history:
        assert 0.0 <= m["mismatch/routing_flip_pair_frac"] <= m["mismatch/routing_flip_frac"] <= 1
        count = m["mismatch/routing_flip_count"]
        assert count == int(count) and (count > 0) == (m["mismatch/routing_flip_frac"] > 0)


def test_moe_bf16_rollout_flips_routing(tmp_path, cache):
    """A bf16 rollout moves the router logits enough to change some tokens' experts (32
    experts, 8 per token, 64 sequences: 6 to 18 flipped tokens a step over 4 seeds): the
    metric is not stuck at 0."""
    sets = ["rollout.dtype=bfloat16", "rollout.prompts=32", "model.experts=32"]
    history = _run(tmp_path, cache, "bf16", [*MOE, *sets, "model.experts_per_token=8"])
    for m in history:
        assert m["mismatch/routing_flip_count"] > 0
        assert 0 < m["mismatch/routing_flip_pair_frac"] <= m["mismatch/routing_flip_frac"] < 1


def test_dense_runs_log_no_routing_metrics(tmp_path, cache):
    history = _run(tmp_path, cache, "dense", [*RL_TINY, "steps=1"])
    assert not [k for k in history[0] if "routing" in k]
    assert "routing" not in report.compare_markdown({"dense": history})


def test_moe_model_path_with_native_vllm_is_refused_before_the_warm_up(tmp_path):
    cfg = config.build({}, [*MOE, "model.experts=4"])
    policy.build_master(cfg.model, 0).save_pretrained(tmp_path / "model")
    native = ["rollout.engine=vllm", "rollout.kernels=native"]
    cfg = config.build({}, [*RL_TINY, f"model.path={tmp_path / 'model'}", *native])
    with pytest.raises(
        ConfigError, match=r"rollout\.engine=vllm: native vLLM does not report the expert"
    ):
        runner.Run(cfg, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
