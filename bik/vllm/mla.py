"""vLLM's multi-head latent attention (DeepSeek-V3; Kimi K2 and Moonlight load as it) routed
to bik in the form the trainer computes: non-absorbed.

vLLM caches each token's latent (the normed compressed key/value, then the rotated shared key
part: ``[kv_lora_rank + qk_rope_head_dim]`` per token, in pages of its MLA cache) and, on the
CPU, attends in two forms: prefills expand the latents and run SDPA, decode steps absorb the
expansion into the query (``mla_decode_kvcache``): two orders, neither the trainer's. The
bik-patched trainer (bik.hf) expands the cached latents with ``kv_b_proj`` at every step and
runs bik.attention over the expanded keys and values (the value heads zero-widened to the
key width, the extra columns sliced off). bik replaces the layer's ``forward_impl`` with that
same form: vLLM still writes the cache (exact copies of the latents), then each sequence's
latents are read through its block table in position order, expanded by the layer's
``kv_b_proj`` (bik.linear: a row's bits do not depend on how many rows it is computed
with), and its new queries attend over them with bik.attention, so a prefill and a decode
step give the trainer's bits. A query of several tokens after cached latents (a speculative
verify forward; vLLM's CPU platform turns chunked prefill and prefix caching off for MLA
models) attends as the sequence's last tokens. The latent cache is paged in 16-token blocks.
"""

from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ..ops.attention import attention


class BikMLABackend(CPUMLABackend):
    """vLLM's CPU MLA backend (its cache layout and metadata) with any latent width: bik's
    forward does not call the CPU decode kernel, which is compiled for DeepSeek's 576 only."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True


def _forward_impl(
    self: Any,
    q: torch.Tensor,
    k_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: Any,
    output: torch.Tensor,
    output_scale: torch.Tensor | None = None,
    output_block_scale: torch.Tensor | None = None,
    q_dcp_replicated: torch.Tensor | None = None,
    **quantization: Any,
) -> torch.Tensor:
    """MLAAttention.forward_impl in the trainer's non-absorbed form (see the module doc);
    ``output [T, H * v_head_dim]``."""
    fused = (output_scale, output_block_scale, q_dcp_replicated, *quantization.values())
    if any(option is not None for option in fused):
        raise NotImplementedError("bik.vllm: MLA with fused output quantization or DCP")
    if attn_metadata is None:  # vLLM's warm-up run
        return output.fill_(0)
    impl = self.impl
    pages = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)  # [blocks, size, latent]
    for lo, hi, table, length in _sequences(attn_metadata):
        latents = _latents(pages, table, length)
        heads = _attend(impl, q[lo:hi], latents)
        output[lo:hi] = heads.reshape(hi - lo, -1)
    return output


def _sequences(metadata: Any) -> list[tuple[int, int, torch.Tensor, int]]:
    """(first token, end, block-table row, length) of each sequence of the step: the decodes
    (one token each, their lengths from the metadata) first, then the prefills, whose length
    is their cached context's (a speculative verify forward's, a chunked or prefix-cached
    prompt's) plus their query's: the query is the sequence's last tokens."""
    spans = []
    decode, prefill = metadata.decode, metadata.prefill
    if metadata.num_decode_tokens != metadata.num_decodes:
        raise NotImplementedError("bik.vllm: MLA decode steps of more than one token each")
    if metadata.num_decodes:
        lengths = decode.seq_lens.tolist()
        for i, length in enumerate(lengths):
            spans.append((i, i + 1, decode.block_table[i], length))
    if metadata.num_prefills:
        context = prefill.chunked_context
        contexts = (
            context.context_lens_list if context is not None else [0] * len(prefill.block_table)
        )
        starts = prefill.query_start_loc.tolist()
        offset = metadata.num_decode_tokens - starts[0]  # the prefills follow the decodes
        for i in range(metadata.num_prefills):
            lo, hi = starts[i] + offset, starts[i + 1] + offset
            spans.append((lo, hi, prefill.block_table[i], contexts[i] + hi - lo))
    return spans


def _latents(pages: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's ``length`` cached latents ``[length, latent]`` in position order, read
    through its block-table row (exact copies)."""
    positions = torch.arange(length, device=pages.device)
    block_size = pages.shape[1]
    return pages[table.long()[positions // block_size], positions % block_size]


def _attend(impl: CPUMLAImpl, query: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The sequence's last ``Tq`` queries ``[Tq, H, nope + rope]`` over its expanded latents,
    as the patched trainer's DeepseekV3Attention and bik.hf.attention compute them; returns
    ``[Tq, H, v_head_dim]``."""
    rank, nope, v_dim = impl.kv_lora_rank, impl.qk_nope_head_dim, impl.v_head_dim
    length, heads = latents.shape[0], query.shape[1]
    expanded = impl.kv_b_proj(latents[:, :rank])[0].view(length, heads, nope + v_dim)
    k_nope, value = expanded.split([nope, v_dim], dim=-1)
    k_rot = latents[:, None, rank:].expand(-1, heads, -1)
    key = torch.cat([k_nope, k_rot], dim=-1)
    # value heads narrower than the keys: zero columns widen them (bik.hf.attention's way)
    value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))
    out = attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        causal=True,
        scale=impl.scale,
    )
    return out[0, :, :, :v_dim].transpose(0, 1)


PATCHED_METHODS = ((MLAAttention, "forward_impl", _forward_impl),)


def problem(name: str, layer: Any) -> str | None:
    """Why bik cannot run ``layer`` (an MLAAttention) as the trainer does, or None: bik reads
    the CPU MLA cache layout only."""
    if isinstance(layer.impl, CPUMLAImpl):
        return None
    return f"{name} (MLAAttention): the {type(layer.impl).__name__} cache, which bik does not read"
