"""Rank processes for tests/integrations/test_distributed*.py and test_tensor_parallel.py: a
patched tiny model under FSDP2 or DDP, or sharded by tensor parallelism.

``spawn(world, out_dir, configs)`` starts ``world`` gloo processes, which run each (wrapper,
dtype) config in turn. Each rank takes its share of ROWS (rank r: rows r, r + world, ...),
left-pads it on its own, and writes to ``out_dir/rank{r}.pt``, per config:
  forward      token log-probs of its rows (no grad), one 1-D tensor per row
  weights      the weights each patched module saw inside the forward (FSDP: all-gathered)
  grads        full gradients after one backward of ``loss`` over its rows, twice (reruns)
  after_step   FSDP only: log-probs of its rows after one AdamW step; the model state is then
               saved with torch.distributed.checkpoint to ``checkpoint_dir(out_dir, ...)``
The parent compares all of it with the unsharded model in one process
(``single_process_model``, ``emulate_step``).

``spawn_tp(world, out_dir)`` runs ``run_tp_rank``: the row-parallel linear prototype of
``bik.distributed`` on each rank's K slice of ``tp_inputs``, the errors of calls whose ranks
disagree, and the plain tensor-parallel form (each rank's bik.linear partial, summed by an
all-reduce) for comparison.

``spawn_tensor_parallel(world, out_dir, degrees)`` runs ``run_tensor_parallel_rank``: tiny
models sharded by ``bik.distributed.tensor_parallel`` (logits, gradients) and torch's own plan
(the negative control). ``run_threads(world, fn)`` emulates ``world`` ranks as threads of one
process, for the TP degrees this machine has no cores for.
"""

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bik
import bik.hf
from bik import testing

MODEL = "tiny-qwen3"
PAD = 0
# Four rows of 3 to 11 tokens: rank 0 of 2 pads its rows to 6 tokens, the full batch to 11.
ROWS = [torch.arange(5 + 7 * i, 5 + 7 * i + n) % 250 + 3 for i, n in enumerate((6, 11, 3, 9))]
LR = 1e-2


def rows_of(rank: int, world: int) -> list[torch.Tensor]:
    return ROWS[rank::world]


def single_process_model(dtype: torch.dtype) -> torch.nn.Module:
    """The unsharded single-process model, patched. For bf16 only the parameters are cast, as
    FSDP's MixedPrecisionPolicy does; buffers (RoPE's inv_freq) stay fp32. ``model.to(bf16)``
    would also round inv_freq, and that changes the bits."""
    model = testing.load_model(MODEL)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    bik.patch_model(model)
    return model


def logprobs(model: torch.nn.Module, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Token log-probs of each row (every token after the first) from one left-padded batch."""
    ids, mask = bik.hf.left_pad(rows, PAD)
    out = bik.sequence_logprobs(model, ids, mask, mask)
    return [out[i, out.shape[1] - len(row) + 1 :] for i, row in enumerate(rows)]


# The log-probs the loss averages over: every token after each row's first.
TOKENS = sum(len(row) - 1 for row in ROWS)


def loss(model: torch.nn.Module, rows: list[torch.Tensor], world: int = 1) -> torch.Tensor:
    """Minus the summed token log-prob of ``rows`` over TOKENS / ``world``: one rank's loss,
    such that the ranks' mean (what DDP and FSDP average) is the full batch's mean token
    loss. Scaling by a power of two is exact, so the objective is the same at every world
    size and only the reduction order differs."""
    return -torch.cat(logprobs(model, rows)).sum() / (TOKENS / world)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p.grad).detach().clone() for name, p in model.named_parameters()}


def _record_weights(model: torch.nn.Module, seen: dict[str, torch.Tensor]) -> None:
    """Record, by parameter name, the weight each module reads when its forward runs (under
    FSDP: after the all-gather, what reaches bik's kernels and the embedding lookup)."""

    def hook(name):
        def record(module, _args):
            seen.setdefault(f"{name}.weight", module.weight.detach().clone())

        return record

    for name, module in model.named_modules():
        if "weight" in dict(module.named_parameters(recurse=False)):
            module.register_forward_pre_hook(hook(name))


def emulate_step(
    dtype: torch.dtype, world: int, reduce_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What data parallelism over ``world`` ranks computes, in one process: each rank's local
    gradient on the unsharded model, cast to ``reduce_dtype``, divided by the world size and
    summed in rank order (for two ranks any order: a sum of two is commutative).

    It runs on one thread, as each rank does: torch's own embedding backward (not a bik op)
    sums a repeated token's rows in an order that depends on the thread count on some CPUs."""
    model = single_process_model(dtype)
    total = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            loss(model, rows_of(rank, world), world).backward()
            for name, p in model.named_parameters():
                part = p.grad.to(reduce_dtype) / world
                total[name] = part if rank == 0 else total[name] + part
    finally:
        torch.set_num_threads(threads)
    return total


def _wrap(model, wrapper, dtype):
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # The gloo ranks shard on the CPU: without a mesh, fully_shard would move the model to a
    # GPU wherever one exists.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _init(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # one core per rank; bik's bits do not depend on it
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out_dir, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def checkpoint_dir(out_dir: str, wrapper: str, dtype: torch.dtype) -> str:
    return os.path.join(out_dir, f"ckpt-{wrapper}-{str(dtype).removeprefix('torch.')}")


def _run_config(rank: int, world: int, out_dir: str, wrapper: str, dtype: torch.dtype) -> dict:
    # DDP runs the model in the compute dtype; FSDP keeps fp32 master weights and casts them to
    # ``dtype`` when it gathers them.
    model = single_process_model(dtype if wrapper == "ddp" else torch.float32)
    seen = {}
    _record_weights(model, seen)
    wrapped = _wrap(model, wrapper, dtype)
    rows = rows_of(rank, world)
    result = {}
    with torch.no_grad():
        result["forward"] = logprobs(wrapped, rows)
    result["weights"] = seen
    result["grads"] = []
    for _ in range(2):  # the same step twice: a rerun must give the same gradient bits
        model.zero_grad(set_to_none=True)
        loss(wrapped, rows, world).backward()
        result["grads"].append(_grads(model))
    if wrapper == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        torch.optim.AdamW(model.parameters(), lr=LR).step()
        with torch.no_grad():
            result["after_step"] = logprobs(wrapped, rows)
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir(out_dir, wrapper, dtype))
    return result


def run_rank(rank: int, world: int, out_dir: str, configs: list[tuple[str, torch.dtype]]) -> None:
    _init(rank, world, out_dir)
    try:
        results = {config: _run_config(rank, world, out_dir, *config) for config in configs}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(world: int, out_dir: str, configs: list[tuple[str, torch.dtype]]) -> list[dict]:
    """Run every (wrapper, dtype) config on ``world`` processes (one process group: the
    imports are the slow part); returns each rank's results, keyed by config."""
    return _spawn(run_rank, "rank", world, out_dir, configs)


def _spawn(run: Any, name: str, world: int, out_dir: str, *args: Any) -> list[dict]:
    """``run(rank, world, out_dir, *args)`` on ``world`` processes; each rank's results, which
    it saved as ``out_dir/{name}{rank}.pt``."""
    mp.spawn(run, args=(world, out_dir, *args), nprocs=world)
    return [torch.load(os.path.join(out_dir, f"{name}{r}.pt")) for r in range(world)]


def load_checkpoint(path: str) -> torch.nn.Module:
    """A fresh single-process fp32 model holding the checkpoint saved at any world size."""
    import torch.distributed.checkpoint as dcp

    model = testing.load_model(MODEL)
    state = model.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state)
    return model


# -- tensor parallelism --------------------------------------------------------------------


def tp_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [6, 256], weight [48, 256], bias [48]: a row-parallel linear's full operands."""
    gen = torch.Generator().manual_seed(7)
    x, weight, bias = (torch.randn(shape, generator=gen) for shape in ((6, 256), (48, 256), (48,)))
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


def k_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the last dim (K)."""
    step = t.shape[-1] // world
    return t[..., rank * step : (rank + 1) * step]


def tp_emulation(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, chunks: int, degree: int
) -> torch.Tensor:
    """TP degree ``degree`` in one process: each rank's partial of its K slice (rank_partial,
    chunks / degree chunks, fp32), the partials tree-summed in rank order, bias added once."""
    from bik.distributed import rank_partial

    partials = [
        rank_partial(k_slice(x, r, degree), k_slice(weight, r, degree), chunks // degree)
        for r in range(degree)
    ]
    total = _tree_of_ranks(partials)
    return (total if bias is None else total + bias.float()).to(x.dtype)


def _tree_of_ranks(partials: list[torch.Tensor]) -> torch.Tensor:
    """The top of the TP-invariant tree: neighbours pairwise, in rank order."""
    while len(partials) > 1:
        partials = [partials[i] + partials[i + 1] for i in range(0, len(partials), 2)]
    return partials[0]


def moe_tp_emulation(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    degree: int,
) -> torch.Tensor:
    """A SiLU experts module at TP degree ``degree`` in one process, as vLLM shards it: rank r
    holds the rows of its intermediate slice of the gate and of the up projection
    (``gate_up [E, 2I, H]``) and that K slice of the down projection (``down [E, H, I]``);
    its partial is its slice's TP_CHUNKS / degree chunks; the partials are tree-summed in
    rank order and rounded once, then each token's experts are weighed."""
    from bik.contract import TP_CHUNKS
    from bik.layers.moe import expert_down_partial, expert_hidden, weigh_expert_outputs

    pairs, top_k = experts.reshape(-1), experts.shape[1]
    gate, up = gate_up.chunk(2, dim=1)
    partials = []
    for r in range(degree):
        rows = torch.cat(
            [k_slice(gate.transpose(1, 2), r, degree), k_slice(up.transpose(1, 2), r, degree)], 2
        )
        hidden = expert_hidden(x, pairs, top_k, rows.transpose(1, 2))
        partials.append(
            expert_down_partial(hidden, k_slice(down, r, degree), pairs, TP_CHUNKS // degree)
        )
    return weigh_expert_outputs(_tree_of_ranks(partials).to(x.dtype), pairs, weights)


def run_tp_rank(rank: int, world: int, out_dir: str) -> None:
    from bik.distributed import row_parallel_linear

    _init(rank, world, out_dir)
    try:
        result = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, weight, bias = tp_inputs(dtype)
            xs, ws = k_slice(x, rank, world), k_slice(weight, rank, world)
            for per_rank in (1, 2):
                result[dtype, per_rank] = row_parallel_linear(
                    xs, ws, bias, chunks_per_rank=per_rank
                )
        # Ranks that disagree (issue 25, item 8): other chunk counts, other row counts, and
        # (issue 42, item 4) another bias of the same shape.
        x, weight, bias = tp_inputs(torch.float32)
        xs, ws = k_slice(x, rank, world), k_slice(weight, rank, world)
        cases = (
            ("chunks_per_rank", rank + 1, 6, bias),
            ("rows", 1, 6 - rank, bias),
            ("bias values", 1, 6, bias + rank),
        )
        for what, per_rank, rows, rank_bias in cases:
            try:
                row_parallel_linear(xs[:rows], ws, rank_bias, chunks_per_rank=per_rank)
                result["disagree", what] = None
            except ValueError as error:
                result["disagree", what] = str(error)
        # Plain tensor parallelism: the rank's partial, summed by the all-reduce, plus bias.
        partial = bik.linear(k_slice(x, rank, world), k_slice(weight, rank, world))
        dist.all_reduce(partial)
        result["plain"] = partial + bias
        torch.save(result, os.path.join(out_dir, f"tp{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_tp(world: int, out_dir: str) -> list[dict]:
    return _spawn(run_tp_rank, "tp", world, out_dir)


# -- the sharded trainer (bik.distributed.tensor_parallel) -----------------------------------

TP_FAMILIES = ("llama", "qwen3")
# 16 query and 8 KV heads of 16 (hidden 128): whole heads, and GQA, at every TP degree up to 8.
TP_HEADS = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=16)


def tp_model(family: str, dtype: torch.dtype, tp_invariant: bool | None = True) -> torch.nn.Module:
    """A tiny random ``family`` model (the same weights on every call), patched with
    ``tp_invariant`` (None: not patched)."""
    from transformers import AutoModelForCausalLM

    from bik.families import FAMILIES

    torch.manual_seed(0)
    config = FAMILIES[family].tiny_config(**TP_HEADS)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if tp_invariant is not None:
        bik.patch_model(model, backend="cpu", tp_invariant=tp_invariant)
    return model


def tp_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits of ROWS, left-padded into one batch, positions as generation derives them."""
    ids, mask = bik.hf.left_pad(ROWS, PAD)
    position_ids = bik.hf.generation_position_ids(mask)
    return model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).logits


def _plain_tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """torch's own Megatron plan: ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down (the
    K partials summed by an all-reduce)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from bik.families import COLUMN_PARALLEL_NAMES, ROW_PARALLEL_NAMES

    plan = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_PARALLEL_NAMES:
            plan[name] = ColwiseParallel()
        elif leaf in ROW_PARALLEL_NAMES:
            plan[name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def plain_tp_logits(family: str, dtype: torch.dtype, mesh) -> torch.Tensor:
    """The logits of ROWS from the unpatched model under torch's plan on ``mesh``."""
    model = tp_model(family, dtype, tp_invariant=None)
    _plain_tensor_parallel(model, mesh)
    with torch.no_grad():
        return tp_logits(model)


def run_tensor_parallel_rank(rank: int, world: int, out_dir: str, degrees: tuple[int, ...]):
    """Each TP degree on groups of ``degree`` consecutive ranks (a (world / degree, degree)
    mesh's second dim): per family and dtype, the sharded model's logits of ROWS and, at
    rank 0 of the world or at every rank for degree 2, the full gradients of ``loss`` from two
    runs. At degree 2 also the plain torch plan's logits on the unpatched model, per dtype."""
    from torch.distributed.device_mesh import init_device_mesh

    from bik.distributed import tensor_parallel

    _init(rank, world, out_dir)
    try:
        result = {}
        for degree in degrees:
            mesh = init_device_mesh("cpu", (world // degree, degree), mesh_dim_names=("dp", "tp"))
            for family in TP_FAMILIES:
                for dtype in (torch.float32, torch.bfloat16):
                    model = tensor_parallel(tp_model(family, dtype), mesh["tp"])
                    with torch.no_grad():
                        result["logits", family, dtype, degree] = tp_logits(model)
                    grads = []
                    for _ in range(2):  # every rank: the backward gathers gradients
                        model.zero_grad(set_to_none=True)
                        loss(model, ROWS).backward()
                        grads.append(_grads(model))
                    if rank == 0 or degree == 2:
                        result["grads", family, dtype, degree] = grads
            if degree == 2:
                for family in TP_FAMILIES:
                    for dtype in (torch.float32, torch.bfloat16):
                        result["plain", family, dtype] = plain_tp_logits(family, dtype, mesh["tp"])
        torch.save(result, os.path.join(out_dir, f"tensor_parallel{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_tensor_parallel(world: int, out_dir: str, degrees: tuple[int, ...]) -> list[dict]:
    return _spawn(run_tensor_parallel_rank, "tensor_parallel", world, out_dir, degrees)


def run_expert_parallel_rank(rank: int, world: int, out_dir: str) -> None:
    """A Qwen3-MoE's experts over ``world`` gloo ranks (bik.distributed.expert_parallel):
    the logits of ROWS per dtype, and the gradients of two backward runs in fp32."""
    from torch.distributed.device_mesh import init_device_mesh

    from bik.distributed import expert_parallel

    _init(rank, world, out_dir)
    try:
        mesh = init_device_mesh("cpu", (world,))
        result = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = expert_parallel(tp_model("qwen3_moe", dtype, tp_invariant=False), mesh)
            with torch.no_grad():
                result["logits", dtype] = tp_logits(model)
        result["grads"] = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss(model, ROWS).backward()
            result["grads"].append(_grads(model))
        torch.save(result, os.path.join(out_dir, f"expert_parallel{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_expert_parallel(world: int, out_dir: str) -> list[dict]:
    return _spawn(run_expert_parallel_rank, "expert_parallel", world, out_dir)


def run_context_parallel_rank(rank: int, world: int, out_dir: str) -> None:
    """A tiny Qwen3's forward with one sequence split over ``world`` gloo ranks
    (bik.distributed.context_parallel): each rank's logits of its positions, per dtype."""
    from bik.distributed import context_parallel, context_shard

    _init(rank, world, out_dir)
    try:
        result = {}
        ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
        for dtype in (torch.float32, torch.bfloat16):
            model = tp_model("qwen3", dtype, tp_invariant=False)
            chunk, positions = context_shard(ids)
            with context_parallel(model), torch.no_grad():
                result[dtype] = model(chunk, position_ids=positions, use_cache=False).logits
        torch.save(result, os.path.join(out_dir, f"context_parallel{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_context_parallel(world: int, out_dir: str) -> list[dict]:
    return _spawn(run_context_parallel_rank, "context_parallel", world, out_dir)


def run_threads(world: int, fn) -> list:
    """``fn(rank)`` on ``world`` ranks emulated in this process: one thread per rank, joined by
    torch's in-process "threaded" process group (torch.testing's, on which torch's own DTensor
    tests run; collectives copy tensors, as gloo does). Returns each rank's result; the first
    rank's exception is raised after every thread has stopped."""
    import threading

    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: list = [None] * world
    errors: list[BaseException] = []
    store = dist.HashStore()

    def rank_main(rank):
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as error:
            errors.append(error)
            ProcessLocalGroup.exception_handle(error)  # wakes ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results
