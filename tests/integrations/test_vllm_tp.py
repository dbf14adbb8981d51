"""bik inside vLLM under tensor parallelism: with ``tp_invariant=True`` the log-probs vLLM
returns at TP 1 and TP 2 equal ``bik.token_logprobs`` of the Hugging Face model patched with
``bik.patch_model(model, tp_invariant=True)``, bit for bit, under vLLM's own scheduling
(continuous batching, chunked prefill, prefix caching, n = 2). Without ``tp_invariant`` a TP
degree above 1 is refused before any engine starts, and the engine settings whose reductions
bik cannot order under TP are refused when it starts.

TP 1 runs in this process; TP 2 needs vLLM's multiprocessing executor (one worker process per
rank, each bound to its own core) and runs in a child process (``bik.vllm.engine``).
The fp32 TP 2 case and the native negative control (native vLLM at TP 2 differs from the
trainer) are ``python -m bik verify --engine vllm --tp 2``, in tests/tools/test_verify_vllm.py;
TP 2 engines take a minute each to start here, so one bf16 engine checks the order and the
weight sync together.
"""

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TP 1: the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

import bik  # noqa: E402
import bik.vllm  # noqa: E402
from bik import testing  # noqa: E402
from bik.contract import DTYPE_NAMES  # noqa: E402
from bik.testing import vllm_compare  # noqa: E402
from bik.vllm import engine as vllm_engine  # noqa: E402
from bik.vllm.config import check_engine  # noqa: E402

PROMPTS, TOKENS, SAMPLES = 8, 8, 2


@pytest.fixture(autouse=True, scope="module")
def restore_bik_vllm():
    """bik.vllm.LLM selects bik's order for the whole process; later test modules get the
    default order back (conftest's restore_process_state gives back the backend)."""
    yield
    if bik.vllm.enabled() is not None:
        bik.vllm.enable(bik.vllm.enabled() or "auto")  # tp_invariant off again


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """test_vllm.py's tiny Qwen3 (hidden 96, 4/2 heads of 32, MLP 128: both row-parallel K
    divisible by 8 chunks)."""
    from test_vllm import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-tp")
    AutoModelForCausalLM.from_config(tiny_config("qwen3")).save_pretrained(path)
    return str(path)


def _request(model_dir: str, dtype: str, tensor_parallel: int) -> dict:
    prompts = testing.sample_prompts(0, PROMPTS, 512)
    settings = vllm_compare.engine_settings(PROMPTS * SAMPLES, max(map(len, prompts)) + TOKENS)
    settings.update(tensor_parallel_size=tensor_parallel, disable_custom_all_reduce=True)
    return {
        "engine": "bik",
        "model": model_dir,
        "dtype": dtype,
        "backend": "cpu",
        "tp_invariant": True,
        "engine_args": {**vllm_engine.COMMON_ARGS, **settings},
        "sampling": dict(n=SAMPLES, max_tokens=TOKENS, ignore_eos=True, logprobs=0),
        "prompts": prompts,
        "timed_runs": 0,
    }


def _assert_equals_trainer(model_dir: str, dtype: str, request: dict, result: dict) -> None:
    model = vllm_compare.load_trainer(model_dir, "cpu", DTYPE_NAMES[dtype])
    bik.patch_model(model, backend="cpu", tp_invariant=True)
    outputs = result["outputs"]
    comparison = vllm_compare.compare(
        outputs, vllm_compare.trainer_logprobs(model, request["prompts"], outputs)
    )
    assert comparison.total == PROMPTS * SAMPLES * TOKENS
    assert comparison.identical, f"{comparison.unequal} of {comparison.total} log-probs differ"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp1_equals_the_tp_invariant_trainer(model_dir, dtype):
    request = _request(model_dir, dtype, 1)
    result = vllm_engine.serve(request)  # in this process
    _assert_equals_trainer(model_dir, dtype, request, result)


def _run_tp2(
    model_dir: str, dtype: str, request: dict, multiprocessing: bool = False, **options
) -> dict:
    """The request's prompts through a TP 2 bik engine in a child process, a core per rank;
    ``multiprocessing``: its engine core in a process of its own (vLLM's default)."""
    layout = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if multiprocessing else {}
    return vllm_engine.run_engine(
        "bik",
        model_dir,
        request["prompts"],
        dtype=dtype,
        backend="cpu",
        tp_invariant=True,
        engine_args=request["engine_args"],
        sampling=request["sampling"],
        env={**vllm_engine.cpu_binding(2), **layout},
        timeout=600,
        **options,
    )


@pytest.fixture(scope="module")
def other_weights(model_dir, tmp_path_factory):
    """The same model with other random weights: what an RL step's update pushes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("qwen3-tp-updated")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.slow  # minutes (2 worker processes)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 needs a core per rank")
def test_tp2_with_pushed_weights_equals_the_tp_invariant_trainer(model_dir, other_weights):
    # A bf16 TP 2 engine, then bik.vllm.update_weights (an RL weight sync) into its two worker
    # processes: its log-probs equal the TP-invariant trainer's loaded from the pushed
    # weights, bit for bit (the TP 2 order and the sync to every rank in one engine).
    dtype = "bfloat16"
    request = _request(other_weights, dtype, 2)
    result = _run_tp2(model_dir, dtype, request, weights_from=other_weights)
    _assert_equals_trainer(other_weights, dtype, request, result)
    # and samples the tokens a TP 1 engine samples (issue 72, item 13)
    assert _tokens(result) == _tokens(vllm_engine.serve(_request(other_weights, dtype, 1)))


def _tokens(result: dict) -> list:
    return [[sample["tokens"] for sample in output] for output in result["outputs"]]


@pytest.mark.slow  # a TP 2 engine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP 2 needs a core per rank")
def test_tp2_samples_the_tokens_tp1_samples(model_dir):
    """Issue 72, item 13: one engine seed, temperature 1, the same prompts: TP 1 (in this
    process) and TP 2 (two worker processes) sample the same tokens, not only the same
    log-probs of given tokens. vLLM draws unseeded requests' noise from one process-wide
    generator, whose draws depend on the process layout; bik seeds every request
    (bik.vllm.sampler); the seeds do not depend on the dtype (fp32 here; bf16:
    test_tp2_with_pushed_weights_equals_the_tp_invariant_trainer)."""
    dtype = "float32"
    requests = []
    for tp in (1, 2):  # vLLM's default scheduling (one batch), one sample per prompt
        request = _request(model_dir, dtype, tp)
        request["engine_args"] = {
            **vllm_engine.COMMON_ARGS,
            "max_model_len": 128,
            "tensor_parallel_size": tp,
            "disable_custom_all_reduce": True,
        }
        request["sampling"] = {"max_tokens": TOKENS, "logprobs": 0}
        requests.append(request)
    tp1 = vllm_engine.serve(requests[0])
    # vLLM's default layout: the engine core in a process of its own, beside the workers
    tp2 = _run_tp2(model_dir, dtype, requests[1], multiprocessing=True)
    assert _tokens(tp2) == _tokens(tp1)


def test_tp_above_1_needs_tp_invariant(model_dir):
    with pytest.raises(ValueError, match=r"^bik\.vllm: tensor_parallel_size=2 without tp_inv"):
        bik.vllm.LLM(model_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3: the TP-invariant order runs"):
        bik.vllm.LLM(model_dir, tensor_parallel_size=3, tp_invariant=True)


def _config(**parallel):
    settings = dict(
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        disable_custom_all_reduce=True,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=True, quantization=None),
        parallel_config=SimpleNamespace(**{**settings, **parallel}),
        speculative_config=None,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        lora_config=None,
    )


def test_engine_settings_tp_cannot_order_are_refused_at_start(monkeypatch):
    monkeypatch.setattr(bik.vllm, "_tp_invariant", True)
    check_engine(_config())  # TP 2, TP-invariant: accepted
    refused = {
        "custom all-reduce": dict(disable_custom_all_reduce=False),
        "context parallelism": dict(decode_context_parallel_size=2),
        "pipeline parallelism": dict(pipeline_parallel_size=2),
        "tensor_parallel_size=16: the TP-invariant order runs": dict(tensor_parallel_size=16),
    }
    for message, setting in refused.items():
        with pytest.raises(ValueError, match=message):
            check_engine(_config(**setting))
    monkeypatch.setattr(bik.vllm, "_tp_invariant", False)  # a plugin engine without the order
    with pytest.raises(ValueError, match="tensor_parallel_size=2 without tp_invariant"):
        check_engine(_config())


def test_the_plugins_tp_variable_must_be_0_or_1(monkeypatch):
    monkeypatch.setenv(bik.vllm.TP_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"^BIK_VLLM_TP_INVARIANT='yes': expected 1 \(on\)"):
        bik.vllm.requested_tp_invariant()
    monkeypatch.setenv(bik.vllm.TP_ENV_VAR, "1")
    assert bik.vllm.requested_tp_invariant()


def test_vocab_parallel_embedding_is_exact_down_to_the_sign_of_zero(monkeypatch):
    """Two vocab shards: each rank's rows (ids it does not own filled with -0.0), added in rank
    order, are the full table's rows, -0.0 entries included; vLLM's +0.0 fill loses the sign
    (negative control)."""
    import torch.nn.functional as F

    from bik.vllm import layers

    weight = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    weight[5, 1] = weight[12, 2] = -0.0
    ids = torch.tensor([5, 12, 0, 15, 5])

    def rank(r):
        shard = SimpleNamespace(
            org_vocab_start_index=8 * r,
            org_vocab_end_index=8 * r + 8,
            num_org_vocab_padding=0,
            added_vocab_start_index=16,
            added_vocab_end_index=16,
        )
        return SimpleNamespace(
            tp_size=2,
            reduce_results=True,
            parallel_group=None,
            shard_indices=shard,
            weight=weight[8 * r : 8 * r + 8],
            quant_method=SimpleNamespace(embedding=lambda layer, i: F.embedding(i, layer.weight)),
        )

    monkeypatch.setattr(layers, "gather_tp_ranks", lambda size, rows: [rows])  # each rank alone
    local = [layers._vocab_parallel_embedding_forward(rank(r), ids) for r in (0, 1)]
    monkeypatch.setattr(layers, "gather_tp_ranks", lambda size, rows: local)  # both ranks' rows
    got, expected = layers._vocab_parallel_embedding_forward(rank(0), ids), weight[ids]
    assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())
    owner = (ids // 8).unsqueeze(-1)
    plus_zero = [rows.masked_fill(owner != r, 0.0) for r, rows in enumerate(local)]  # vLLM's
    assert not torch.equal((plus_zero[0] + plus_zero[1]).signbit(), expected.signbit())
