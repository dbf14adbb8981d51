"""A patched model under torch.distributed (gloo, 2 processes): FSDP2 and DDP, fp32 and bf16.

One process group runs every configuration (tests/support/distributed_worker.py; ~15 s on 2 cores,
mostly imports) and the tests below read its results:
  forward     each rank's rows == the same rows through the unsharded single-process model
  weights     what FSDP all-gathers into the patched modules == the master weights (cast)
  backward    a rerun gives the same gradient bits, and the gradient equals the single-process
              emulation of data parallelism (each rank's local gradient, summed in rank order);
              a full-batch single-process gradient differs: gradients depend on world size
  checkpoint  a DCP checkpoint saved at world size 2 after an AdamW step, loaded in one process,
              gives the ranks' forward bits; the step itself equals its emulation
"""

import functools

import distributed_worker as worker
import pytest
import torch
from helpers import assert_bitwise

import bik

WORLD = 2
CONFIGS = [
    ("fsdp", torch.float32),
    ("fsdp", torch.bfloat16),  # MixedPrecisionPolicy: bf16 compute, fp32 master and reduce
    ("ddp", torch.float32),
    ("ddp", torch.bfloat16),  # the whole model in bf16, gradients all-reduced in bf16
]
FSDP = [c for c in CONFIGS if c[0] == "fsdp"]
# FSDP reduces gradients in fp32 (MixedPrecisionPolicy.reduce_dtype); DDP in the grads' dtype.
REDUCE_DTYPE = {"fsdp": lambda dtype: torch.float32, "ddp": lambda dtype: dtype}


def _ids(configs):
    return [f"{wrapper}-{str(dtype).removeprefix('torch.')}" for wrapper, dtype in configs]


class _Runs:
    """Every config's results, from one spawn."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.ranks = worker.spawn(WORLD, out_dir, CONFIGS)

    def results(self, wrapper, dtype):
        """Each rank's results for one config."""
        return [rank[wrapper, dtype] for rank in self.ranks]

    def checkpoint(self, wrapper, dtype):
        return worker.checkpoint_dir(self.out_dir, wrapper, dtype)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _Runs(str(tmp_path_factory.mktemp("distributed")))


@functools.cache
def _emulated(dtype, reduce_dtype):
    return worker.emulate_step(dtype, WORLD, reduce_dtype)


def _single_process_logprobs(model):
    with torch.no_grad():
        return worker.logprobs(model, worker.ROWS)


@pytest.mark.parametrize(("wrapper", "dtype"), CONFIGS, ids=_ids(CONFIGS))
def test_forward_matches_single_process(runs, wrapper, dtype):
    results = runs.results(wrapper, dtype)
    expected = _single_process_logprobs(worker.single_process_model(dtype))
    for rank, result in enumerate(results):
        indices = range(rank, len(worker.ROWS), WORLD)
        assert len(result["forward"]) == len(indices)
        for row, logp in zip(indices, result["forward"]):
            assert_bitwise(logp, expected[row], f"{wrapper} {dtype} rank {rank} row {row}")


@pytest.mark.parametrize(("wrapper", "dtype"), FSDP, ids=_ids(FSDP))
def test_fsdp_gathers_the_master_weights_exactly(runs, wrapper, dtype):
    """The weights bik's kernels read inside the FSDP forward are a plain ``.to(dtype)`` of
    the fp32 master weights (the unsharded model's)."""
    results = runs.results(wrapper, dtype)
    master = dict(worker.testing.load_model(worker.MODEL).named_parameters())
    for rank, result in enumerate(results):
        seen = result["weights"]
        assert seen.keys() == master.keys()  # every weight was read by some forward
        for name, weight in seen.items():
            assert_bitwise(weight, master[name].detach().to(dtype), f"rank {rank} {name}")


@pytest.mark.parametrize(("wrapper", "dtype"), CONFIGS, ids=_ids(CONFIGS))
def test_backward_is_the_data_parallel_sum_and_reruns_agree(runs, wrapper, dtype):
    results = runs.results(wrapper, dtype)
    reduce_dtype = REDUCE_DTYPE[wrapper](dtype)
    emulated = _emulated(dtype, reduce_dtype)
    for rank, result in enumerate(results):
        first, rerun = result["grads"]
        assert first.keys() == emulated.keys()
        for name, grad in first.items():
            assert_bitwise(rerun[name], grad, f"rank {rank} {name}: rerun")
            assert_bitwise(grad, emulated[name], f"rank {rank} {name}: vs emulation")

    # Not promised: the world size. One process on the whole batch reduces each weight
    # gradient over all tokens in one order, not as two per-rank sums: other bits.
    model = worker.single_process_model(dtype)
    worker.loss(model, worker.ROWS).backward()
    differs = [
        name
        for name, p in model.named_parameters()
        if not torch.equal(p.grad.to(reduce_dtype), emulated[name])
    ]
    assert differs, "the full-batch gradient was expected to differ from the 2-rank one"


@pytest.mark.parametrize(("wrapper", "dtype"), FSDP, ids=_ids(FSDP))
def test_checkpoint_saved_at_two_ranks_loads_at_one(runs, wrapper, dtype):
    results = runs.results(wrapper, dtype)
    model = worker.load_checkpoint(runs.checkpoint(wrapper, dtype))
    for p in model.parameters():  # as FSDP's MixedPrecisionPolicy casts for the forward
        p.data = p.data.to(dtype)
    bik.patch_model(model)
    expected = _single_process_logprobs(model)
    for rank, result in enumerate(results):
        for row, logp in zip(range(rank, len(worker.ROWS), WORLD), result["after_step"]):
            assert_bitwise(logp, expected[row], f"rank {rank} row {row} after the step")


@pytest.mark.parametrize(("wrapper", "dtype"), FSDP, ids=_ids(FSDP))
def test_sharded_step_equals_single_process_emulation(runs, wrapper, dtype):
    """AdamW on the FSDP shards (fp32 master weights) gives the weights that AdamW on the
    unsharded model gives from the emulated data-parallel gradient."""
    saved = worker.load_checkpoint(runs.checkpoint(wrapper, dtype)).state_dict()
    model = worker.testing.load_model(worker.MODEL)
    grads = _emulated(dtype, torch.float32)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    torch.optim.AdamW(model.parameters(), lr=worker.LR).step()
    for name, p in model.named_parameters():
        assert_bitwise(p.detach(), saved[name], name)
