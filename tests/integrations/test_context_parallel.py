"""Context parallelism: bik.distributed.context_parallel(model) splits one sequence across
ranks (torch's in-process process group, a thread per rank), each rank its contiguous
positions; attention gathers the keys of the ranks before it.

  forward    each rank's logits == the one-process logits of its positions, bit for bit: CP 2
             and 4, fp32 and bf16, dense (Qwen3), mixture of experts (Qwen3-MoE, its experts
             whole on every rank; expert parallelism under it is refused) and latent
             attention (DeepSeek-V3); CP 2 on 2 gloo processes (Qwen3)
  backward   a rerun gives the same gradient bits
  control    a ring of partial softmaxes merged by their log-sum-exp (torch's context
             parallelism) gives other bits than one attention over the whole sequence
"""

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise, randn

import bik
from bik.distributed import context_parallel, context_shard, expert_parallel

DTYPES = [torch.float32, torch.bfloat16]
IDS = torch.randint(3, 250, (3, 24), generator=torch.Generator().manual_seed(0))


def _model(family, dtype, patch=True):
    """The family's tiny random model (the same weights on every call), patched."""
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family].tiny_config()).to(dtype).eval()
    if patch:
        bik.patch_model(model, backend="cpu")
    return model


def _context_parallel(models, degree, backward=False):
    """Each rank's logits of its positions of IDS (and with ``backward`` two runs of the
    gradients of their sum of squares)."""

    def rank_main(rank):
        model = models[rank]
        ids, positions = context_shard(IDS)
        with context_parallel(model), torch.no_grad():
            logits = model(ids, position_ids=positions, use_cache=False).logits
        grads = []
        for _ in range(2 if backward else 0):
            model.zero_grad(set_to_none=True)
            with context_parallel(model):
                out = model(ids, position_ids=positions, use_cache=False).logits
            out.float().square().sum().backward()
            grads.append({n: worker._full(p.grad) for n, p in model.named_parameters()})
        return logits, grads

    return worker.run_threads(degree, rank_main)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_each_rank_gets_the_one_process_logits_of_its_positions(family, dtype):
    with torch.no_grad():
        one = _model(family, dtype)(IDS, use_cache=False).logits
    for degree in (2, 4):
        models = [_model(family, dtype) for _ in range(degree)]
        step = IDS.shape[1] // degree
        for rank, (logits, _) in enumerate(_context_parallel(models, degree)):
            expected = one[:, rank * step : (rank + 1) * step]
            assert_bitwise(logits, expected, f"CP {degree} rank {rank}")


def test_two_gloo_processes_give_the_one_process_logits(tmp_path):
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    ranks = worker.spawn_context_parallel(2, str(tmp_path))
    for dtype in DTYPES:
        with torch.no_grad():
            one = worker.tp_model("qwen3", dtype, tp_invariant=False)(ids, use_cache=False).logits
        for rank, result in enumerate(ranks):
            expected = one[:, rank * 8 : (rank + 1) * 8]
            assert_bitwise(result[dtype], expected, f"CP 2 gloo rank {rank} {dtype}")


def test_gradients_rerun_to_the_same_bits():
    models = [_model("qwen3", torch.float32) for _ in range(2)]
    for rank, (_, (run, rerun)) in enumerate(_context_parallel(models, 2, backward=True)):
        assert run and all(g is not None for g in run.values())
        for name, grad in run.items():
            assert_bitwise(rerun[name], grad, f"rank {rank} {name}: rerun")


def _ring_attention(q, k, v, chunks):
    """torch's context parallelism in one process: the queries of each chunk attend to each
    earlier-or-own chunk of keys separately (causal within their own), and the partial
    outputs are merged by their log-sum-exp."""
    length = q.shape[2] // chunks
    scale = q.shape[-1] ** -0.5
    outs = []
    for r in range(chunks):
        qr = q[:, :, r * length : (r + 1) * length]
        merged, lse = None, None
        for j in range(r + 1):
            kj, vj = (t[:, :, j * length : (j + 1) * length] for t in (k, v))
            scores = (qr @ kj.transpose(-1, -2)) * scale
            if j == r:
                scores = scores.masked_fill(
                    torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf
                )
            part_lse = torch.logsumexp(scores, -1, keepdim=True)
            part = torch.softmax(scores, -1) @ vj
            if merged is None:
                merged, lse = part, part_lse
            else:
                total = torch.logaddexp(lse, part_lse)
                merged = merged * (lse - total).exp() + part * (part_lse - total).exp()
                lse = total
        outs.append(merged)
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_negative_control_ring_attention_changes_the_bits(dtype):
    q, k, v = (randn((2, 4, 64, 32), dtype, seed) for seed in (1, 2, 3))
    whole = _ring_attention(q, k, v, 1)  # one chunk: the plain softmax attention
    for chunks in (2, 4):
        assert not torch.equal(_ring_attention(q, k, v, chunks), whole), f"{chunks} chunks"
    # bik's: the same bits whoever holds the queries (the rank's chunk, its keys before it)
    out = bik.attention(q, k, v, causal=True)
    for r in range(4):
        rows = slice(r * 16, (r + 1) * 16)
        part = bik.attention(
            q[:, :, rows].to(dtype),
            k[:, :, : rows.stop].to(dtype),
            v[:, :, : rows.stop].to(dtype),
            causal=True,
        )
        assert_bitwise(part, out[:, :, rows], f"queries of chunk {r}")


def test_refusals():
    model = _model("qwen3", torch.float32)

    unpatched = _model("qwen3", torch.float32, patch=False)
    moe = [_model("qwen3_moe", torch.float32) for _ in range(2)]

    def rank_main(rank):
        from torch.distributed.device_mesh import init_device_mesh

        with pytest.raises(ValueError, match="expected a Hugging Face causal LM patched"):
            context_parallel(unpatched).__enter__()
        ids, positions = context_shard(IDS)
        expert_parallel(moe[rank], init_device_mesh("cpu", (2,)))
        with context_parallel(moe[rank]), pytest.raises(NotImplementedError, match="same tokens"):
            moe[rank](ids, position_ids=positions, use_cache=False)
        # numbered from 1: every rank refuses (a rank that accepted would wait in the gather)
        with context_parallel(model), pytest.raises(ValueError, match="pass them as position_ids"):
            model(ids, position_ids=positions + 1, use_cache=False)
        with pytest.raises(ValueError, match="S a multiple of the 2 ranks"):
            context_shard(IDS[:, :23])
        padded = torch.ones_like(ids)
        padded[0, 0] = 0
        with context_parallel(model), pytest.raises(ValueError, match="unpadded rows"):
            model(ids, attention_mask=padded, position_ids=positions, use_cache=False)

    worker.run_threads(2, rank_main)


@pytest.mark.parametrize(
    ("family", "why"),
    [("qwen3_next", "has recurrent layers"), ("mistral", "has a sliding window")],
)
def test_models_whose_layers_see_the_whole_sequence_are_refused(family, why):
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    config = FAMILIES[family].tiny_config(**({"sliding_window": 16} if family == "mistral" else {}))
    model = AutoModelForCausalLM.from_config(config)
    bik.patch_model(model, backend="cpu")
    with pytest.raises(ValueError, match=f"'{family}' {why}"), context_parallel(model):
        pass
