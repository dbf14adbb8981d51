"""The Triton attention's candidate choices: not shipped until a GPU shows they pay, so kept
out of the shipped kernel and its launcher. Each gives the shipped bits (the interpreter
tests check it: tests/backends/test_triton_attention.py) and compiles for sm_90a with
prefill's instructions and no spill (tests/backends/test_sm90_attention.py);
benchmarks/gpu_probe.py's ``prefill`` part times each against the shipped kernel and compares
every row's bits on a GPU, which decides whether one ships.

- :data:`PREFILL_CANDIDATES`: 16-bit prefill tiles of two warpgroups (each the shipped tile's
  HGMMA on its 64 rows) sharing every key and value block, which halves those loads per
  FLOP. A row's arithmetic is its warpgroup's, the same as in a 64-row tile, and the rows a
  tile adds only see identity work, so the bits do not move. Pass as ``tile=``.
- :func:`rescale_when_max_moved`: the accumulator rescaled only after a key block that gave
  some row of the tile a new maximum. Pass as ``rescale_acc=``.
"""

import triton
import triton.language as tl

from bik.backends.triton.attention_launch import AttentionTile

PREFILL_CANDIDATES = (AttentionTile(128, 8, 3), AttentionTile(128, 8, 2))


@triton.jit
def rescale_when_max_moved(acc, rescale, row_max, new_max):
    """The shipped rescale (:func:`bik.backends.triton.attention.rescale_acc`) skipped when no
    row's maximum moved: exact, since such a row's rescale is exp(0) = 1."""
    if tl.max((new_max != row_max).to(tl.int32), axis=0) > 0:
        acc = acc * rescale[:, None]
    return acc
