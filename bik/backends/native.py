"""Marshalling shared by the compiled backends (cpu, cuda): tensors -> pointers, sizes, strides.

A compiled extension exposes matmul, rms_norm, log_softmax, token_logprobs and attention (and
optionally paged_attention) taking
integers (data pointers), sizes and strides in elements; the innermost dim of each operand is
contiguous (B of matmul takes any strides). :func:`native_backend` adapts one to a
:class:`Backend`; ``launch_args(device)`` adds what a device needs at the end of every call
(the CUDA stream), ``attention_scratch`` the fp32 workspace of split-KV attention (CUDA only).
"""

from collections.abc import Callable
from types import ModuleType

import torch

from ..contract import DTYPE_CODES
from .base import AttentionOptions, Backend


def _inner_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class _NativeKernels:
    """The five kernels over one compiled extension ``lib``."""

    def __init__(self, name, lib, launch_args, attention_scratch, attention_sinks):
        self.name, self.lib = name, lib
        self.launch_args, self.attention_scratch = launch_args, attention_scratch
        self.attention_sinks = attention_sinks

    def matmul(self, a, b, bias):
        """``a [B, M, K] @ b [B or 1, K, N] (+ bias [N])`` -> ``[B, M, N]`` in a's dtype, or
        ``a [M, K] @ b [K, N]`` -> ``[M, N]`` (one product)."""
        a = _inner_contiguous(a)
        out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
        if a.dim() == 2:  # one product: a batch of 1, no batch strides
            (m, k), n = a.shape, b.shape[1]
            batch, a_strides, b_strides = 1, (0, a.stride(0)), (0, *b.stride())
        else:  # a b shared by the batch (b.shape[0] == 1) has batch stride 0
            (batch, m, k), n = a.shape, b.shape[2]
            a_strides = a.stride()[:2]
            b_strides = (b.stride(0) if b.shape[0] > 1 else 0, *b.stride()[1:])
        self.lib.matmul(
            DTYPE_CODES[a.dtype],
            a.data_ptr(),
            b.data_ptr(),
            0 if bias is None else bias.contiguous().data_ptr(),
            out.data_ptr(),
            batch,
            m,
            n,
            k,
            *a_strides,
            *b_strides,
            *self.launch_args(a.device),
        )
        return out

    def pack_weight(self, weight):
        """``weight [N, K]``'s W^T packed once in matmul's layout (bytes; cpu only), or None
        where the layout is wider than the weight (fp16, widened to fp32): a decode call would
        then read more bytes from the copy than it saves by not packing on the fly."""
        (n, k), code = weight.shape, DTYPE_CODES[weight.dtype]
        if self.lib.packed_weight_bytes(code, 64, 64) > 64 * 64 * weight.element_size():
            return None
        packed = torch.empty(self.lib.packed_weight_bytes(code, n, k), dtype=torch.uint8)
        k_stride, n_stride = weight.stride(1), weight.stride(0)  # of W^T's k and n
        self.lib.pack_weight(code, weight.data_ptr(), packed.data_ptr(), n, k, k_stride, n_stride)
        return packed

    def prepacked_matmul(self, a, packed, n, bias):
        """``a [M, K] @ W^T (+ bias [N])`` -> ``[M, N]``, W^T read from ``pack_weight(W)``."""
        a = _inner_contiguous(a)
        out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
        self.lib.matmul_prepacked(
            DTYPE_CODES[a.dtype],
            a.data_ptr(),
            packed.data_ptr(),
            0 if bias is None else bias.contiguous().data_ptr(),
            out.data_ptr(),
            a.shape[0],
            n,
            a.shape[1],
            a.stride(0),
        )
        return out

    def chunked_matmul(self, a, b, chunks):
        """fp32 ``a [M, K] @ b [K, N]`` in the TP-invariant chunked order (cpu only)."""
        a = _inner_contiguous(a)
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        (m, k), n = a.shape, b.shape[1]
        self.lib.chunked_matmul(
            DTYPE_CODES[a.dtype],
            a.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            a.stride(0),
            *b.stride(),
            chunks,
        )
        return out

    def rms_norm(self, x, weight, eps):
        x, weight = _inner_contiguous(x), weight.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.lib.rms_norm(
            DTYPE_CODES[x.dtype],
            DTYPE_CODES[weight.dtype],
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.stride(0),
            eps,
            *self.launch_args(x.device),
        )
        return out

    def log_softmax(self, x, temperature, out_dtype):
        x = _inner_contiguous(x)
        out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
        self.lib.log_softmax(
            DTYPE_CODES[x.dtype],
            DTYPE_CODES[out_dtype],
            x.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.stride(0),
            temperature,
            *self.launch_args(x.device),
        )
        return out

    def token_logprobs(self, logits, tokens, temperature):
        logits, tokens = _inner_contiguous(logits), tokens.to(torch.int64).contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        self.lib.token_logprobs(
            DTYPE_CODES[logits.dtype],
            logits.data_ptr(),
            tokens.data_ptr(),
            out.data_ptr(),
            logits.shape[0],
            logits.shape[1],
            logits.stride(0),
            temperature,
            *self.launch_args(logits.device),
        )
        return out

    def attention(self, q, k, v, kv_start, options: AttentionOptions, sinks=None):
        """Split-KV attention; the kernels take ``softcap`` 0, ``window`` 0 and ``sinks``
        (a pointer to fp32 [Hq]) 0 for "off"."""
        q, k, v = (_inner_contiguous(t) for t in (q, k, v))
        kv_start = kv_start.to(torch.int32).contiguous()
        batch, hq, tq, d = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        # The workspace tensor stays referenced here until the (stream-ordered) launch is queued.
        workspace, extra = (
            (None, ())
            if self.attention_scratch is None
            else self.attention_scratch(q, k.shape[2], options.split_size)
        )
        self.lib.attention(
            DTYPE_CODES[q.dtype],
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            kv_start.data_ptr(),
            out.data_ptr(),
            (batch, hq, k.shape[1], tq, k.shape[2], d, options.split_size),
            q.stride()[:3],
            k.stride()[:3],
            v.stride()[:3],
            options.scale,
            options.causal,
            *_flat_options(options),
            *((0 if sinks is None else sinks.data_ptr(),) if self.attention_sinks else ()),
            *extra,
            *self.launch_args(q.device),
        )
        del workspace
        return out

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start,
        seq_lens,
        options: AttentionOptions,
        sinks=None,
    ):
        """Packed queries over a paged cache, one launch (cpu only); ``softcap`` 0,
        ``window`` 0 and ``sinks`` 0 for "off"."""
        query, key_cache, value_cache, block_table = (
            _inner_contiguous(t) for t in (query, key_cache, value_cache, block_table)
        )
        tokens, hq, d = query.shape
        out = torch.empty(tokens, hq, d, dtype=query.dtype, device=query.device)
        self.lib.paged_attention(
            DTYPE_CODES[query.dtype],
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            query_start.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            (
                tokens,
                seq_lens.shape[0],
                hq,
                key_cache.shape[1],
                d,
                key_cache.shape[2],
                options.split_size,
                block_table.stride(0),
            ),
            query.stride()[:2],
            key_cache.stride()[:3],
            value_cache.stride()[:3],
            options.scale,
            *_flat_options(options),
            0 if sinks is None else sinks.data_ptr(),
        )
        return out

    def delta_rule(self, q, k, v, decay, beta, state):
        """The gated delta rule's recurrence (bik.layers.delta_rule's order; cpu only)."""
        batch, heads, tokens, k_dim = q.shape
        out = torch.empty(batch, heads, tokens, v.shape[-1], dtype=torch.float32)
        state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes it
        tensors = [t.contiguous() for t in (q, k, v, decay, beta)]
        self.lib.delta_rule(
            *(t.data_ptr() for t in tensors),
            state.data_ptr(),
            out.data_ptr(),
            (batch, heads, tokens, k_dim, v.shape[-1]),
            decay.dim() == 4,
        )
        return out, state

    def selective_scan(self, decay, dtx, b, c, state):
        """The Mamba2 scan's recurrence (bik.layers.mamba2's order; cpu only)."""
        (batch, heads, tokens, head_dim), (groups, state_dim) = dtx.shape, b.shape[1::2]
        out = torch.empty(batch, heads, tokens, head_dim, dtype=torch.float32)
        state = state.clone(memory_format=torch.contiguous_format)  # the kernel writes it
        tensors = [t.contiguous() for t in (decay, dtx, b, c)]
        self.lib.selective_scan(
            *(t.data_ptr() for t in tensors),
            state.data_ptr(),
            out.data_ptr(),
            (batch, heads, tokens, head_dim, state_dim, heads // groups),
        )
        return out, state


def _flat_options(options: AttentionOptions) -> tuple[float, int]:
    """``softcap`` and ``window`` as the compiled kernels take them: 0 for "off"."""
    return (
        0.0 if options.softcap is None else options.softcap,
        0 if options.window is None else options.window,
    )


def native_backend(
    name: str,
    device_type: str,
    lib: ModuleType,
    *,
    order: str,
    launch_args: Callable[[torch.device], tuple] = lambda device: (),
    attention_scratch: Callable | None = None,
    attention_sinks: bool = False,
    paged_attention: bool = False,
    chunked_matmul: bool = False,
    prepacked_matmul: bool = False,
    recurrences: bool = False,
) -> Backend:
    """A :class:`Backend` running the kernels of the compiled extension ``lib``;
    ``attention_sinks``: the backend has attention sinks (its compiled attention then takes a
    sinks pointer after ``window``); ``paged_attention``, ``chunked_matmul``,
    ``prepacked_matmul`` (with ``pack_weight``): ``lib`` has that kernel; ``recurrences``: it
    has ``delta_rule`` and ``selective_scan``."""
    kernels = _NativeKernels(name, lib, launch_args, attention_scratch, attention_sinks)
    return Backend(
        name=name,
        device_types=(device_type,),
        order=order,
        matmul=kernels.matmul,
        rms_norm=kernels.rms_norm,
        log_softmax=kernels.log_softmax,
        token_logprobs=kernels.token_logprobs,
        attention=kernels.attention,
        attention_sinks=attention_sinks,
        paged_attention=kernels.paged_attention if paged_attention else None,
        chunked_matmul=kernels.chunked_matmul if chunked_matmul else None,
        pack_weight=kernels.pack_weight if prepacked_matmul else None,
        prepacked_matmul=kernels.prepacked_matmul if prepacked_matmul else None,
        delta_rule=kernels.delta_rule if recurrences else None,
        selective_scan=kernels.selective_scan if recurrences else None,
    )
