"""Hopper (sm_90a) proof on a machine with no GPU: the row kernels (rms_norm, log_softmax,
token_logprobs), compiled by the Triton wheel's own ptxas for the launches bik makes.

- rms_norm (bf16, D 4096 and 8192) reads x once, in 16-byte loads, with no local-memory
  spills;
- the log-softmax statistics kernel (bf16, V 151936) runs one exp (MUFU.EX2) per loaded
  element, half of the former per-lane online softmax's two; the write kernel runs none;
- no launch's binary changes with the number of rows (1 vs 4097) or with a strided row view,
  so the reduction trees cannot either.
"""

import importlib

import pytest
import torch

sm90 = pytest.importorskip("bik.testing.sm90")
if not (sm90.TOOLS / "ptxas").exists():
    pytest.skip("the triton wheel ships no ptxas", allow_module_level=True)

rms = importlib.import_module("bik.backends.triton.rms_norm")
lsm = importlib.import_module("bik.backends.triton.log_softmax")
VOCAB = 151936  # Qwen2 / Qwen3


def rms_norm(rows, d, stride=None):
    x = sm90.meta(rows, stride or d)[:, :d]
    return rms.rms_norm_launch(x, sm90.meta(d), sm90.meta(rows, d), 1e-6)


def log_softmax(rows, temperature=1.0, stride=None):
    x = sm90.meta(rows, stride or VOCAB)[:, :VOCAB]
    stats, fold, write = lsm.log_softmax_launches(x, sm90.meta(rows, VOCAB), temperature)
    tokens, out = sm90.meta(rows, dtype=torch.int64), sm90.meta(rows, dtype=torch.float32)
    _, gather = lsm.token_logprobs_launches(x, tokens, out, temperature)
    return {"stats": stats, "fold": fold, "write": write, "token": gather}


LAUNCHES = {
    **{("rms", d, rows): rms_norm(rows, d) for d in (4096, 8192) for rows in (1, 4097)},
    ("rms", 4096, "strided"): rms_norm(64, 4096, stride=3 * 4096),
    **{(name, rows): launch for rows in (1, 4097) for name, launch in log_softmax(rows).items()},
    **{(name, "strided"): launch for name, launch in log_softmax(64, stride=VOCAB + 8).items()},
    ("stats", "T"): log_softmax(4, temperature=0.7)["stats"],
}


@pytest.fixture(scope="module")
def binary():
    """Every launch above compiled for sm_90a, in one go."""
    return dict(zip(LAUNCHES, sm90.compile_launches(list(LAUNCHES.values()))))


def ops(compiled, prefix):
    """Instructions whose opcode, with its modifiers, starts with ``prefix``."""
    return sum(n for op, n in compiled.opcodes.items() if op.startswith(prefix))


@pytest.mark.parametrize("d, warps", [(4096, 8), (8192, 16)])
def test_rms_norm_reads_the_row_once_in_16_byte_loads(binary, d, warps):
    compiled = binary["rms", d, 1]
    assert compiled.local_bytes == 0, f"spills: {compiled.local_bytes} bytes of local memory"
    assert compiled.num_warps == warps
    vectors = d // (32 * warps) // 8  # 16-byte vectors of 8 bf16 per thread: one row
    # x once and the weight once, every global access 16 bytes wide.
    assert ops(compiled, "LDG.E.128") == 2 * vectors == compiled.count("LDG")
    assert ops(compiled, "STG.E.128") == vectors == compiled.count("STG")
    assert compiled.count("MUFU") == 1  # the one rsqrt


def test_log_softmax_statistics_take_one_exp_per_element(binary):
    stats = binary["stats", 1]
    assert stats.local_bytes == 0
    width = lsm.segment_width(VOCAB)
    per_thread = width // (32 * stats.num_warps)  # one segment per program, no loop
    assert ops(stats, "LDG.E.128") == per_thread // 8 == stats.count("LDG")
    # One exp per element; the per-lane online softmax this replaced ran two per element in
    # its loop (64 at this width and warp count), plus one per lane at the end.
    assert ops(stats, "MUFU.EX2") == per_thread
    scaled = binary["stats", "T"]
    assert ops(scaled, "MUFU.EX2") == per_thread
    assert ops(scaled, "MUFU.RCP") == 1  # x / T: one reciprocal of T, IEEE-refined per element


def test_log_softmax_write_and_token_kernels(binary):
    write = binary["write", 1]
    assert write.local_bytes == 0 and ops(write, "MUFU") == 0
    assert ops(write, "LDG.E.128") > 0 and ops(write, "STG.E.128") > 0
    for name in ("fold", "token"):
        assert binary[name, 1].local_bytes == 0


@pytest.mark.parametrize("name", ["rms 4096", "rms 8192", "stats", "fold", "write", "token"])
def test_the_row_count_and_row_stride_never_change_the_binary(binary, name):
    if name.startswith("rms"):
        d = int(name.split()[1])
        same = [binary["rms", d, 1], binary["rms", d, 4097]]
        if d == 4096:
            same.append(binary["rms", d, "strided"])
    else:
        same = [binary[name, 1], binary[name, 4097], binary[name, "strided"]]
    assert len({compiled.code() for compiled in same}) == 1
