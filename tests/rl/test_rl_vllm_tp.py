"""rl_harness with a tensor-parallel vLLM rollout (``rollout.tensor_parallel=2``): two vLLM
worker processes, one core each, run bik's TP-invariant order, and so does the one-process
trainer, so every mismatch metric is exactly 0 (a mixture-of-experts policy's routing flips
included); a resumed run equals an uninterrupted one
(each request carries its own seed). Native vLLM's mismatch is measured at TP 1
(test_rl_vllm.py) and at TP 2 by ``python -m bik verify --engine vllm --tp 2``
(tests/tools/test_verify_vllm.py)."""

import functools
import json
import os

import pytest

pytest.importorskip("vllm", reason="rollout.engine=vllm needs vLLM (make install-vllm)")

from rl_helpers import cut_and_resume
from test_rl_vllm import (
    BIK_RUN,
    VLLM,
    assert_exactly_zero_mismatch_and_trains,
)

import bik.vllm
from rl_harness import config, runner
from rl_harness.errors import ConfigError

TP2 = ["rollout.tensor_parallel=2"]
needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="TP 2 needs a core per rank"
)


@pytest.fixture(autouse=True, scope="module")
def restore_bik_vllm():
    """The TP 2 engine selects bik's TP-invariant order for the whole process; later test
    modules get the default order back."""
    yield
    if bik.vllm.enabled() is not None:
        bik.vllm.enable(bik.vllm.enabled() or "auto")


def _run(out, cache, sets):
    cfg = config.build({}, VLLM + TP2 + list(sets))
    runner.run(cfg, out, cache_dir=cache, progress=False, name=out.name)
    return runner.read_metrics(out)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("vllm-tp2") / "full"
    return out, _run(out, cache, BIK_RUN)


@needs_two_cores
def test_tp2_rollout_has_exactly_zero_mismatch_and_trains(tp2_run):
    out, history = tp2_run
    assert_exactly_zero_mismatch_and_trains(history)
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["rollout"]["tensor_parallel"] == 2


@needs_two_cores
def test_a_moe_policy_rolls_out_at_tp2_with_exactly_zero_mismatch(tmp_path, cache):
    """Issue 65: a Qwen3-MoE policy, its experts split across the two ranks in bik's
    TP-invariant order, trained by the one-process trainer in the same order: every mismatch
    metric 0, and so is every routing flip, read from the experts bik's engine routed each
    token to (bik.vllm.routing) against the trainer's."""
    moe = ["model.family=qwen3_moe", "model.experts=4", "model.experts_per_token=2"]
    history = _run(tmp_path / "moe", cache, [*BIK_RUN, *moe])
    assert_exactly_zero_mismatch_and_trains(history, routing=True)


@pytest.mark.slow  # two more TP 2 engines
@needs_two_cores
def test_tp2_resume_equals_an_uninterrupted_run(tp2_run, tmp_path, cache, monkeypatch):
    """The rebuilt engine's workers start from the engine seed; only the per-step seeding of
    every worker makes the resumed steps sample what the uninterrupted run did."""
    cut = tmp_path / "cut"
    start = functools.partial(_run, cut, cache, BIK_RUN)
    assert cut_and_resume(start, cut, cache, monkeypatch, at=2) == tp2_run[1]


@pytest.mark.parametrize(
    "sets, match",
    [
        (["rollout.engine=hf", "rollout.tensor_parallel=2"], "expected 1 with rollout.engine=hf"),
        (["rollout.tensor_parallel=3"], "expected a power of two dividing 8"),
        (["rollout.tensor_parallel=16"], "expected a power of two dividing 8"),
        (["rollout.tensor_parallel=0"], "rollout.tensor_parallel"),
    ],
)
def test_tensor_parallel_settings_are_checked(sets, match):
    with pytest.raises(ConfigError, match=match):
        config.build({}, [*VLLM, *sets])


def test_config_json_names_tensor_parallel_only_when_set():
    """Runs recorded before the key existed keep their config.json byte for byte."""
    assert "tensor_parallel" not in config.build({}, VLLM).to_dict()["rollout"]
    assert config.build({}, VLLM + TP2).to_dict()["rollout"]["tensor_parallel"] == 2
    assert config.build({}, VLLM + TP2).tp_invariant
