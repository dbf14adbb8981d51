"""The pairwise tree of ``bik.layers.delta_rule.tree_sum`` inside a Triton kernel, shared by the
recurrences' kernels: the same additions in the same order as the torch composition."""

import triton
import triton.language as tl


@triton.jit
def tree_over_last(x, ROWS: tl.constexpr, W: tl.constexpr, LEVELS: tl.constexpr):
    """``x [ROWS, W]`` (``W = 2**LEVELS``, entries past the real length zero) -> ``[ROWS]``:
    columns ``0 .. W/2-1`` plus columns ``W/2 .. W-1``, halving until one is left."""
    for level in tl.static_range(LEVELS):
        pair = tl.permute(tl.reshape(x, (ROWS, 2, W >> (level + 1))), (0, 2, 1))
        first, second = tl.split(pair)
        x = first + second
    return tl.reshape(x, (ROWS,))
