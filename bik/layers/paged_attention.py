"""Attention over a paged KV cache with packed, variable-length queries (inference engines).

Engines such as vLLM keep each sequence's keys and values in fixed-size pages ("blocks") of
one shared cache and pack the new tokens of all running sequences into one ``[T, H, D]``
tensor without padding. Every query runs the exact per-query reduction order of
:func:`bik.attention` over its sequence's keys (key blocks and splits counted from the
sequence's first key): paged == contiguous == prefill == chunked prefill == decode, bit for
bit, on every backend.

A backend with a paged kernel (cpu, triton) runs the whole step in one call that reads the keys
through the block table itself. Otherwise, and whenever a graph is recorded or traced (the
path of bik.attention's autograd and fake kernels), each sequence's keys are gathered into
contiguous order and handed to bik.attention: decode queries (one new token per sequence) as
one left-padded batch, which bik.attention's ``kv_start`` makes exact, every other sequence
on its own. Both paths give the same bits (tests/layers/test_paged_attention.py).
"""

import torch

from .. import _checks, backends
from ..ops._dispatch import needs_custom_op
from ..ops.attention import attention, fp32_sinks, validate_options


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
    _check_slots(slot_mapping, key, value, key_cache)
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
    _check_heads(query, key_cache, value_cache)
    starts_on_device, lens_on_device = _step_on_device(
        query, key_cache, block_table, query_start, seq_lens
    )
    options = validate_options(query, True, scale, split_size, softcap, window, sinks)
    if query.numel() == 0:
        return query.new_zeros(query.shape)
    backend = backends.resolve(query.device, "attention")
    if backend.paged_attention is not None and not needs_custom_op(
        (query, key_cache, value_cache, sinks)
    ):
        kernel = backend.attention_kernel(sinks, "paged_attention")
        paging = (_rows_of_ids(block_table), starts_on_device, lens_on_device)
        return kernel(query, key_cache, value_cache, *paging, options, fp32_sinks(sinks))
    return _gathered(
        query, key_cache, value_cache, block_table, query_start, seq_lens, options, sinks
    )


# (what a step's checks and device copies depend on, the copies): an engine calls every layer
# of a step with the same sequences, so they are checked and copied once per step.
_last_step: list[tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None] = [None]


def _step_on_device(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    seq_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start`` and ``seq_lens`` checked against the query, the cache and the block
    table, and copied to the device: once per step, not once per layer (a layer repeats the
    previous call's lists, table and cache sizes; the table's version counter changes with
    every write to it, so an edited table is checked again)."""
    _integers("block_table", block_table, 2, "block ids")  # before reading its pointer
    key = (
        tuple(query_start),
        tuple(seq_lens),
        query.shape[0],
        query.device,
        key_cache.shape[0],
        key_cache.shape[2],
        block_table.data_ptr(),
        block_table.dtype,
        block_table.device,
        block_table.shape,
        block_table.stride(),
        block_table._version,
    )
    cached = _last_step[0]  # one read: the entry is replaced whole, never edited
    if cached is not None and cached[0] == key:
        return cached[1]
    pages = [-(-n // key_cache.shape[2]) for n in seq_lens]  # each sequence's pages in use
    _check_step(query, key_cache, block_table, query_start, seq_lens, pages)
    starts, lens, pages_on_device = _on_device(query.device, query_start, seq_lens, pages)
    _check_listed_blocks(key_cache, block_table, pages, pages_on_device)
    _last_step[0] = (key, (starts, lens))
    return starts, lens


def _rows_of_ids(block_table: torch.Tensor) -> torch.Tensor:
    """The table as kernels read it: int32, each row's ids adjacent (the backends' contract:
    innermost dims contiguous). A column-strided view (``table[:, ::2]``) is copied: a kernel
    stepping one id at a time would read the skipped columns' ids."""
    table = block_table.to(torch.int32)
    return table if table.stride(-1) == 1 else table.contiguous()


def _gathered(query, key_cache, value_cache, block_table, query_start, seq_lens, options, sinks):
    """The step through bik.attention on keys gathered into contiguous order."""
    options = dict(options.keywords(), sinks=sinks)
    out = query.new_zeros(query.shape)
    decodes = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start[i], query_start[i + 1]
        if end - start == 1:
            decodes.append(i)
            continue
        keys, values = _gather(key_cache, value_cache, block_table[i], seq_len, seq_len)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        o = attention(q, keys, values, **options)
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
            options,
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
    o = attention(q, keys, values, kv_start=kv_start, **options)
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


def _check_heads(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache: expected the shape of key_cache {tuple(key_cache.shape)}, "
            f"got {tuple(value_cache.shape)}"
        )
    _checks.dim_size("key_cache", key_cache, 3, query.shape[2], "D, the head size of query")
    heads = key_cache.shape[1]
    if heads == 0 or query.shape[1] % heads:
        raise ValueError(
            f"key_cache: expected a head count Hkv > 0 dividing the query's "
            f"Hq={query.shape[1]} (GQA), got {heads}"
        )


def _check_step(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    seq_lens: list[int],
    pages: list[int],
) -> None:
    """Every query token belongs to one sequence, and every page a sequence reads is listed
    in its row of ``block_table`` (``pages``: how many each reads): otherwise rows would come
    back as zeros, or attend over fewer keys than ``seq_lens`` says, without a word."""
    tokens, count = query.shape[0], len(seq_lens)
    if len(query_start) != count + 1:
        raise ValueError(
            f"query_start: expected {count + 1} entries (one more than seq_lens), "
            f"got {len(query_start)}"
        )
    if query_start[0] != 0 or query_start[-1] != tokens:
        raise ValueError(
            f"query_start: expected to run from 0 to {tokens} (the query's tokens, each in "
            f"one sequence), got {query_start[0]} to {query_start[-1]}"
        )
    for i, seq_len in enumerate(seq_lens):
        length = query_start[i + 1] - query_start[i]
        if not 0 < length <= seq_len:
            raise ValueError(
                f"seq_lens[{i}] = {seq_len} must be >= its query length {length} (> 0; "
                f"query_start[{i}:{i + 2}] = {list(query_start[i : i + 2])})"
            )
    _integers("block_table", block_table, 2, "block ids")
    _checks.same_device("block_table", block_table, "query", query)
    if block_table.shape[0] < count:
        raise ValueError(
            f"block_table: expected a row for each of the {count} sequences, got shape "
            f"{tuple(block_table.shape)}"
        )
    widest = max(range(count), key=pages.__getitem__, default=-1)  # -1: no sequence
    if widest >= 0 and pages[widest] > block_table.shape[1]:
        raise ValueError(
            f"block_table: seq_lens[{widest}] = {seq_lens[widest]} tokens fill "
            f"{pages[widest]} pages of {key_cache.shape[2]}, but the table has "
            f"{block_table.shape[1]} columns (shape {tuple(block_table.shape)})"
        )


def _on_device(device: torch.device, *lists: list[int]) -> tuple[torch.Tensor, ...]:
    """The lists as int32 tensors on ``device``, by one copy. On a GPU the copy is queued from
    pinned memory: a copy from pageable memory would wait for the device to finish all the
    work queued before it, once per layer and step."""
    flat = torch.tensor(
        [value for values in lists for value in values],
        dtype=torch.int32,
        pin_memory=device.type == "cuda",
    )
    return flat.to(device, non_blocking=True).split([len(values) for values in lists])


def _check_listed_blocks(
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    pages: list[int],
    pages_on_device: torch.Tensor,
) -> None:
    """Every page a sequence reads is a block of the cache; only the pages in use are
    checked, as engines leave the rest of a row unset."""
    if not pages:
        return
    width, blocks = max(pages), key_cache.shape[0]
    listed = block_table[: len(pages), :width]
    in_use = torch.arange(width, device=listed.device) < pages_on_device.unsqueeze(1)
    _checks.values_in_range(
        "block_table",
        torch.where(in_use, listed, 0),
        0,
        blocks - 1,
        f"ids of the cache's {blocks} blocks, in the pages the sequences use",
    )


def _integers(name: str, value: torch.Tensor, dims: int, what: str) -> None:
    """A ``dims``-D tensor of integers (a float table would be silently truncated)."""
    _checks.tensor(name, value)
    _checks.rank(name, value, dims)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer dtype ({what}), got {value.dtype}")


def _check_slots(
    slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor
) -> None:
    _integers("slot_mapping", slot_mapping, 1, "cache slots")
    _checks.same_device("slot_mapping", slot_mapping, "key_cache", key_cache)
    for name, tokens in (("key", key), ("value", value)):
        _checks.rank(name, tokens, 3)
        _checks.dim_size(name, tokens, 0, slot_mapping.shape[0], "T, one per slot_mapping entry")
        _checks.dim_size(name, tokens, 1, key_cache.shape[1], "Hkv, the heads of the caches")
        _checks.dim_size(name, tokens, 2, key_cache.shape[3], "D, the head size of the caches")
    capacity = key_cache.shape[0] * key_cache.shape[2]
    _checks.values_in_range(
        "slot_mapping",
        slot_mapping,
        torch.iinfo(slot_mapping.dtype).min,
        capacity - 1,
        f"below the cache's {capacity} slots; negative: a padding token, skipped",
    )


def _check_cache(name, cache, like):
    _checks.tensor(name, cache)
    _checks.rank(name, cache, 4)
    _checks.same_dtype(name, cache, "the tokens", like)
    _checks.same_device(name, cache, "the tokens", like)
