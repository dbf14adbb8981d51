"""q/k/v and gate/up projections as one linear each during a static decode step.

At decode a projection has a few rows, so its kernel is bound by reading the weight and by
how many programs it has: k and v of a GQA model are a fraction of q's width, and each of the
five projections of a layer is one more launch. A :class:`ProjectionGroup` keeps one weight
holding its members' rows (``[q; k; v]`` or ``[gate; up]``): the first member's call runs one
bik linear over it and the later members, called with the same input, take their columns of
that output. A bik linear accumulates each output feature over K in the same order whatever
the other features of the call, so every member's output has the bits its own call gives
(tested). The group's weight is a copy, refreshed in place before each step whenever a
member's parameter may have changed (another tensor, an in-place write: its version counter;
an optimizer step or ``bik.weights_changed()``: bik.packed_weights' generation), so a
captured graph reads the new values. Only the steps of a :class:`bik.hf.StaticDecoder` built
with ``fuse_projections=True`` use it, and only without autocast and gradients; everything
else calls each projection alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import packed_weights

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections that read one input, by their attribute names in a layer."""

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ProjectionGroup:
    """Sibling projections computed as one linear (see the module docstring)."""

    def __init__(self, members: list[nn.Linear], pack: bool) -> None:
        self.members, self.pack = members, pack
        self.sizes = [m.out_features for m in members]
        self._stack()
        packed_weights.watch_optimizer_steps()  # fused optimizers bump no version counter
        self._pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def _stack(self) -> None:
        """New stacked copies of the members' weights (and biases)."""
        self.weight = torch.cat([m.weight.detach() for m in self.members])
        if self.pack:  # as the members' (patch_model(pack_weights=True)): packed once
            packed_weights.mark(self.weight)
        with_bias = self.members[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in self.members]) if with_bias else None
        self._sources = self._source_key()

    def _parameters(self) -> list[torch.Tensor]:
        return [p for m in self.members for p in (m.weight, m.bias) if p is not None]

    def _source_key(self) -> tuple:
        parameters = tuple((id(p), p.data_ptr(), p._version) for p in self._parameters())
        return (packed_weights.generation(), *parameters)

    def refresh(self) -> None:
        """Copy the members' parameters in again if any changed since the last copy (in
        place: a captured graph keeps reading this weight's memory)."""
        key = self._source_key()
        if key == self._sources:
            return
        first = self.members[0].weight
        if (first.dtype, first.device) != (self.weight.dtype, self.weight.device):
            return self._stack()  # the model moved (its decoder's buffers are new too)
        with torch.no_grad():
            torch.cat([m.weight for m in self.members], out=self.weight)
            if self.bias is not None:
                torch.cat([m.bias for m in self.members], out=self.bias)
        self._sources = key

    def output(self, member: nn.Module, x: torch.Tensor, linear: Linear) -> torch.Tensor | None:
        """``member``'s output from the group's one linear; None when it must run alone (a
        later member called with another input than the first one was)."""
        index = next(i for i, m in enumerate(self.members) if m is member)
        if index == 0:
            self._pending = (x, linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
            return self._pending[1][0]
        pending = self._pending
        if index + 1 == len(self.members):  # the last member: hold no tensor past the layer
            self._pending = None
        if pending is None or pending[0] is not x:
            return None
        return pending[1][index]


def projection_groups(
    model: nn.Module, fusable: Callable[[nn.Module], bool]
) -> dict[nn.Module, ProjectionGroup]:
    """Every member of a fusable group of ``model``: sibling linears that ``fusable`` admits
    (bik.hf.forwards.fusable_linear: bik-patched, plain ``linear`` kind) of one dtype,
    device and input width, with a bias on all or none."""
    table: dict[nn.Module, ProjectionGroup] = {}
    for layer in model.modules():
        for names in GROUPS:
            members = [getattr(layer, name, None) for name in names]
            if not all(isinstance(m, nn.Linear) and fusable(m) for m in members):
                continue
            linears: list[nn.Linear] = members  # type: ignore[assignment]
            first = linears[0].weight
            if any(
                (m.weight.dtype, m.weight.device, m.in_features, m.bias is None)
                != (first.dtype, first.device, linears[0].in_features, linears[0].bias is None)
                for m in linears
            ):
                continue
            pack = linears[0].forward.pack_weight  # type: ignore[attr-defined]  # fusable's
            group = ProjectionGroup(linears, pack)
            table.update((m, group) for m in linears)
    return table


_ACTIVE: contextvars.ContextVar[dict[nn.Module, ProjectionGroup] | None] = contextvars.ContextVar(
    "bik_fused_projections", default=None
)


@contextlib.contextmanager
def fused(groups: dict[nn.Module, ProjectionGroup]) -> Iterator[None]:
    """Inside: the members of ``groups`` run as their groups (:func:`active_group`)."""
    token = _ACTIVE.set(groups)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_group(module: nn.Module) -> ProjectionGroup | None:
    """``module``'s group while a fused step runs, else None."""
    groups = _ACTIVE.get()
    return None if groups is None else groups.get(module)
