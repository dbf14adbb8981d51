"""The expert-parallel trainer: bik.distributed.expert_parallel(model, mesh) on tiny random
mixture-of-experts models (8 experts), a left-padded batch of 4 rows, fp32 and bf16.

  forward    the logits on every rank == the one-process model, bit for bit: EP 2 and 4 as
             threads of one process (torch's in-process process group; Qwen3-MoE, Mixtral,
             GLM-4.5, gpt-oss) and on 2 and 4 gloo processes (Qwen3-MoE); with
             tensor_parallel on the same mesh of 2 and 4 for attention (tp_invariant)
  backward   a rerun gives the same gradient bits, every rank the same; close to one process
  control    plain expert parallelism (transformers' experts on each rank's experts, the
             ranks' bf16 partial outputs summed) gives other logits than one process
"""

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise

import bik
from bik.distributed import expert_parallel, tensor_parallel

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")
DTYPES = [torch.float32, torch.bfloat16]


def _model(family, dtype, tp_invariant=False):
    return worker.tp_model(family, dtype, tp_invariant=tp_invariant)


def _sharded(family, dtype, degree, tp_invariant=False, with_tp=False):
    """``fn(rank)`` for run_threads: the EP-sharded model's logits and two gradient runs (the
    models built here: the threads would share torch's global generator)."""
    models = [_model(family, dtype, tp_invariant) for _ in range(degree)]

    def rank_main(rank):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (degree,))
        model = expert_parallel(models[rank], mesh)
        if with_tp:
            tensor_parallel(model, mesh)
        with torch.no_grad():
            logits = worker.tp_logits(model)
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            worker.loss(model, worker.ROWS).backward()
            grads.append({n: worker._full(p.grad) for n, p in model.named_parameters()})
        return logits, grads

    return rank_main


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_logits_equal_one_process(family, dtype):
    with torch.no_grad():
        one = worker.tp_logits(_model(family, dtype))
    for degree in (2, 4):
        ranks = worker.run_threads(degree, _sharded(family, dtype, degree))
        for rank, (logits, (grads, rerun)) in enumerate(ranks):
            assert_bitwise(logits, one, f"EP {degree} rank {rank}")
            for name, grad in grads.items():
                assert_bitwise(rerun[name], grad, f"EP {degree} rank {rank} {name}: rerun")
                assert_bitwise(grad, ranks[0][1][0][name], f"EP {degree} rank {rank} {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_expert_and_tensor_parallel_equal_the_tp_invariant_model(dtype):
    """EP for the experts and TP for attention on one mesh of 2 and of 4 (Qwen3-MoE, 16/8
    heads), the model patched with tp_invariant=True: the one-process tp_invariant logits."""
    with torch.no_grad():
        one = worker.tp_logits(_model("qwen3_moe", dtype, tp_invariant=True))
    for degree in (2, 4):
        ranks = worker.run_threads(degree, _sharded("qwen3_moe", dtype, degree, True, True))
        for rank, (logits, _) in enumerate(ranks):
            assert_bitwise(logits, one, f"EP x TP {degree} rank {rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_give_the_one_process_logits(tmp_path, world):
    """EP 2 and 4 on gloo processes (a core shared by two ranks at 4): every rank's logits
    are the one-process model's, fp32 and bf16; the bf16 gradients of a rerun, every rank's
    the same."""
    ranks = worker.spawn_expert_parallel(world, str(tmp_path))
    for dtype in DTYPES:
        with torch.no_grad():
            one = worker.tp_logits(_model("qwen3_moe", dtype))
        for rank, result in enumerate(ranks):
            assert_bitwise(result["logits", dtype], one, f"EP {world} rank {rank} {dtype}")
    for rank, result in enumerate(ranks):
        run, rerun = result["grads"]
        for name, grad in run.items():
            assert_bitwise(rerun[name], grad, f"rank {rank} {name}: rerun")
            assert_bitwise(grad, ranks[0]["grads"][0][name], f"rank {rank} {name}: rank 0")


def test_expert_parallel_gradients_are_close_to_one_process():
    model = _model("qwen3_moe", torch.float32)
    worker.loss(model, worker.ROWS).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    (_, (grads, _)), _ = worker.run_threads(2, _sharded("qwen3_moe", torch.float32, 2))
    for name, grad in grads.items():
        scale = expected[name].abs().max()
        assert (grad - expected[name]).abs().max() <= 1e-5 * scale, name


def _plain_expert_parallel_logits(model, degree):
    """Plain expert parallelism emulated in one process: each rank runs transformers' own
    experts on its block of experts (the others' weights zeroed, so they add nothing), and
    the ranks' partial outputs, each in the activations' dtype, are summed."""
    for name, module in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        forward, per_rank = module.forward, module.num_experts // degree

        def plain(x, experts, weights, forward=forward, per_rank=per_rank):
            parts = []
            for rank in range(degree):
                owned = (experts >= rank * per_rank) & (experts < (rank + 1) * per_rank)
                parts.append(forward(x, experts, weights * owned))
            return sum(parts[1:], parts[0])

        module.forward = plain
    with torch.no_grad():
        return worker.tp_logits(model)


def _top4(family):
    """The unpatched tiny bf16 model with 4 experts a token (with 2, the ranks' two partials
    add in either order to the same sum)."""
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES as REGISTRY

    torch.manual_seed(0)
    config = REGISTRY[family].tiny_config(**worker.TP_HEADS, num_experts_per_tok=4)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_plain_expert_parallelism_changes_the_bf16_logits(family):
    """Negative control: the ranks' partial sums of a token's experts, added, group the
    token's expert outputs otherwise than one process's running sum."""
    with torch.no_grad():
        one = worker.tp_logits(_top4(family))
    plain = _plain_expert_parallel_logits(_top4(family), 2)
    assert not torch.equal(plain, one)
    # bik's, on the same 4-experts-a-token model: the one-process bits
    models = [_top4(family) for _ in range(3)]
    for model in models:
        bik.patch_model(model, backend="cpu")
    with torch.no_grad():
        expected = worker.tp_logits(models.pop())

    def rank_main(rank):
        from torch.distributed.device_mesh import init_device_mesh

        model = expert_parallel(models[rank], init_device_mesh("cpu", (2,)))
        with torch.no_grad():
            return worker.tp_logits(model)

    for rank, logits in enumerate(worker.run_threads(2, rank_main)):
        assert_bitwise(logits, expected, f"bik EP 2 rank {rank}")


def test_expert_parallel_refusals():
    from torch.distributed.device_mesh import init_device_mesh

    models = [
        (worker.tp_model("qwen3", torch.float32), _model("qwen3_moe", torch.float32, None))
        for _ in range(2)
    ]
    sharded = [_model("qwen3_moe", torch.float32) for _ in range(3)]

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2,))
        dense, unpatched = models[rank]
        with pytest.raises(ValueError, match="expected a mixture-of-experts model patched"):
            expert_parallel(dense, mesh)
        with pytest.raises(ValueError, match="got an unpatched 'qwen3_moe'"):
            expert_parallel(unpatched, mesh)
        with pytest.raises(ValueError, match=r"shard its experts with bik\.distributed"):
            tensor_parallel(sharded[rank], mesh)
        model = expert_parallel(sharded[rank], mesh)
        with pytest.raises(RuntimeError, match="already sharded"):
            expert_parallel(model, mesh)

    worker.run_threads(2, rank_main)
    three = [_model("qwen3_moe", torch.float32) for _ in range(3)]

    def rank_of_three(rank):
        mesh = init_device_mesh("cpu", (3,))
        with pytest.raises(ValueError, match=r"3 expert-parallel ranks do not divide .* 8 experts"):
            expert_parallel(three[rank], mesh)

    worker.run_threads(3, rank_of_three)
