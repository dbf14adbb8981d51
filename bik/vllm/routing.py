"""The experts bik's vLLM engine routed each token of each request to, as the engine computed
them: what a trainer compares with its own routing (routing flips, routing replay).

vLLM's own capture (``enable_return_routed_experts``) needs its V2 model runner, which needs
Triton; bik records in its MoE layers instead. While recording is on (:func:`record`), each
MoE layer of a step hands its top-k choices ``[tokens, k]`` to :func:`capture`, in layer
order; when the step ends (the model runner's bookkeeping), its rows are split by request in
the runner's batch order (each request's scheduled tokens are consecutive rows) and kept with
their positions. :func:`take` returns and clears what was recorded, per internal request id
(``"{sample}_{id}"`` for a request's samples when it has ``n > 1``). Positions the engine did
not compute (a prefix read from the cache, a request's last token) have no routing. Every
tensor-parallel rank routes every token identically; the first rank's record is returned.
"""

import functools
from typing import Any

import numpy as np
import torch

_RECORDING = {"on": False}
_STEP: list[torch.Tensor] = []  # this step's choices, one [tokens, k] entry per MoE layer
# request id -> its recorded (positions [n], experts [n, layers, k]) pieces, in step order
_REQUESTS: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}


def capture(chosen: torch.Tensor) -> None:
    """One MoE layer's choices for this step's tokens (kept while recording is on)."""
    if _RECORDING["on"]:
        _STEP.append(chosen.detach().to("cpu", torch.int32))


def end_step(runner: Any, scheduler_output: Any) -> None:
    """Split the step's recorded rows by request (the runner's batch order) with their
    positions; called by the model runner's bookkeeping after every step."""
    if not _STEP:
        return
    experts = torch.stack(_STEP, dim=1)  # [tokens (perhaps padded), layers, k]
    _STEP.clear()
    batch = runner.input_batch
    positions = runner.positions[: experts.shape[0]].cpu().numpy()
    row = 0
    for request_id in batch.req_ids[: batch.num_reqs]:
        count = scheduler_output.num_scheduled_tokens.get(request_id, 0)
        piece = (positions[row : row + count].copy(), experts[row : row + count])
        _REQUESTS.setdefault(request_id, []).append(piece)
        row += count


def _set_recording(model: Any, on: bool) -> None:
    """In each engine worker: recording on or off; what was recorded is dropped."""
    _RECORDING["on"] = on
    _STEP.clear()
    _REQUESTS.clear()


def _take(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """In each engine worker: every request's record (positions, experts), cleared here."""
    taken = {}
    for request_id, pieces in _REQUESTS.items():
        positions = torch.from_numpy(np.concatenate([p for p, _ in pieces]))
        taken[request_id] = (positions, torch.cat([e for _, e in pieces]))
    _REQUESTS.clear()
    return taken


def record(llm: Any, on: bool = True) -> None:
    """Record (``on``) or stop recording the routing of the requests ``llm`` (a
    ``bik.vllm.LLM`` engine) runs from now on; either way what was recorded is dropped."""
    if not isinstance(on, bool):
        raise TypeError(f"on: expected a bool, got {on!r}")
    llm.apply_model(functools.partial(_set_recording, on=on))


def take(llm: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What ``llm`` recorded since :func:`record` or the last take, and clear it: per
    internal request id, ``(positions [n] int64, experts [n, MoE layers, k] int32)``, the
    positions in the order the engine computed them."""
    return llm.apply_model(_take)[0]


def of_sample(
    taken: dict[str, tuple[torch.Tensor, torch.Tensor]], request_id: str, index: int, samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The record in ``taken`` (:func:`take`'s) of sample ``index`` of the request whose
    output's ``request_id`` is given, ``samples`` its ``n``: vLLM names a sample of a request
    with ``n > 1`` ``"{index}_{request_id}"``, and the engine may add ``"-"`` and a suffix.
    A KeyError when not exactly one record matches."""
    name = f"{index}_{request_id}" if samples > 1 else request_id
    found = [key for key in taken if key == name or key.startswith(f"{name}-")]
    if len(found) != 1:
        raise KeyError(f"bik.vllm.routing: {len(found)} records of {name!r}, expected 1")
    return taken[found[0]]
