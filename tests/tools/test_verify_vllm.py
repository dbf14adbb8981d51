"""python -m bik verify --engine vllm: native vLLM and vLLM with bik against the trainer.

One real run (both engines at TP 2, each in its own processes, on a tiny random-init Qwen3-MoE
saved to a directory): bik's log-probs equal the trainer's bit for bit, native vLLM's do not
(fp32, the negative control). The argument cases stop before any model or engine runs.
"""

import os
import re
import subprocess
import sys

import pytest
from test_cli import _never, usage_error

pytest.importorskip("vllm")

from bik import testing
from bik.testing.presets import SHARED_PREFIX
from bik.tools import verify, verify_vllm
from bik.vllm import engine as vllm_engine


def _saved(family, tmp_path_factory):
    """A tiny random-init model of ``family`` (GQA 4/2, head_dim 32, which native vLLM's CPU
    attention runs) saved with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    torch.manual_seed(0)
    config = FAMILIES[family].engine_config(
        vocab_size=512, hidden_size=64, intermediate_size=128, max_position_embeddings=256
    )
    path = tmp_path_factory.mktemp(family)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return _saved("qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return _saved("qwen3_moe", tmp_path_factory)


def _row(stdout: str, kernels: str) -> tuple[int, int]:
    match = re.search(rf"^\| {re.escape(kernels)} \| (\d+)/(\d+) \|", stdout, re.MULTILINE)
    assert match, f"no {kernels!r} row in:\n{stdout}"
    return int(match[1]), int(match[2])


def _verify(qwen3_dir, *options: str, timeout: int) -> str:
    """The stdout of a passing ``python -m bik verify --engine vllm`` run on ``qwen3_dir``."""
    done = subprocess.run(
        [sys.executable, "-m", "bik", "verify", "--engine", "vllm", str(qwen3_dir), *options],
        capture_output=True,
        text=True,
        timeout=timeout,  # a guard against a hung engine, not a time limit
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow  # minutes: 2 engines of 2 worker processes
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 needs a core per rank")
def test_at_tp_2_bik_vllm_equals_the_tp_invariant_trainer_and_native_vllm_does_not(
    qwen3_moe_dir,
):
    """Both engines at tensor parallelism 2 (2 worker processes) on a mixture-of-experts model
    (issue 65): bik's, in the TP-invariant order (attention's and the experts' row-parallel
    projections), equals the trainer patched with tp_invariant=True; native vLLM's does not
    (fp32, the negative control). The TP 1 path differs only in the engine keywords; engines
    at TP 1 run in test_vllm.py (bik) and tests/rl/test_rl_vllm.py (native, against the
    trainer); dense and other MoE families at TP 2 in tests/integrations/test_vllm_tp.py."""
    out = _verify(qwen3_moe_dir, "--tp", "2", "--prompts", "8", "--tokens", "8", timeout=900)
    assert "| kernels | unequal log-probs vs trainer |" in out
    assert "TP 2 (TP-invariant order)" in out and "chunked_linear (8 chunks" in out
    assert "experts (summed in rank order), down projection in bik.distributed.chunked" in out
    bik_unequal, total = _row(out, verify_vllm.KERNELS["bik"])
    native_unequal, native_total = _row(out, verify_vllm.KERNELS["native"])
    assert total == native_total == 8 * 2 * 8
    assert bik_unequal == 0
    assert native_unequal > 0
    first = re.search(r"native vLLM vs trainer, first difference: (.*)", out)
    assert first and re.fullmatch(r"request \d+ \(sample \d\), generated token \d+", first[1])
    assert "prompt tokens read from the cache" in out and "verify: vLLM with bik" in out


def test_tp_must_divide_the_chunks_and_needs_engine_vllm(capsys, no_work, qwen3_dir):
    line = usage_error(capsys, ["verify", "--engine", "vllm", str(qwen3_dir), "--tp", "3"])
    assert "argument --tp: expected a power of two dividing 8, got 3" in line
    line = usage_error(capsys, ["verify", "--tp", "2"])
    assert "argument --tp: applies to --engine vllm only" in line


def test_compare_names_the_first_difference_in_request_order():
    import torch

    samples = [
        [{"tokens": [5, 6], "logprobs": [-1.0, -2.0]}],
        [{"tokens": [7, 8, 9], "logprobs": [-1.0, -2.0, -3.0]}] * 2,
    ]
    trained = [
        [torch.tensor([-1.0, -2.0])],
        [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.0, -2.5, -3.5])],
    ]
    result = verify_vllm.compare(samples, trained)
    assert (result.unequal, result.total, result.identical_requests, result.requests) == (
        2,
        8,
        2,
        3,
    )
    assert result.max_diff == 0.5 and not result.identical
    assert verify_vllm.first_difference(result) == "request 1 (sample 1), generated token 1"


def test_prompts_are_seeded_mixed_and_share_a_prefix():
    prompts = testing.sample_prompts(0, 8, 512)
    assert prompts == testing.sample_prompts(0, 8, 512) != testing.sample_prompts(1, 8, 512)
    assert len({len(p) for p in prompts}) > 2 and all(3 <= t < 512 for p in prompts for t in p)
    shared = SHARED_PREFIX
    assert prompts[1][:shared] == prompts[3][:shared]


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(verify, "load_model", _never("verify.load_model"))
    monkeypatch.setattr(vllm_engine, "run_engine", _never("vllm_engine.run_engine"))


def test_without_vllm_the_error_says_how_to_install_it(capsys, no_work, monkeypatch, qwen3_dir):
    find_spec = vllm_engine.importlib.util.find_spec
    monkeypatch.setattr(
        vllm_engine.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "vllm" else find_spec(name, *args),
    )
    line = usage_error(capsys, ["verify", "--engine", "vllm", str(qwen3_dir)])
    assert "argument --engine: vLLM is not installed" in line and "make install-vllm" in line


@pytest.mark.parametrize("model", ["all", "tiny-qwen3"])
def test_engine_vllm_needs_a_model_directory(capsys, no_work, model):
    line = usage_error(capsys, ["verify", "--engine", "vllm", "--model", model])
    assert "argument --model: --engine vllm needs a real model (smollm2) or a local model" in line


def test_vllm_options_need_engine_vllm(capsys, no_work):
    line = usage_error(capsys, ["verify", "--prompts", "4"])
    assert "argument --prompts: applies to --engine vllm only" in line
    line = usage_error(capsys, ["verify", "--engine", "vllm", "--tokens", "0"])
    assert "argument --tokens: expected an integer >= 1, got '0'" in line


def test_model_given_twice_must_agree(capsys, no_work, qwen3_dir):
    line = usage_error(capsys, ["verify", "--model", "tiny-qwen3", str(qwen3_dir)])
    assert "argument --model: got 'tiny-qwen3' and MODEL" in line


def test_biased_experts_above_tp_1_are_refused_before_any_engine(capsys, no_work, tmp_path):
    """vLLM loads gpt-oss's experts' down bias on rank 0 only (bik.vllm.moe); given a gpt-oss
    model directory and ``--tp 2``, ``verify --engine vllm`` stops at once with status 2
    (only config.json is read)."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "num_local_experts": 4}')
    argv = ["verify", "--engine", "vllm", str(tmp_path), "--tp", "2"]
    line = usage_error(capsys, argv)
    assert f"argument --tp: '{tmp_path}' holds a mixture-of-experts model with biased" in line
    assert "('gpt_oss', 4 experts) at tensor_parallel_size=2: vLLM loads" in line
