"""Data parallelism: one process per rank under ``torchrun``, collectives through gloo.

``torchrun --nproc-per-node N -m rl_harness run ...`` runs each step as follows (see
rl_harness.runner):

- Every rank builds the step's whole prompt batch from the seed and samples its contiguous
  share of the prompts (:meth:`World.rows`); a prompt's samples stay on one rank. The sampler
  draws the random numbers of the whole batch and uses its rows' (rollout.sample), so a row's
  tokens do not depend on which rank sampled it, and the recorded single-process runs keep
  their bits. (A generator per prompt would change them: the single-process draw is one
  generator over the batch.)
- Each rank runs the trainer forward on its rows, right-padded to the longest response of the
  batch (:meth:`World.max`); then every rank gathers every rank's rows (:meth:`World.gather_rows`).
  The result is the single-process batch, bit for bit: rewards, advantages, mismatch metrics,
  remedy weights and the logged loss are computed from it on every rank, by the
  single-process code, so every rank asserts zero mismatch over the whole batch.
- Each rank backpropagates its share of the batch's token-mean loss (its tokens' sum over the
  batch's token count); the fp32 gradients are summed by one all-reduce
  (:meth:`World.sum_gradients`), and every rank clips and steps its own AdamW on the same
  gradients, so the master weights stay identical on every rank without a broadcast.
- With ``train.ppo_epochs`` > 1, every later update runs the trainer forward on each rank's
  share again and gathers the current log-probs for its stats; ``train.mini_batches`` > 1 is
  refused with more than one process (runner.check_world).
- Rank 0 alone reads and writes the run directory and the warm-up cache (:meth:`World.on_main`
  hands its results, or its error, to the other ranks).

The step-0 gradient is not the single-process one bit for bit: one process reduces a weight's
gradient over all tokens in one order, two ranks as two partial sums and then their sum
(docs/design.md, "Across processes"), so the runs drift apart from step 1 on.

Collectives use gloo: the harness computes on the CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import HarnessError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes; ``World()`` is the single process,
    for which every method below is the identity (no collective runs)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> World:
        """The initialised default process group, or the single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        """Rank 0: the one process that touches the run directory and prints."""
        return self.rank == 0

    def rows(self, prompts: int, samples_per_prompt: int) -> slice:
        """This rank's contiguous share of a batch of ``prompts`` groups of
        ``samples_per_prompt`` rows: whole groups, so group advantages stay on one rank;
        shares differ by at most one group."""
        first = self.rank * prompts // self.size
        last = (self.rank + 1) * prompts // self.size
        return slice(first * samples_per_prompt, last * samples_per_prompt)

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's rows of each tensor, concatenated in rank order (the ranks' rows are
        contiguous shares, so this is the whole batch in its order); detached CPU copies.
        Shares may differ in rows but not in columns."""
        if self.size == 1:
            return tensors
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.size
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in tensors.items()})
        return {k: torch.cat([p[k] for p in parts if p is not None]) for k in tensors}

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over the ranks (one all-reduce of the
        flattened fp32 gradients). Each rank's loss is already its share of the batch's
        token mean, so the sum is the batch's gradient (up to the order of the reduction).
        A gradient a rank lacks counts as zeros."""
        if self.size == 1:
            return
        params = list(parameters)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # at 2 ranks a + b = b + a: any reduction order gives these bits
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's ``module``."""
        if self.size == 1:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 only; every rank returns its result. A HarnessError it
        raises is raised on every rank (so all stop with the same message instead of waiting
        in the next collective); any other error stops the other ranks with a RuntimeError."""
        if self.size == 1:
            return fn()
        # ("ok", fn's result), ("error", the HarnessError) or ("failed", its message): pickled
        outcome: list[Any] = [None]
        failure: BaseException | None = None
        if self.main:
            try:
                outcome[0] = ("ok", fn())
            except HarnessError as error:
                outcome[0], failure = ("error", error), error
            except BaseException as error:
                outcome[0], failure = ("failed", f"{type(error).__name__}: {error}"), error
        dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        kind, value = outcome[0]
        if kind == "error":
            raise value
        if kind == "failed":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value


@contextlib.contextmanager
def from_environment() -> Iterator[World]:
    """The world torchrun describes in the environment (``WORLD_SIZE`` > 1: a gloo process
    group, ``RANK`` and the rendezvous from the environment, destroyed on exit); otherwise, or
    when a process group already exists, the current world, untouched."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield World.current()
        return
    dist.init_process_group("gloo")
    try:
        yield World.current()
    finally:
        dist.destroy_process_group()
