"""Attention over a paged KV cache with packed, variable-length queries (inference engines).

Engines such as vLLM keep each sequence's keys and values in fixed-size pages ("blocks") of
one shared cache and pack the new tokens of all running sequences into one ``[T, H, D]``
tensor without padding. Here the keys of each sequence are read through its block table into
contiguous order and handed to :func:`bik.attention`, so every query runs the exact
per-query reduction order of bik.attention (key blocks and splits counted from the
sequence's first key): paged == contiguous == prefill == chunked prefill == decode, bit for
bit, on every backend. Decode queries (one new token per sequence) run as one left-padded
batch, which bik.attention's ``kv_start`` makes exact; every other sequence runs on its own.
"""

import torch

from .. import _checks
from .attention import attention


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's ``key[t], value[t]`` (``[T, Hkv, D]``) at slot ``slot_mapping[t]`` of
    the caches ``[num_blocks, Hkv, block_size, D]`` (slot = block * block_size + offset).
    Negative slots (padding tokens) are skipped."""
    _check_cache("key_cache", key_cache, key)
    _check_cache("value_cache", value_cache, value)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping.long() // block_size, slot_mapping.long() % block_size
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    seq_lens: list[int],
    *,
    scale: float,
    split_size: int | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged keys; returns ``[T, H, D]``.

    query ``[T, H, D]``: sequence i's new tokens are rows ``query_start[i]:query_start[i+1]``,
    the last ones of its ``seq_lens[i]`` tokens, whose keys and values (the new ones included)
    are already in the caches ``[num_blocks, Hkv, block_size, D]`` at the pages listed in
    ``block_table[i]``. ``softcap``, ``window`` and ``sinks`` (logit soft-capping, sliding
    window, attention sinks) are bik.attention's.
    """
    _checks.floating("query", query)
    _checks.rank("query", query, 3)
    _check_cache("key_cache", key_cache, query)
    _check_cache("value_cache", value_cache, query)
    if len(query_start) != len(seq_lens) + 1:
        raise ValueError(
            f"query_start: expected {len(seq_lens) + 1} entries (one more than seq_lens), "
            f"got {len(query_start)}"
        )
    out = query.new_zeros(query.shape)
    decodes = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start[i], query_start[i + 1]
        if not 0 < end - start <= seq_len:
            raise ValueError(
                f"seq_lens[{i}] = {seq_len} must be >= its query length {end - start} (> 0)"
            )
        if end - start == 1:
            decodes.append(i)
            continue
        keys, values = _gather(key_cache, value_cache, block_table[i], seq_len, seq_len)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        o = attention(
            q,
            keys,
            values,
            causal=True,
            scale=scale,
            split_size=split_size,
            softcap=softcap,
            window=window,
            sinks=sinks,
        )
        out[start:end] = o[0].transpose(0, 1)
    if decodes:
        _decode_batch(
            out,
            query,
            key_cache,
            value_cache,
            block_table,
            query_start,
            seq_lens,
            decodes,
            dict(scale=scale, split_size=split_size, softcap=softcap, window=window, sinks=sinks),
        )
    return out


def _decode_batch(
    out, query, key_cache, value_cache, block_table, query_start, seq_lens, rows, options
):
    """One-token queries of ``rows`` as one batch, keys left-padded to the longest sequence;
    ``kv_start`` marks each row's first real key, so the padding moves no block boundary."""
    longest = max(seq_lens[i] for i in rows)
    pairs = [_gather(key_cache, value_cache, block_table[i], seq_lens[i], longest) for i in rows]
    keys = torch.cat([k for k, _ in pairs])
    values = torch.cat([v for _, v in pairs])
    kv_start = torch.tensor([longest - seq_lens[i] for i in rows], device=query.device)
    tokens = torch.tensor([query_start[i] for i in rows], device=query.device)
    q = query[tokens].unsqueeze(2)  # [B, H, 1, D]
    o = attention(q, keys, values, causal=True, kv_start=kv_start, **options)
    out[tokens] = o[:, :, 0]


def _gather(key_cache, value_cache, blocks, seq_len, padded_len):
    """A sequence's first ``seq_len`` keys and values, ``[1, Hkv, padded_len, D]``, read
    through its block list and left-padded with zeros to ``padded_len``."""
    block_size = key_cache.shape[2]
    pages = blocks[: -(-seq_len // block_size)].long()

    def contiguous(cache):
        # index_select copies the same bytes as cache[pages], an order of magnitude faster
        # on the strided per-layer view of vLLM's cache.
        rows = cache.index_select(0, pages).transpose(0, 1)
        rows = rows.reshape(cache.shape[1], -1, cache.shape[3])
        rows = rows[:, :seq_len]
        if padded_len > seq_len:
            pad = rows.new_zeros(rows.shape[0], padded_len - seq_len, rows.shape[2])
            rows = torch.cat((pad, rows), dim=1)
        return rows.unsqueeze(0)

    return contiguous(key_cache), contiguous(value_cache)


def _check_cache(name, cache, like):
    _checks.tensor(name, cache)
    _checks.rank(name, cache, 4)
    _checks.same_dtype(name, cache, "the tokens", like)
    _checks.same_device(name, cache, "the tokens", like)
