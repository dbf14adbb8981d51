"""Mixture-of-experts routing: record which experts each token position went to, and count
routing flips between the rollout and the trainer.

A router (transformers 5.x: the module at ``layers[i].mlp.gate``, class name ending in
"TopKRouter", or "TopkRouter" for DeepSeek-V3 / GLM-4.5's sigmoid router) returns
``(router_logits, top_k_weights, top_k_indices)`` with indices ``[tokens, k]``, its input
flattened to one row per token position. :class:`Recorder` keeps those indices from a forward
hook on every router, so a KV-cache rollout (one call per layer for the prefill, then one per
decode step) and the trainer's full forward are recorded alike and laid out as
``[rows, positions, layers, k]``.

A routing flip is a (token position, MoE layer) whose top-k expert SET differs between the
two sides (the order inside the top-k does not count). The metrics are per response token:
token t's log-prob comes from the forward at position t - 1, so that is the position whose
routing is compared (the prompt's last position for the first response token).
"""

from __future__ import annotations

from typing import Any

import torch

from .metrics import PREFIX, masked_mean

UNROUTED = -1  # a position a side never ran (the rollout's last token is never fed back)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of every MoE layer of ``model``, in layer order (empty: dense)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class Recorder:
    """Records every router call's top-k expert indices while active (a context manager that
    holds forward hooks on the routers of ``model``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.handles: list[Any] = []

    def __enter__(self) -> Recorder:
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.calls[layer].append(output[2].detach().to("cpu", torch.long))

        return hook

    def pop(self, rows: int, calls_along: str = "positions") -> torch.Tensor:
        """The indices recorded since the last pop as ``[rows, positions, layers, k]``.

        ``calls_along="positions"``: each call holds ``rows`` sequences' consecutive
        positions (a KV-cache prefill, then one decode step of every row), and the calls
        follow each other along the positions. ``"rows"``: each call holds whole sequences
        (micro-batches of a full forward), and the calls follow each other along the rows.
        """
        if not self.routers:
            raise RuntimeError("routing.Recorder: the model has no top-k routers")
        if len({len(calls) for calls in self.calls}) != 1:
            raise RuntimeError("routing.Recorder: the routers were called unevenly")
        layers = []
        for calls in self.calls:
            if calls_along == "positions":
                parts = [c.reshape(rows, -1, c.shape[-1]) for c in calls]
                layers.append(torch.cat(parts, dim=1))
            else:
                whole = torch.cat(calls)
                layers.append(whole.reshape(rows, -1, whole.shape[-1]))
        self.calls = [[] for _ in self.routers]
        return torch.stack(layers, dim=2)


def pad_positions(indices: torch.Tensor, length: int) -> torch.Tensor:
    """``indices [B, T, layers, k]`` extended to ``length`` positions with UNROUTED."""
    extra = length - indices.shape[1]
    if extra <= 0:
        return indices
    fill = indices.new_full((indices.shape[0], extra, *indices.shape[2:]), UNROUTED)
    return torch.cat([indices, fill], dim=1)


def flips(rollout: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """``[B, T, layers]`` bool: where the top-k expert sets of ``rollout`` and ``train``
    (``[B, T, layers, k]`` expert indices) differ, the order inside a top-k ignored."""
    if rollout.shape != train.shape:
        raise ValueError(
            f"routing.flips: expected equal shapes, got {tuple(rollout.shape)} and "
            f"{tuple(train.shape)}"
        )
    a = rollout.sort(dim=-1).values
    b = train.sort(dim=-1).values
    return (a != b).any(dim=-1)


def routing_metrics(
    rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Routing-flip metrics of one batch (keys prefixed 'mismatch/').

    rollout, train: ``[B, L, layers, k]`` expert indices per position of the sequences;
    mask: ``[B, L]`` (1 = response token). Response token t is compared at position t - 1,
    whose forward gave its log-prob.

    - ``routing_flip_frac``: fraction of response tokens with a flip in at least one layer;
    - ``routing_flip_pair_frac``: fraction of (response token, MoE layer) pairs that flip;
    - ``routing_flip_count``: the number of response tokens with a flip.
    """
    if mask.shape != rollout.shape[:2]:
        raise ValueError(
            f"routing_metrics: expected a mask of shape {tuple(rollout.shape[:2])}, got "
            f"{tuple(mask.shape)}"
        )
    per_pair = flips(rollout, train)  # [B, L, layers]
    at_token = torch.cat([torch.zeros_like(per_pair[:, :1]), per_pair[:, :-1]], dim=1)
    valid = mask.to(torch.float64)
    any_layer = at_token.any(dim=-1).double()
    stats = {
        "routing_flip_frac": masked_mean(any_layer, valid),
        "routing_flip_pair_frac": masked_mean(at_token.double().mean(dim=-1), valid),
        "routing_flip_count": (any_layer * valid).sum(),
    }
    return {PREFIX + name: float(value) for name, value in stats.items()}
