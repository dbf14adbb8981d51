"""bik in verl (``bik.verl``): the rollout server's log-probs equal the update's, packed as
verl packs them, the settings that cannot be exact are refused, and a verl GRPO run on this
CPU logs every mismatch metric as exactly 0 (with bik) and not (the native control).

verl lives in its own venv (``make install-verl``; ``make test-verl`` runs this file there):
in any other venv the file is skipped as a whole.
"""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by make install-verl, in .venv-verl")

import verl
from omegaconf import OmegaConf
from verl.utils.torch_functional import logprobs_from_logits as verl_logprobs

import bik
import bik.verl.plugin
from bik import testing
from bik.verl import audit, checks, engine, rollout, run

PROMPTS = [[5, 17, 9, 33, 2, 8], [40, 3, 3, 12], [7, 61, 29, 11, 4, 19, 23, 50, 6]]


def _policy(dtype: torch.dtype, patched: bool = True):
    model = testing.load_model("tiny-llama", dtype=dtype)
    model.eval()
    if patched:
        bik.patch_model(model)
    return model


def _packed_logprobs(
    model, sequences: list[list[int]], temperature: float, formula
) -> list[torch.Tensor]:
    """The update's log-probs as verl's packed (``use_remove_padding``) forward computes them:
    the sequences in one row, positions restarting, no mask and no cache, logits divided by the
    temperature, each token scored from the position before it."""
    ids = torch.tensor([[t for s in sequences for t in s]])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    with torch.no_grad():
        logits = model(
            input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False
        ).logits[0]
    scaled = rollout.scale(logits, temperature)
    scores = formula(scaled[:-1], ids[0, 1:])
    out, start = [], 0
    for s in sequences:
        out.append(scores[start : start + len(s) - 1])
        start += len(s)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_logprobs_equal_the_packed_update(dtype, temperature):
    model = _policy(dtype)
    torch.manual_seed(0)
    decoded = [rollout._decode(model, p, temperature, 12, stop_ids=()) for p in PROMPTS]
    sequences = [p + tokens for p, (tokens, _) in zip(PROMPTS, decoded)]
    update = _packed_logprobs(model, sequences, temperature, engine.logprobs_of)
    for prompt, (tokens, logprobs), scores in zip(PROMPTS, decoded, update):
        assert len(tokens) == 12
        assert torch.equal(torch.tensor(logprobs), scores[len(prompt) - 1 :])


def test_native_rollout_logprobs_differ_from_the_update():
    """The negative control: without bik, the bf16 decode's log-probs are not the packed
    forward's (verl's formula on both sides)."""
    model = _policy(torch.bfloat16, patched=False)
    differing = 0
    for seed, prompt in enumerate(PROMPTS * 2):
        torch.manual_seed(seed)
        tokens, _ = rollout._decode(model, prompt, 1.0, 16, stop_ids=())
        cache = None
        rolled = []
        with torch.no_grad():
            ids = torch.tensor([prompt])
            for token in tokens:
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                rolled.append(verl_logprobs(out.logits[0, -1:], torch.tensor([token]))[0])
                ids = torch.tensor([[token]])
        (update,) = _packed_logprobs(model, [prompt + tokens], 1.0, verl_logprobs)
        differing += int((torch.stack(rolled) != update[len(prompt) - 1 :]).sum())
    assert differing > 0


def test_a_greedy_request_is_the_argmax_and_stops_at_eos():
    model = _policy(torch.float32)
    tokens, _ = rollout._decode(model, PROMPTS[0], 0.0, 8, stop_ids=())
    with torch.no_grad():
        first = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].argmax()
    assert tokens[0] == int(first)
    stopped, logprobs = rollout._decode(model, PROMPTS[0], 0.0, 8, stop_ids={tokens[0]})
    assert stopped == tokens[:1] and len(logprobs) == 1


def _config(**changes):
    config = {
        "algorithm": {"rollout_correction": {"bypass_mode": False}},
        "actor_rollout_ref": {
            "model": {"use_fused_kernels": False},
            "actor": {"fsdp_config": {"dtype": "bfloat16", "ulysses_sequence_parallel_size": 1}},
            "rollout": {
                "name": "bik",
                "top_p": 1.0,
                "top_k": -1,
                "dtype": "bfloat16",
                "calculate_log_probs": True,
            },
        },
    }
    conf = OmegaConf.create(config)
    for key, value in changes.items():
        OmegaConf.update(conf, key, value)
    return conf


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("actor_rollout_ref.rollout.name", "vllm", "rollout.name"),
        ("actor_rollout_ref.rollout.top_p", 0.9, "top_p"),
        ("actor_rollout_ref.rollout.top_k", 20, "top_k"),
        ("actor_rollout_ref.rollout.dtype", "float32", "rollout.dtype"),
        ("actor_rollout_ref.rollout.dtype", "fp8", "rollout.dtype"),
        ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 2, "ulysses"),
        ("actor_rollout_ref.model.use_fused_kernels", True, "use_fused_kernels"),
    ],
)
def test_settings_that_cannot_be_exact_are_refused_by_name(key, value, named):
    checks.check_settings(_config())  # the defaults pass
    with pytest.raises(ValueError, match=named):
        checks.check_settings(_config(**{key: value}))


def test_bypass_without_rollout_logprobs_is_refused():
    bypass = {
        "algorithm.rollout_correction.bypass_mode": True,
        "actor_rollout_ref.rollout.calculate_log_probs": False,
    }
    with pytest.raises(ValueError, match="calculate_log_probs"):
        checks.check_settings(_config(**bypass))


def test_another_verl_version_is_refused():
    checks.check_version(verl.__version__, bik.verl.TESTED_VERL)
    with pytest.raises(RuntimeError, match=r"verl 0\.8\.5: bik\.verl plugs into verl==0\.9\.1"):
        checks.check_version("0.8.5", "==0.9.1")


def test_the_server_refuses_a_request_it_cannot_score():
    with pytest.raises(ValueError, match="repetition_penalty"):
        checks.check_sampling(1.0, -1, repetition_penalty=1.1)


def test_the_audit_counts_differing_response_tokens():
    old = torch.tensor([[0.5, -1.0, 7.0], [-2.0, -3.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert audit.differing_tokens(old, old.clone(), mask) == (0, 0.0)
    other = old.clone()
    other[1, 1] = -3.25
    other[0, 2] = 0.0  # outside the mask: not counted
    assert audit.differing_tokens(old, other, mask) == (1, 0.25)


def test_the_launcher_checks_every_mismatch_metric(tmp_path):
    rows = [{"step": 1, "rollout_corr/kl": 0.0}, {"step": 2, "rollout_corr/k3_kl": 1e-9}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": r["step"], "data": r}) + "\n" for r in rows)
    )
    read = run.read_metrics(tmp_path / "metrics.jsonl")
    assert run.nonzero(read) == ["step 2: rollout_corr/k3_kl = 1e-09"]
    assert "k3_kl" in run.table(read).splitlines()[0]


def _grpo(tmp_path, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "bik.verl.run", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done.returncode, done.stdout + done.stderr[-3000:]


def _learned(out) -> list[dict[str, float]]:
    """The run's metrics, checked to be a run that updated: a group whose samples all got
    one reward (identical answers, say) gives no gradient, and zero mismatch means nothing
    then."""
    rows = run.read_metrics(out / "metrics.jsonl")
    assert all(row["actor/grad_norm"] > 0 for row in rows), rows
    return rows


@pytest.mark.slow
def test_a_verl_grpo_run_logs_zero_mismatch_with_bik_and_not_without(tmp_path):
    code, out = _grpo(tmp_path / "bik")
    assert code == 0, out
    assert "bik: 0 non-zero mismatch metric values over 2 steps" in out
    _learned(tmp_path / "bik")
    code, out = _grpo(tmp_path / "native", "--native")
    assert code == 0, out
    assert "native control: 0 non-zero" not in out


@pytest.mark.slow
def test_a_bypass_run_is_audited_and_exact(tmp_path):
    code, out = _grpo(tmp_path, "--bypass", "--audit-every", "2", "--steps", "2")
    assert code == 0, out
    rows = _learned(tmp_path)
    assert [row.get("audit/differing_tokens") for row in rows] == [None, 0.0]
