"""Linear weights packed once for the CPU kernel: decode-shaped calls without a repack.

bik's CPU matmul reads ``W^T`` in its own panel layout (64 output columns, k-major, bf16 as k
pairs). A plain ``bik.linear`` call packs the weight into it on every call; for a decode step
(a few rows) that packing costs more than the product itself. :func:`pack_weights` marks a
module's linear weights; ``bik.linear`` then packs a marked weight the first time it reads it
and reuses the packed copy for as long as the weight is unchanged. The packed values and the
fma (or bf16 pair instruction) per k are the ones of the per-call packing, in the same order:
the same bits (tests/ops/test_packed_weights.py).

Never stale: a packed copy is remade when the weight's storage, shape, strides, offset,
dtype or version counter changed since it was made, after any ``torch.optim`` optimizer step
(fused ones write without bumping version counters), or after :func:`weights_changed`. The
version counter sees every in-place write through the parameter or a view of it (unfused
optimizer steps, ``load_state_dict``, ``copy_`` under ``no_grad``), and a new ``.data`` is a new
storage (compared through a weak reference, so its address is never reused while the copy
lives). A weight whose storage another tensor also holds (two parameters sharing ``.data``, a
view of a flat buffer as FSDP1 keeps them) could be written through that tensor unseen: it
is packed per call, never from a copy. Inference tensors (made under ``inference_mode``)
have no version counter: packed per call too. Writes through ``.data``'s own tensor
(``p.data.copy_(...)``), numpy views or raw storage bump no counter: call
:func:`weights_changed` after them. ``bik.vllm`` does after each of the engine's
``load_weights`` (every weight update goes through it). A saved, loaded or deep-copied mark
carries no copy: the copy is made again at its first use.

Memory: one packed copy per marked weight, made at its first use: the weight's bytes (fp32,
and bf16 on CPUs with AVX512-BF16: k pairs), N rounded up to 64. Where the layout is wider
than the weight (fp16, and bf16 without AVX512-BF16: widened to fp32) nothing is packed: a
decode call would read twice the bytes from the copy, more than the packing on the fly costs.
A copy made before a weight got new storage (``model.to(dtype)``) is freed at the weight's
next use or by :func:`unpack_weights`.
Calls that record a graph (a weight that requires grad under grad mode, tracing, vmap) and
backends without the kernels (GPUs) run matmul as usual.
"""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import backends

_ATTRIBUTE = "_bik_packed"
_generation = 0  # bumped by weights_changed(): every packed copy made before is stale
_optimizer_hook = None  # marks every copy stale after any torch.optim step, once registered
# References to a lone weight's storage: the weight's own, and the storage object a check asks
# for (weight.untyped_storage()). More means another tensor can write it unseen.
_LONE_USES = 2


class _Packed:
    """A weight's packed copy and the state of the weight it was made from."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # None: not made yet, or not worth making
        # The storage the copy was made from, held weakly: it stays distinct from every later
        # storage while the reference lives, and is freed when the weight lets go of it.
        self.storage: StorageWeakRef | None = None
        self.key: tuple | None = None

    def __reduce__(self):
        """Saved (torch.save) or copied: the mark only, never the copy or the old key."""
        return (_Packed, ())

    def of(self, weight: torch.Tensor, pack) -> torch.Tensor | None:
        """The copy of ``weight`` as it is now, or None: packed per call instead. Called
        outside graph tracing only (Dynamo cannot trace ``is_inference``)."""
        if weight.is_inference():  # no version counter: a write would go unseen
            self.clear()
            return None
        storage = weight.untyped_storage()
        if torch._C._storage_Use_Count(storage._cdata) > _LONE_USES:
            self.clear()  # shared storage: writes through the other tensor are unseen
            return None
        key = (
            weight._version,
            weight.dtype,
            weight.shape,
            weight.stride(),
            weight.storage_offset(),
            _generation,
        )
        held = self.storage
        if held is None or held.expired() or held.cdata != storage._cdata or key != self.key:
            self.clear()  # free the stale copy first
            source = weight.detach()
            self.buffer, self.storage, self.key = pack(source), StorageWeakRef(storage), key
        return self.buffer

    def clear(self) -> None:
        self.buffer = self.storage = self.key = None


def pack_weights(module: torch.nn.Module) -> int:
    """Mark every 2-D floating weight of ``module``'s layers (``nn.Linear``, the patched ones,
    vLLM's, embeddings tied to an LM head) to be packed once; returns how many were marked.
    On a device whose backend has no packed kernel (GPUs) the marks change nothing."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    watch_optimizer_steps()
    marked = 0
    for weight in _linear_weights(module):
        mark(weight)
        marked += 1
    return marked


def mark(weight: torch.Tensor) -> None:
    """Mark one weight to be packed once (kept if already marked)."""
    if getattr(weight, _ATTRIBUTE, None) is None:
        setattr(weight, _ATTRIBUTE, _Packed())


def watch_optimizer_steps() -> None:
    """Mark every packed copy stale after each step of any torch.optim optimizer: fused
    AdamW, Adam, SGD and Adagrad write parameters without bumping their version counters."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(lambda *_: weights_changed())


def unpack_weights(module: torch.nn.Module) -> None:
    """Unmark ``module``'s weights and free their packed copies."""
    for weight in _linear_weights(module):
        if hasattr(weight, _ATTRIBUTE):
            delattr(weight, _ATTRIBUTE)


def weights_changed() -> None:
    """Declare that weights may have changed behind their version counters (writes through
    ``.data``): every packed copy (and every fused projection weight of bik.hf) is remade at
    its next use."""
    global _generation
    _generation += 1


def generation() -> int:
    """How many times weights were declared changed (:func:`weights_changed`, and each
    optimizer step once :func:`watch_optimizer_steps` runs): a copy made at another
    generation may be stale."""
    return _generation


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


def _prepacked_linear(
    x_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x_rows [M, K] @ weight.T (+ bias)`` from ``weight``'s packed copy, or None when the
    weight is not marked or the backend has no packed kernel (the caller runs matmul).
    Private: bik.linear's accelerator, on operands bik.linear has validated."""
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
