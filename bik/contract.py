"""The invariance contract: the constants every backend shares, and each op's reduction order.

A row's output bits depend only on that row's inputs and the weights: not on the batch size
or the row's position in it, not on chunked prefill vs decode, not on padding or KV-cache
capacity, not on the thread or SM count, not on reruns (docs/design.md). What makes that true
is one fixed reduction order per output element, per backend:

matmul / linear
    Each output element is one fp32 accumulator over K in ascending order (Triton: fixed
    BLOCK_K tiles; cpu: one fma per k, or one AVX512-BF16 pair dot product per two k; cuda:
    one thread's fma chain). No split-K, no stream-K, no atomics. Bias is added in fp32
    before the single rounding to the output dtype.
rms_norm, log_softmax, token_logprobs
    One row per program / thread. The row is read in chunks whose width is a function of the
    row length only (:func:`row_chunk`, never of the number of rows); per-lane partials over
    ascending chunks, then one fixed tree across lanes. fp32 math. ``token_logprobs`` is
    fp32 ``log_softmax(logits / temperature)`` gathered at the token: the one log-prob formula
    of sampler and trainer. The Triton kernels refine this:

    - rms_norm: a row of up to :data:`RMS_NORM_ONE_PASS` elements is one chunk of
      ``row_chunk(D, RMS_NORM_ONE_PASS)`` lanes held in registers (x read once); a longer row
      runs the per-lane scheme above in chunks of :data:`ROW_CHUNK_CAP`.
    - log_softmax, token_logprobs: one program per (row, segment), the row cut into
      segments of ``row_chunk(V, LOG_SOFTMAX_SEGMENT)`` elements. A segment gives its max
      (a fixed tree) and the sum of ``exp(x/T - max)`` (a fixed tree, one exp per element);
      a row's segments are then folded in ascending order by one merge,
      ``(m, s) + (m', s') = (M, s*exp(m - M) + s'*exp(m' - M))``, ``M = max(m, m')`` (0 in
      the exponents when both are -inf). Both ops share the segment statistics, the fold and
      the output expression ``(x/T - max) - log(sum)``.

    The trees' shapes follow the GPU register layout, which the widths above, the warp
    count (a function of the width) and the 16-byte vector width (a function of the row
    length and dtype) fix.
attention
    Online softmax over blocks of :data:`KEY_BLOCK` keys counted from each row's first valid
    key (so left padding never moves a boundary). Blocks are grouped into splits of a FIXED
    number of keys (``split_size``, a multiple of :data:`KEY_BLOCK`, default
    :data:`DEFAULT_SPLIT_SIZE`), never a fixed number of splits; inside a split blocks run in
    ascending order, and split partials are merged in ascending split order. Prefill, chunked
    prefill and decode run this same algorithm.
row-parallel linear, tensor-parallel-invariant order (opt-in: ``tp_invariant=True``)
    A linear that tensor parallelism splits along K (attention's output projection, the MLP's
    down projection) reduces K in :data:`TP_CHUNKS` equal contiguous chunks, whatever the TP
    degree: each chunk is one chain from zero into fp32, the backend matmul's own order (one
    accumulator, ascending k, on the exact fp32 casts; on the triton backend 16-bit inputs
    run its tensor-core MMA chain on the values as they are, a backend-specific order), the
    chunk partials are summed in fp32 by one balanced pairwise tree (:func:`tp_tree_sum`,
    chunks ``0 .. C/2-1`` on the left), then the bias, then one rounding. TP rank r of T (a power of
    two dividing C) owns chunks ``r*C/T .. (r+1)*C/T - 1``, one subtree: it reduces that subtree
    locally, the ranks' fp32 partials are gathered and summed in rank order by the top of the
    same tree (never by an all-reduce, whose order the library picks). TP 1, 2, 4 ... C then
    give the same bits, and the one-process trainer runs the same order in the same layers.
    Column-parallel linears and attention (whole heads per rank) keep their order; a
    vocab-parallel embedding and LM head are exact (logits are gathered before the
    log-softmax).
gated delta rule (linear attention: Qwen3.5, Qwen3-Next, Kimi Linear; bik.layers.delta_rule)
    The recurrent state is fp32 and runs token by token in position order, for a prompt as
    for a decode step (a prefill is the recurrence over its tokens); each token decays the
    state (one factor per head, or per key channel for Kimi Delta Attention), reads it at
    the key, writes the gated correction and reads the output at the query, every sum over
    the key dimension one fixed pairwise tree (zero-padded to a power of two),
    all elementwise per row. Batch, padding, thread count and where calls cut the sequence
    (the state is carried exactly) do not move a bit. The chunked parallel form is not used:
    it sums in another order than decode. The short causal convolution before it sums its
    taps in ascending order in fp32 (oldest input first, missing inputs as exact zeros) and
    rounds once; the decay ``g`` and the write strength ``beta`` are elementwise formulas
    (``bik.softplus``, ``bik.sigmoid``) whose bits do not depend on the tensor's layout.
Mamba2 selective scan (the state-space layers of Nemotron-H; bik.layers.mamba2)
    The same discipline: the fp32 state runs token by token in position order, decayed by
    ``exp(dt * A)``, written with ``(dt * x) (x) B``, read as one fixed pairwise tree over the
    state dimension against ``C``, plus ``D * x``; the convolution before it as above, with its
    bias added after the taps; the step ``dt`` through ``bik.softplus``.

The compiled backends read the same numbers from ``csrc/include/bik/contract.h``; their
bindings export them and a test asserts that the two agree. docs/design.md explains the whole
design.
"""

import torch

KEY_BLOCK: int = 32
"""Keys per attention block; every split size is a multiple of it."""

DEFAULT_SPLIT_SIZE: int = 256
"""Keys per attention split unless the caller fixes another."""

ROW_CHUNK_CAP: int = 4096
"""Widest chunk a one-row-per-program Triton kernel reads at once (see :func:`row_chunk`)."""

RMS_NORM_ONE_PASS: int = 16384
"""Triton rms_norm: the longest row kept in registers as one chunk (read once); longer rows
are read twice in chunks of :data:`ROW_CHUNK_CAP`."""

LOG_SOFTMAX_SEGMENT: int = 4096
"""Triton log_softmax / token_logprobs: a row longer than this is cut into segments of this
many elements (each segment's statistics are one program's work, so a few long rows still fill
a GPU); a shorter row is one segment of :func:`row_chunk` elements."""

MATMUL_BLOCK_K: int = 32
"""K tile of the Triton matmul: each output element adds its K tiles in ascending order."""

CPU_LANES: int = 16
"""cpu backend: row reductions and dot products run in this many interleaved partial sums
(lane l takes elements l, l + CPU_LANES, ...), then one fixed pairwise tree."""

CUDA_ROW_THREADS: int = 256
"""cuda backend: a row reduction runs on this many threads (strided partials), then one fixed
shared-memory tree."""

TP_CHUNKS: int = 8
"""Chunks of a row-parallel linear's K under the tensor-parallel-invariant order: the largest
TP degree it supports (any power of two dividing it gives the same bits)."""

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The integer each floating dtype is passed as to the compiled kernels (enum bik::DType)."""

FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(DTYPE_CODES)
"""The input dtypes every op accepts."""

DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}
"""The same dtypes by name ("float32", "bfloat16", "float16"), as command lines take them."""


def row_chunk(length: int, cap: int = ROW_CHUNK_CAP) -> int:
    """Chunk width for a row of ``length`` elements: the next power of two, at most ``cap``.

    A function of the row length only, never of the number of rows, so every row of a batch
    is reduced in the same chunks as it would be alone.
    """
    width = 1
    while width < length:
        width *= 2
    return min(width, cap)


def check_split_size(split_size: int | None) -> int:
    """``split_size`` validated (a positive multiple of :data:`KEY_BLOCK`), or the default."""
    if split_size is None:
        return DEFAULT_SPLIT_SIZE
    if (
        isinstance(split_size, bool)
        or not isinstance(split_size, int)
        or split_size <= 0
        or split_size % KEY_BLOCK
    ):
        raise ValueError(
            f"split_size: expected a positive multiple of {KEY_BLOCK} (the key block), "
            f"got {split_size!r}"
        )
    return split_size


def tp_tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The TP-invariant order's tree over its chunk partials (a power-of-two count): the
    balanced pairwise sum, left half + right half, recursively."""
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return tp_tree_sum(parts[:half]) + tp_tree_sum(parts[half:])
