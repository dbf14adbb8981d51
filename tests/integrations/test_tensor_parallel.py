"""The sharded trainer: bik.distributed.tensor_parallel(model, mesh) on tiny random Llama and
Qwen3 models (16 query / 8 KV heads), a left-padded batch of 4 rows, fp32 and bf16.

  forward    the logits on every rank == the one-process model patched with
             tp_invariant=True, bit for bit: TP 2 on 2 gloo processes, TP 2, 4 and 8 as threads
             of one process (torch's in-process process group), TP 4 and 8 on 8 gloo
             processes (slow)
  backward   a rerun gives the same gradient bits, every rank the same full gradient; it equals
             the one-process gradient within a float tolerance (not bit for bit)
  control    torch's own plan (ColwiseParallel / RowwiseParallel, the K partials all-reduced)
             on the unpatched model gives other logits than the unpatched model in one
             process: in bf16 at TP 2, 4 and 8, in fp32 at one of them at least
  families   the other families it accepts: the fp32 forward at TP 8 (threads)
  FSDP x TP  FSDP2 over the data-parallel dim of a 2 x 2 mesh, TP over the other (threads):
             each row's log-probs bit for bit, deterministic gradients close to one process
The layer-level order is tested in test_distributed_tp.py.
"""

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise, randn
from hypothesis import given
from hypothesis import strategies as st

import bik
from bik.distributed import tensor_parallel

DTYPES = [torch.float32, torch.bfloat16]
CONFIGS = [(family, dtype) for family in worker.TP_FAMILIES for dtype in DTYPES]
IDS = [f"{family}-{str(dtype).removeprefix('torch.')}" for family, dtype in CONFIGS]
# Gradients against the one-process ones: |difference| <= tolerance x the parameter's largest
# gradient entry (observed: 7.8e-7 in fp32, 9.7e-3 in bf16, where every rank's share of a sum
# over heads or MLP columns is rounded to bf16 before the ranks' shares are added).
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    m=st.integers(1, 9),
    n_per_rank=st.integers(1, 12),
    k=st.integers(1, 70),
    bias=st.booleans(),
)
def test_a_column_shard_is_columns_of_the_whole(dtype, m, n_per_rank, k, bias):
    """What column-parallel layers rely on: bik.linear's reduction over K for an output
    element does not depend on the other rows of the weight (N)."""
    n = 8 * n_per_rank
    x, weight = randn((m, k), dtype, seed=1), randn((n, k), dtype, seed=2)
    b = randn((n,), dtype, seed=3) if bias else None
    whole = bik.linear(x, weight, b)
    for degree in (2, 4, 8):
        step = n // degree
        for r in range(degree):
            rows = slice(r * step, (r + 1) * step)
            shard = bik.linear(x, weight[rows], None if b is None else b[rows])
            assert_bitwise(shard, whole[:, rows], f"TP {degree} rank {r}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_attention_on_a_rank_s_heads_is_those_heads_of_the_whole(dtype):
    """What whole-head attention relies on (GQA 16/8 heads, left padding)."""
    q, k, v = (randn((3, heads, 21, 16), dtype, seed=s) for s, heads in ((1, 16), (2, 8), (3, 8)))
    kv_start = torch.tensor([0, 5, 17], dtype=torch.int32, device=q.device)
    whole = bik.attention(q, k, v, kv_start=kv_start)
    for degree in (2, 4, 8):
        qs, ks = 16 // degree, 8 // degree
        for r in range(degree):
            q_heads, kv_heads = slice(r * qs, (r + 1) * qs), slice(r * ks, (r + 1) * ks)
            part = bik.attention(q[:, q_heads], k[:, kv_heads], v[:, kv_heads], kv_start=kv_start)
            assert_bitwise(part, whole[:, q_heads], f"TP {degree} rank {r}")


def _one_process(family, dtype):
    """The one-process trainer's logits and gradients."""
    model = worker.tp_model(family, dtype)
    with torch.no_grad():
        logits = worker.tp_logits(model)
    worker.loss(model, worker.ROWS).backward()
    return logits, {name: p.grad for name, p in model.named_parameters()}


def _assert_grads_close(got, expected, dtype, what):
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        scale = expected[name].float().abs().max()
        worst = (grad.float() - expected[name].float()).abs().max()
        assert worst <= GRAD_TOLERANCE[dtype] * scale, f"{what} {name}: {worst} vs {scale}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each of 2 gloo ranks computed at TP 2 (distributed_worker.run_tensor_parallel_rank)."""
    return worker.spawn_tensor_parallel(2, str(tmp_path_factory.mktemp("tp2")), (2,))


@pytest.mark.parametrize(("family", "dtype"), CONFIGS, ids=IDS)
def test_two_ranks_give_the_one_process_logits_and_close_gradients(two_ranks, family, dtype):
    logits, grads = _one_process(family, dtype)
    first = two_ranks[0]["grads", family, dtype, 2][0]
    for rank, result in enumerate(two_ranks):
        assert_bitwise(result["logits", family, dtype, 2], logits, f"rank {rank} logits")
        run, rerun = result["grads", family, dtype, 2]
        for name, grad in run.items():
            assert_bitwise(rerun[name], grad, f"rank {rank} {name}: rerun")
            assert_bitwise(grad, first[name], f"rank {rank} {name}: against rank 0")
        _assert_grads_close(run, grads, dtype, f"rank {rank}")


def _plain_logits(family, dtype):
    """The unpatched model's logits in one process, then under torch's ColwiseParallel /
    RowwiseParallel plan at TP 2 (the gloo ranks' fixture supplies it), 4 and 8 (threads):
    each rank's partial over its share of K, all-reduced."""
    with torch.no_grad():
        one = worker.tp_logits(worker.tp_model(family, dtype, tp_invariant=None))

    def rank_main(degree, rank):
        from torch.distributed.device_mesh import init_device_mesh

        return worker.plain_tp_logits(family, dtype, init_device_mesh("cpu", (degree,)))

    sharded = {d: worker.run_threads(d, lambda rank, d=d: rank_main(d, rank)) for d in (4, 8)}
    return one, sharded


@pytest.mark.parametrize("family", worker.TP_FAMILIES)
def test_plain_tensor_parallel_changes_the_bf16_logits_at_every_degree(two_ranks, family):
    """Negative control, on every machine: in bf16 each rank's partial is rounded to bf16
    before the all-reduce adds them (one rounding per rank and per sum, against one rounding
    of an fp32 accumulator in one process), whatever order the CPU's GEMM sums K in."""
    one, sharded = _plain_logits(family, torch.bfloat16)
    sharded[2] = [result["plain", family, torch.bfloat16] for result in two_ranks]
    for degree, ranks in sharded.items():
        for rank, logits in enumerate(ranks):
            assert not torch.equal(logits, one), f"TP {degree} rank {rank}"


@pytest.mark.parametrize("family", worker.TP_FAMILIES)
def test_plain_tensor_parallel_changes_the_fp32_logits(two_ranks, family):
    """Negative control in fp32, asserted over the degrees: the plain form is exact at one
    degree when the CPU's GEMM happens to cut K where the ranks do. MKL cuts K into equal
    blocks and adds their partials in order, so two blocks of K / 2 are exactly TP 2's two
    partials added: measured for one layer (M = 44, N = 128) at K = 512 on an AVX-512 Xeon and
    at K = 384 and 512 under MKL's AVX2 path; on an AMD Zen 4 this model (K = 256) gave the
    one-process logits at TP 2. So no single degree is asserted: at least one of TP 2, 4 and 8
    must move every rank's logits."""
    one, sharded = _plain_logits(family, torch.float32)
    sharded[2] = [result["plain", family, torch.float32] for result in two_ranks]
    moved = {d: [not torch.equal(logits, one) for logits in ranks] for d, ranks in sharded.items()}
    assert any(all(ranks) for ranks in moved.values()), f"no degree moved every rank: {moved}"


def _sharded(models, degree):
    """Rank r of ``degree`` threads shards ``models[r]`` and returns its logits and gradients.
    The models are built beforehand: threads would draw their weights from one global RNG."""
    from torch.distributed.device_mesh import init_device_mesh

    def rank_main(rank):
        model = tensor_parallel(models[rank], init_device_mesh("cpu", (degree,)))
        with torch.no_grad():
            logits = worker.tp_logits(model)
        worker.loss(model, worker.ROWS).backward()
        return logits, worker._grads(model)

    return worker.run_threads(degree, rank_main)


@pytest.mark.parametrize(("family", "dtype"), CONFIGS, ids=IDS)
def test_every_degree_emulated_gives_the_one_process_logits(family, dtype):
    logits, grads = _one_process(family, dtype)
    for degree in (2, 4, 8):
        results = _sharded([worker.tp_model(family, dtype) for _ in range(degree)], degree)
        for rank, (got, got_grads) in enumerate(results):
            assert_bitwise(got, logits, f"TP {degree} rank {rank}")
            for name, grad in got_grads.items():
                assert_bitwise(grad, results[0][1][name], f"TP {degree} rank {rank} {name}")
        _assert_grads_close(results[0][1], grads, dtype, f"TP {degree}")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma", "gemma2", "gemma3_text"])
def test_the_other_splittable_families_at_tp_8(family):
    """The forward of every other family tensor_parallel accepts (Qwen2: biased q/k/v, split
    with their rows; Gemma: scaled embeddings, (1 + w) norms, soft-capping), 8 threads."""
    with torch.no_grad():
        expected = worker.tp_logits(worker.tp_model(family, torch.float32))
    models = [worker.tp_model(family, torch.float32) for _ in range(8)]
    for rank, (logits, _) in enumerate(_sharded(models, 8)):
        assert_bitwise(logits, expected, f"{family} rank {rank}")


@pytest.mark.slow  # 4 processes on 2 cores; the threads above run degrees 4 and 8 too
def test_four_gloo_ranks(tmp_path):
    results = worker.spawn_tensor_parallel(4, str(tmp_path), (4,))
    for family, dtype in CONFIGS:
        logits, grads = _one_process(family, dtype)
        for rank, result in enumerate(results):
            assert_bitwise(result["logits", family, dtype, 4], logits, f"rank {rank}")
        run, rerun = results[0]["grads", family, dtype, 4]
        for name, grad in run.items():
            assert_bitwise(rerun[name], grad, f"TP 4 {name}: rerun")
        _assert_grads_close(run, grads, dtype, "TP 4")


@pytest.mark.parametrize(("family", "dtype"), CONFIGS, ids=IDS)
def test_fsdp_over_tensor_parallel_on_a_2d_mesh(family, dtype):
    """4 ranks as threads, a (2 data-parallel) x (2 tensor-parallel) mesh: each TP pair shards
    a model, FSDP2 shards it again over the data-parallel dim, and each data-parallel rank
    takes its half of the rows. A row's log-probs equal the one-process model's bit for bit;
    the gradient (FSDP's reduce-scatter of two per-rank gradients) is the same on every rank
    and in a rerun, and close to the one-process gradient of the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    one = worker.tp_model(family, dtype)
    with torch.no_grad():
        expected = worker.logprobs(one, worker.ROWS)
    _, grads = _one_process(family, dtype)
    models = [worker.tp_model(family, dtype) for _ in range(4)]  # one seed, not one per thread

    def rank_main(rank):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = tensor_parallel(models[rank], mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        rows = worker.rows_of(mesh["dp"].get_local_rank(), 2)
        with torch.no_grad():
            logprobs = worker.logprobs(model, rows)
        runs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            worker.loss(model, rows, world=2).backward()
            runs.append(worker._grads(model))
        return mesh["dp"].get_local_rank(), logprobs, runs

    results = worker.run_threads(4, rank_main)
    for rank, (dp_rank, logprobs, (run, rerun)) in enumerate(results):
        for row, logp in zip(range(dp_rank, len(worker.ROWS), 2), logprobs):
            assert_bitwise(logp, expected[row], f"rank {rank} row {row}")
        for name, grad in run.items():
            assert_bitwise(rerun[name], grad, f"rank {rank} {name}: rerun")
            assert_bitwise(grad, results[0][2][0][name], f"rank {rank} {name}: against rank 0")
    _assert_grads_close(results[0][2][0], grads, dtype, "FSDP x TP")


def _refusal(model, degree=2, shape=None):
    """The error every one of ``degree`` ranks raises for ``tensor_parallel(model, mesh)``."""
    from torch.distributed.device_mesh import init_device_mesh

    def rank_main(rank):
        tensor_parallel(model, init_device_mesh("cpu", shape or (degree,)))

    worker.run_threads(degree, rank_main)


def _tiny(family="qwen3", tp_invariant=True, **overrides):
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    model = AutoModelForCausalLM.from_config(FAMILIES[family].tiny_config(**overrides))
    if tp_invariant is not None:
        bik.patch_model(model, backend="cpu", tp_invariant=tp_invariant)
    return model


def test_refuses_what_it_cannot_shard_exactly():
    with pytest.raises(ValueError, match=r"^model: expected .* tp_invariant=True\), got an unp"):
        _refusal(_tiny(tp_invariant=None))
    with pytest.raises(ValueError, match=r"^model: expected a model patched with .* without it"):
        _refusal(_tiny(tp_invariant=False))
    with pytest.raises(ValueError, match=r"^model: 'qwen3_moe' is a mixture-of-experts model"):
        _refusal(_tiny("qwen3_moe", tp_invariant=False))
    with pytest.raises(ValueError, match=r"^model: a 'phi3' model cannot be sharded .* fused"):
        _refusal(_tiny("phi3"))
    with pytest.raises(ValueError, match=r"^model: a 'olmo2' model .* all heads"):
        _refusal(_tiny("olmo2"))
    with pytest.raises(ValueError, match=r"^mesh: expected a 1-D DeviceMesh .*, got str$"):
        tensor_parallel(_tiny(), "cpu")
    with pytest.raises(ValueError, match=r"^mesh: expected a 1-D DeviceMesh .*, got \(2, 2\)$"):
        _refusal(_tiny(), 4, (2, 2))
    with pytest.raises(ValueError, match=r"^mesh: expected a TP degree dividing .* 3 ranks$"):
        _refusal(_tiny(), 3)
    with pytest.raises(ValueError, match=r"^mesh: a TP degree of 4 does not divide .* = 2 \("):
        _refusal(_tiny(), 4)  # the tiny preset's 4 query / 2 KV heads
    model = _tiny()
    _refusal(model, 1)  # TP 1: sharded (one rank holds everything)
    with pytest.raises(RuntimeError, match=r"^model: already sharded by bik"):
        _refusal(model, 1)
