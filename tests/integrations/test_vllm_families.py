"""The 2026 families in bik's vLLM engine: gpt-oss (sinks, sliding windows, YaRN, biased
experts), the hybrids Qwen3-Next (Gated DeltaNet) and Nemotron-H (Mamba2), DeepSeek-V3's latent
attention, and OLMo-3 and SmolLM3 through vLLM's Transformers backend. Each case: the log-probs
vLLM returns equal bik.token_logprobs of the bik-patched Hugging Face model, bit for bit, under
test_vllm.py's scheduling (continuous batching past max_num_seqs, 32-token prefill chunks,
prefix caching where vLLM allows it, n = 2). And the vLLM column of the family table
(bik.families, docs/vllm.md) claims no dtype that no test checks.

Native vLLM's counts on the same runs (it differs) are in docs/vllm.md; its CPU kernels need
wider heads than these tiny presets, so they are not a test here.
"""

import gc
import re

import pytest
import torch
from test_vllm import (
    CASES,
    FAMILY_OVERRIDES,
    SCHEDULING,
    assert_engine_equals_the_trainer,
    prompts,
    run_engine,
    saved_models,
    trainer_logprobs,
    vllm,  # imported after the engine settings test_vllm puts in the environment
)
from transformers import AutoModelForCausalLM

from bik.families import FAMILIES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_models(tmp_path_factory)


FAMILY_CASES = [
    # gpt-oss: attention sinks, a sliding window of 8 on every other layer (the prompts
    # outgrow it, so decode steps read through pages the window has left), YaRN RoPE, a
    # biased router, biased experts with the clamped SwiGLU at the config's limit
    ("gpt_oss", "float32", "raw_logprobs", 1.0),
    ("gpt_oss", "bfloat16", "processed_logprobs", 0.7),
    # Qwen3-Next: Gated DeltaNet layers (bik.vllm.gdn: the convolution and the rule from the
    # pooled fp32 state, resumed across the 32-token prefill chunks) beside gated attention,
    # Gemma-style norms, MoE layers with a gated shared expert
    ("qwen3_next", "float32", "raw_logprobs", 1.0),
    ("qwen3_next", "bfloat16", "raw_logprobs", 1.0),
    # Nemotron-H: Mamba2 mixers (bik.vllm.mamba2: the convolution with its bias, the selective
    # scan from the pooled fp32 state, the gated group norm on the scan's fp32 output),
    # attention without RoPE, squared-ReLU MLPs
    ("nemotron_h", "float32", "raw_logprobs", 1.0),
    ("nemotron_h", "bfloat16", "raw_logprobs", 1.0),
    # DeepSeek-V3: latent attention in the trainer's non-absorbed form over vLLM's latent
    # cache (bik.vllm.mla), interleaved RoPE laid out as transformers lays it out, the sigmoid
    # group-limited router; vLLM's CPU MLA cache holds 512 + 64 latent dims, vLLM reads the
    # router's kind from topk_method and scoring_func, which transformers does not
    ("deepseek_v3", "float32", "raw_logprobs", 1.0),
    ("deepseek_v3", "bfloat16", "raw_logprobs", 1.0),
]


@pytest.mark.parametrize(("family", "dtype", "mode", "temperature"), FAMILY_CASES)
def test_vllm_logprobs_equal_the_trainers(model_dir, family, dtype, mode, temperature):
    assert_engine_equals_the_trainer(model_dir, family, dtype, mode, temperature)


# DeepSeek-V3 and Kimi K2 checkpoints ship YaRN RoPE with both mscales: vLLM's DeepSeek YaRN
# layer gets transformers' frequencies and cos/sin scale (bik.vllm.layers), and both sides
# scale the softmax by mscale squared, by one formula.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def test_deepseek_yarn_logprobs_equal_the_trainers(model_dir):
    path = model_dir("deepseek_v3", rope_parameters=DEEPSEEK_YARN)
    sequences, got = run_engine(path, "bfloat16", "raw_logprobs", 1.0)
    expected = trainer_logprobs(path, "bfloat16", sequences, 1.0)
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        unequal = (mine != theirs).sum().item()
        assert unequal == 0, f"sample {i}: {unequal} of {len(mine)} log-probs differ"


# Families vLLM runs through its Transformers backend (transformers' own modules between vLLM's
# layers; the backend's norms, activation and attention are bik's, the rotary embedding the
# trainer's forward): OLMo-2, OLMo-3 with a window of 8 on its sliding layers, SmolLM3 with a
# NoPE layer.
TRANSFORMERS_BACKEND_CASES = [
    ("olmo2", "float32", {}),
    ("olmo3", "float32", {"sliding_window": 8}),
    ("olmo3", "bfloat16", {"sliding_window": 8}),
    ("smollm3", "bfloat16", {}),
]


@pytest.mark.parametrize(("family", "dtype", "overrides"), TRANSFORMERS_BACKEND_CASES)
def test_transformers_backend_logprobs_equal_the_trainers(model_dir, family, dtype, overrides):
    """As above, the engine in a child process (bik.vllm.engine): vLLM's Transformers backend
    rewires transformers' model classes in the process that builds it, and the trainer is
    transformers' own model."""
    from bik.vllm.engine import run_engine

    path = model_dir(family, **overrides)
    sampling = dict(n=2, max_tokens=12, temperature=1.0, logprobs=0, ignore_eos=True)
    settings = {k: v for k, v in SCHEDULING.items() if k != "skip_tokenizer_init"}
    requests = prompts()
    result = run_engine(
        "bik", path, requests, dtype=dtype, backend="cpu", engine_args=settings, sampling=sampling
    )
    sequences = [(p, s["tokens"]) for p, out in zip(requests, result["outputs"]) for s in out]
    expected = trainer_logprobs(path, dtype, sequences, 1.0)
    got = [s["logprobs"] for out in result["outputs"] for s in out]
    assert sum(len(t) for _, t in sequences) == 12 * 2 * 12
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        unequal = (torch.tensor(mine, dtype=theirs.dtype) != theirs).sum().item()
        assert unequal == 0, f"sample {i}: {unequal} of {len(mine)} log-probs differ"


SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def test_the_family_tables_vllm_column_claims_only_tested_dtypes():
    tested = {(case[0], case[1]) for case in (*CASES, *FAMILY_CASES, *TRANSFORMERS_BACKEND_CASES)}
    for family in FAMILIES.values():
        claim = re.match(r"exact[^(]*\(([^);]*)", family.vllm)
        if claim is None:
            assert family.vllm.startswith("refused: "), family.model_type
            continue
        for short in claim.group(1).split(", "):
            assert (family.model_type, SHORT_DTYPES[short]) in tested, (family.model_type, short)


# The new layer kinds' own weights, pushed into a running engine (an RL weight sync): Gated
# DeltaNet's A_log, dt_bias and convolution, Mamba2's A_log (vLLM keeps -exp(A_log), computed
# by its loader), D and convolution bias, the latent attention's norms and kv_b_proj.
SYNC_CASES = [("qwen3_next", "bfloat16"), ("nemotron_h", "float32"), ("deepseek_v3", "bfloat16")]


@pytest.mark.parametrize(("family", "dtype"), SYNC_CASES)
def test_weights_pushed_into_the_engine_give_the_updated_trainers_logprobs(
    model_dir, family, dtype
):
    import bik.vllm
    from bik.contract import DTYPE_NAMES

    path = model_dir(family, **FAMILY_OVERRIDES.get(family, {}))
    llm = bik.vllm.LLM(path, backend="cpu", dtype=dtype, **SCHEDULING)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE_NAMES[dtype])
    bik.patch_model(model, backend="cpu")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "e_score_correction_bias" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.05)
    bik.vllm.update_weights(llm, model.state_dict().items())
    prompt = prompts(1)[0]
    params = vllm.SamplingParams(max_tokens=8, logprobs=0, detokenize=False)
    (out,) = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=prompt)], params)
    del llm
    gc.collect()
    tokens = list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
    assert torch.equal(got, bik.token_logprobs(logits, torch.tensor(tokens)))
