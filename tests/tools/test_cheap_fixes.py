"""benchmarks/cheap_fixes.py on a tiny preset: every setup scores the same tokens both ways,
bik's rows are exactly 0, the decode pass reproduces the sampler's own log-probs, and the
table is written."""

import benchmark_scripts
import pytest
import torch

from bik import testing
from bik.testing import rollouts


def _script():
    return benchmark_scripts.load("cheap_fixes")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3_next", "tiny-nemotron_h"])
def test_the_decode_pass_is_the_samplers_own_computation(preset):
    """rollouts.decode_logprobs feeds the sampled tokens back as generate did: on a patched model
    its log-probs equal the sampler's bit for bit (so every setup's rollout side is the engine's).
    The hybrids' recurrent layers need a cache built for them (issue 72, item 8: a crash)."""
    model = testing.load_model(preset)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12])]
    with rollouts.patched(model, True):
        rollout = rollouts.sample(model, prompts, 6, seed=0, pad=0)
        assert torch.equal(rollouts.decode_logprobs(model, rollout), rollout.logprobs)


def test_every_setup_is_measured_and_bik_is_exact(tmp_path, capsys):
    cheap = _script()
    out = tmp_path / "table.md"
    argv = ["--model", "tiny-llama", "--rows", "3", "--tokens", "5", "--markdown", str(out)]
    assert cheap.main(argv) == 0
    record = cheap.run("tiny-llama", rows=3, tokens=5, seed=0)
    for name in ("bik bf16", "bik fp32"):
        assert record["results"][name]["unequal"] == 0.0
        assert record["results"][name]["max_abs"] == 0.0
    assert set(record["results"]) == {*cheap.SETUPS, cheap.IS_ROW}
    text = out.read_text()
    assert "| bik fp32 | 0.0 % | 0.0 % | 0 | 0.0 % | - |" in text
    assert "| plain bf16 + token IS (cap 2) |" in text


def test_the_fp32_head_leaves_a_tied_embedding_in_the_models_dtype():
    """SmolLM2 ties its LM head to the embedding: casting the head must not cast the
    embedding (the layers would get fp32 inputs beside bf16 weights)."""
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    config = FAMILIES["llama"].tiny_config(tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with rollouts.fp32_head(model, True), torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
        assert logits.dtype == torch.float32
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again after
