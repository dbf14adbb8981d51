"""What a backend is: a name, the device types it serves, the kernels it has, its order.

Ops (bik.ops) validate their inputs and reshape them to the kernel layouts below, so a
kernel never sees a bad argument; a kernel only has to compute its op in the fixed order the
contract (bik.contract) sets for it. Kernels are given by keyword and each is optional: an op
a backend lacks raises "op X is not implemented on backend Y" when selected explicitly, and
"auto" passes on to the next backend of its order (bik.backends).

Kernel layouts (``OPS``):
  matmul(a [B, M, K], b [B or 1, K, N], bias [N] | None) -> [B, M, N] in a's dtype; also
         a [M, K], b [K, N] -> [M, N] (one product: no batch dim to add and drop per call)
  rms_norm(x [R, D], weight [D], eps) -> [R, D] in x's dtype
  log_softmax(x [R, V], temperature, out_dtype) -> [R, V] in out_dtype
  token_logprobs(logits [R, V], tokens [R], temperature) -> fp32 [R]
  attention(q [B, Hq, Tq, D], k, v [B, Hkv, Tk, D], kv_start int32 [B],
            options (AttentionOptions), sinks (fp32 [Hq] | None: set only for backends
            declaring attention_sinks)) -> [B, Hq, Tq, D]
The innermost dim of every operand may be assumed contiguous except b of matmul (any strides).

Optional accelerator of attention (None: bik.layers.paged_attention gathers each sequence's
keys into contiguous order and runs attention):
  paged_attention(query [T, Hq, D], key_cache, value_cache [num_blocks, Hkv, block_size, D]
                  (any strides), block_table int32 [>= S, W], query_start int32 [S + 1],
                  seq_lens int32 [S], options (AttentionOptions, causal), sinks (as above))
      -> [T, Hq, D]: each query row in attention's order over its sequence's keys, read
      through the block table (docs/vllm.md, "Paged attention")

The TP-invariant order in one call (None: rank_partial runs matmul per chunk on fp32 casts):
  chunked_matmul(a [M, K], b [K, N] (any strides), chunks) -> fp32 [M, N]: K in ``chunks``
      equal chunks, each one chain per output from zero, the chunk partials summed by the
      balanced pairwise tree (bik.contract.tp_tree_sum). A chunk is the fp32 fma chain on
      the exact fp32 values (cpu, and triton's fp32: the per-chunk composition's bits) or,
      for triton's 16-bit inputs, its tensor-core MMA chain on the values as they are (the
      order on that backend, forward and backward; no composition of matmul calls gives it)

Optional accelerator of linear for weights packed once (None: bik.packed_weights packs
nothing, every call runs matmul):
  pack_weight(weight [N, K]) -> an opaque buffer: W^T in matmul's own layout
  prepacked_matmul(a [M, K], packed, N, bias [N] | None) -> [M, N]: matmul(a, W^T, bias)'s
      bits, W^T read from the buffer

Optional accelerator of matmul (None: grouped_linear runs matmul once per group instead):
  grouped_matmul(a [R, K], b [G, K, N] (any strides), offsets int64 [G + 1]) -> [R, N]:
      rows offsets[g]:offsets[g+1] of a times b[g], each row in matmul's order

Optional accelerators of the recurrences (None: bik.layers runs their torch compositions token
by token; the backend that runs matmul on the device is asked), all tensors fp32:
  delta_rule(q, k [B, H, T, K], v [B, H, T, V], decay [B, H, T] or [B, H, T, K], beta [B, H, T],
             state [B, H, K, V]; q scaled, decay = exp(g))
      -> (out [B, H, T, V], final state): bik.layers.delta_rule.recurrence's order and bits
  selective_scan(decay [B, H, T], dtx [B, H, T, P], b, c [B, G, T, N], state [B, H, P, N];
                 decay = exp(dt A), dtx = dt x)
      -> (read [B, H, T, P], final state): bik.layers.mamba2.recurrence's order and bits
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

OPS = ("matmul", "rms_norm", "log_softmax", "token_logprobs", "attention")
Kernel = Callable[..., torch.Tensor]
# The optional accelerators (Backend fields, layouts above): each serves one base op, with the
# same bits as what bik composes from the base kernels when a backend lacks it (chunked_matmul
# on triton's 16-bit inputs excepted: there it defines the order, see above).
ACCELERATORS: dict[str, tuple[str, str]] = {  # field: (base op, the composition without it)
    "paged_attention": ("attention", "each sequence's keys gathered in order, then attention"),
    "grouped_matmul": ("matmul", "matmul once per non-empty group"),
    "chunked_matmul": ("matmul", "one matmul per chunk on fp32 casts, tree-summed"),
    "prepacked_matmul": ("matmul", "matmul, packing the weight on every call"),
    "delta_rule": ("matmul", "the gated delta rule's torch composition, token by token"),
    "selective_scan": ("matmul", "the Mamba2 scan's torch composition, token by token"),
}


class AttentionOptions(NamedTuple):
    """What an attention kernel computes besides its tensors: one immutable record, built once
    by validation (bik.ops.attention.validate_options), taken by every backend's attention and
    paged attention. The order these options run in is the contract's (docs/design.md). A
    NamedTuple: an eager call builds it on the host path, where a dataclass costs 2.5x more."""

    causal: bool
    scale: float
    split_size: int  # keys per split (a multiple of contract.KEY_BLOCK)
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap); None: off
    window: int | None = None  # causal sliding window: keys in (p - window, p]; None: off

    def keywords(self) -> dict[str, object]:
        """The options as bik.attention's keyword arguments."""
        return self._asdict()


@dataclass(frozen=True, kw_only=True)
class Backend:
    """One backend: its kernels (each optional), its capabilities, and the checks the
    registry runs before using it."""

    name: str
    device_types: tuple[str, ...]
    """torch device types it serves ("cpu", "cuda"); empty: every device."""
    order: str
    """One line: how its kernels fix their reduction orders (``python -m bik backends``)."""
    matmul: Kernel | None = None
    rms_norm: Kernel | None = None
    log_softmax: Kernel | None = None
    token_logprobs: Kernel | None = None
    attention: Kernel | None = None
    paged_attention: Kernel | None = None
    """Attention reading a paged KV cache through its block table (bik.layers.paged_attention)."""
    grouped_matmul: Kernel | None = None
    """One launch for every group of a mixture-of-experts matmul (bik.ops.grouped_linear)."""
    chunked_matmul: Kernel | None = None
    """The TP-invariant chunked order in one call (bik.distributed.rank_partial)."""
    pack_weight: Kernel | None = None
    """A weight's W^T packed once in matmul's layout (bik.packed_weights)."""
    prepacked_matmul: Kernel | None = None
    """matmul reading a weight packed by ``pack_weight``: the same bits."""
    delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """The gated delta rule's recurrence in one call (bik.layers.delta_rule)."""
    selective_scan: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """The Mamba2 scan's recurrence in one call (bik.layers.mamba2)."""
    attention_sinks: bool = False
    """Its attention takes ``sinks`` (one learned logit per query head, gpt-oss)."""
    invariant: bool = True
    """False only for the reference oracle: plain torch picks orders by shape."""
    extra_device_check: Callable[[torch.device], None] | None = None
    """Raises RuntimeError (with how to fix it) when a served device type still cannot run."""

    def implements(self, op: str) -> bool:
        """Whether this backend has a kernel for ``op`` (one of ``OPS``)."""
        if op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {op!r}")
        return getattr(self, op) is not None

    def kernel(self, op: str) -> Kernel:
        """The kernel of ``op``; NotImplementedError when this backend has none."""
        kernel = getattr(self, op) if self.implements(op) else None
        if kernel is None:
            raise NotImplementedError(f"op {op} is not implemented on backend {self.name!r}")
        return kernel

    def attention_kernel(self, sinks: torch.Tensor | None, op: str = "attention") -> Kernel:
        """The kernel of ``op`` (attention or paged_attention) for a call with or without
        ``sinks``: the one place the sinks capability is checked."""
        if sinks is not None and not self.attention_sinks:
            raise NotImplementedError(
                f"sinks: the {self.name} backend has no attention sinks; select one that has "
                "(python -m bik backends lists them)"
            )
        kernel = getattr(self, op)
        if kernel is None:
            raise NotImplementedError(f"op {op} is not implemented on backend {self.name!r}")
        return kernel

    def check_device(self, device: torch.device) -> None:
        """Raise ``RuntimeError`` saying how to fix it if this backend cannot run on ``device``."""
        if self.device_types and device.type not in self.device_types:
            served = " or ".join(self.device_types)
            raise RuntimeError(
                f"bik {self.name} backend: runs {served} tensors only, got device {device}"
            )
        if self.extra_device_check is not None:
            self.extra_device_check(device)
