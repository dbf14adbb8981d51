"""bik's attention backend for vLLM, registered through vLLM's attention-backend registry.

The KV cache keeps vLLM's CPU layout (per layer ``[num_blocks, Hkv, block_size, 2 * D]``,
each block holding its keys, then its values); queries arrive packed. Both go to
:func:`bik.layers.paged_attention.paged_attention`, which runs bik.attention's per-query order,
so vLLM's prefill, chunked prefill and decode steps give the bits of the trainer's full
forward.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..layers.paged_attention import paged_attention, write_kv_cache
from .config import check_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import KVCacheSpec


class BikAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # the cache is written in forward()
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list["CacheDType"]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry slot name vLLM looks bik up by

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: "KVCacheSpec | None" = None,
    ) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type["BikAttentionImpl"]:
        return BikAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["BikMetadataBuilder"]:
        return BikMetadataBuilder


@dataclass
class BikAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start: list[int]  # host copies: the per-sequence loop reads them directly
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class BikMetadataBuilder(AttentionMetadataBuilder[BikAttentionMetadata]):
    def __init__(
        self,
        kv_cache_spec: "KVCacheSpec",
        layer_names: list[str],
        vllm_config: "VllmConfig",
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_engine(vllm_config)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> BikAttentionMetadata:
        meta = common_attn_metadata
        if isinstance(meta.causal, torch.Tensor) or not meta.causal:
            raise NotImplementedError("bik.vllm: only causal decoder attention is supported")
        return BikAttentionMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            query_start=meta.query_start_loc_cpu[: meta.num_reqs + 1].tolist(),
            seq_lens=meta.seq_lens[: meta.num_reqs].tolist(),
            block_table=meta.block_table_tensor,
            slot_mapping=meta.slot_mapping,
        )


class BikAttentionImpl(AttentionImpl[BikAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype {kv_cache_dtype!r}": kv_cache_dtype != "auto",
        }
        found = [what for what, present in refused.items() if present]
        if found:
            raise NotImplementedError(
                f"bik.vllm: the model's attention uses {', '.join(found)}, which bik does not "
                "compute; run it without bik"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # vLLM's window counts the query's own key, as transformers' and bik.attention's do
        self.window, self.sinks = sliding_window, sinks
        self.softcap = logits_soft_cap or None  # vLLM passes 0 or None for none

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: BikAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("bik.vllm: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up run
            return output
        tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = _split_cache(kv_cache)
        write_kv_cache(
            key[:tokens],
            value[:tokens],
            key_cache,
            value_cache,
            attn_metadata.slot_mapping[:tokens],
        )
        output[:tokens] = paged_attention(
            query[:tokens],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start,
            attn_metadata.seq_lens,
            scale=self.scale,
            softcap=self.softcap,
            window=self.window,
            sinks=self.sinks,
        ).view(output[:tokens].shape)
        return output


def _split_cache(kv_cache):
    """``[num_blocks, Hkv, block_size, 2 * D]`` -> key and value views
    ``[num_blocks, Hkv, block_size, D]``: each block stores its keys, then its values."""
    blocks, heads, block_size, _ = kv_cache.shape
    pages = kv_cache.view(blocks, heads, 2 * block_size, -1)
    return pages[:, :, :block_size], pages[:, :, block_size:]
