"""Linear weights packed once for the CPU kernel: decode-shaped calls without a repack.

bik's CPU matmul reads ``W^T`` in its own panel layout (64 output columns, k-major, bf16 as k
pairs). A plain ``bik.linear`` call packs the weight into it on every call; for a decode step
(a few rows) that packing costs more than the product itself. :func:`pack_weights` marks a
module's linear weights; ``bik.linear`` then packs a marked weight the first time it reads it
and reuses the packed copy for as long as the weight is unchanged. The packed values and the
fma (or bf16 pair instruction) per k are the ones of the per-call packing, in the same order:
the same bits (tests/ops/test_packed_weights.py).

Never stale: a packed copy is remade when the weight's storage, shape, strides, dtype or
version counter changed since it was made, or :func:`weights_changed` was called (the copy
holds the storage it was made from, so a new storage never reuses its address). The version
counter sees every in-place write through the parameter or a view of it (optimizer steps,
``load_state_dict``, ``copy_`` under ``no_grad``), and a new ``.data`` is a new storage. Writes
through ``.data``'s own tensor (``p.data.copy_(...)``), numpy views or raw storage bump no
counter: call :func:`weights_changed` after them. ``bik.vllm`` does after each of the engine's
``load_weights`` (every weight update goes through it).

Memory: one packed copy per marked weight, made at its first use: the weight's bytes (fp32,
and bf16 on CPUs with AVX512-BF16: k pairs), N rounded up to 64. Where the layout is wider
than the weight (fp16, and bf16 without AVX512-BF16: widened to fp32) nothing is packed: a
decode call would read twice the bytes from the copy, more than the packing on the fly costs.
Calls that record a graph (a weight that requires grad under grad mode, tracing, vmap) and
backends without the kernels (GPUs) run matmul as usual.
"""

import torch

from . import backends

_ATTRIBUTE = "_bik_packed"
_generation = 0  # bumped by weights_changed(): every packed copy made before is stale


class _Packed:
    """A weight's packed copy and the state of the weight it was made from."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # None: not made yet, or not worth making
        # The weight's tensor the copy was made from: holding it keeps its storage alive, so
        # a weight given new storage (``p.data = ...``) never gets the old address back.
        self.source: torch.Tensor | None = None
        self.key: tuple | None = None

    def of(self, weight: torch.Tensor, pack) -> torch.Tensor | None:
        key = (weight._version, weight.dtype, weight.shape, weight.stride(), _generation)
        source = self.source
        if source is None or source.data_ptr() != weight.data_ptr() or key != self.key:
            self.buffer = self.source = self.key = None  # free the stale copy first
            source = weight.detach()
            self.buffer, self.source, self.key = pack(source), source, key
        return self.buffer


def pack_weights(module: torch.nn.Module) -> int:
    """Mark every 2-D floating weight of ``module``'s layers (``nn.Linear``, the patched ones,
    vLLM's, embeddings tied to an LM head) to be packed once; returns how many were marked.
    On a device whose backend has no packed kernel (GPUs) the marks change nothing."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    marked = 0
    for weight in _linear_weights(module):
        if getattr(weight, _ATTRIBUTE, None) is None:
            setattr(weight, _ATTRIBUTE, _Packed())
        marked += 1
    return marked


def unpack_weights(module: torch.nn.Module) -> None:
    """Unmark ``module``'s weights and free their packed copies."""
    for weight in _linear_weights(module):
        if hasattr(weight, _ATTRIBUTE):
            delattr(weight, _ATTRIBUTE)


def weights_changed() -> None:
    """Declare that weights may have changed behind their version counters (writes through
    ``.data``): every packed copy is remade at its next use."""
    global _generation
    _generation += 1


def packed_bytes(module: torch.nn.Module) -> int:
    """Bytes held by ``module``'s packed copies (made at each weight's first use)."""
    total = 0
    for weight in _linear_weights(module):
        packed = getattr(weight, _ATTRIBUTE, None)
        if packed is not None and packed.buffer is not None:
            total += packed.buffer.numel()
    return total


def is_marked(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weights` marked ``weight`` (a cheap test for every linear call)."""
    return hasattr(weight, _ATTRIBUTE)


def readable(weight: torch.Tensor) -> bool:
    """Whether the packed kernel may read ``weight`` through its data pointer: no graph to
    record (no grad needed), and real storage: not meta, not a subclass with a dispatch hook of
    its own (DTensor, fake tensors). Plain ``Parameter`` subclasses qualify: vLLM keeps its
    linear weights in one (``ModelWeightParameter``), which bik's other calls route through
    the custom op like any subclass."""
    return (
        not (weight.requires_grad and torch.is_grad_enabled())
        and not weight.is_meta
        and type(weight).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )


def prepacked_linear(
    x_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x_rows [M, K] @ weight.T (+ bias)`` from ``weight``'s packed copy, or None when the
    weight is not marked or the backend has no packed kernel (the caller runs matmul)."""
    packed = getattr(weight, _ATTRIBUTE, None)
    if packed is None:
        return None
    backend = backends.resolve(x_rows.device, "matmul")
    if backend.prepacked_matmul is None or backend.pack_weight is None:
        return None
    buffer = packed.of(weight, backend.pack_weight)
    if buffer is None:
        return None
    return backend.prepacked_matmul(x_rows, buffer, weight.shape[0], bias)


def _linear_weights(module: torch.nn.Module):
    """The distinct 2-D floating weights of the modules that have a ``weight``."""
    seen: set[int] = set()
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.is_floating_point()
            and id(weight) not in seen
        ):
            seen.add(id(weight))
            yield weight
