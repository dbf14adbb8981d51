"""The Triton attention compiled for Hopper (sm_90a) with no GPU, its SASS read back.

bf16, head dim 128, GQA 32 query / 8 kv heads: prefill (Tq = Tk = 8192) and decode (Tq = 1,
Tk = 8192) use only HGMMA (never HMMA) and the same MMA instructions, spill nothing to local
memory, and their binaries do not change with Tk (8192 vs 8193) nor with the decode's Tq
(1 vs 3): the bits cannot depend on a length through the compiler's choices. The paged kernel
(a packed step over a 16-key-page cache) uses the same MMA instructions and spills nothing,
its binary the same for 8192 or 8193 tokens and 16 or 5 sequences; a paged decode step runs
split-parallel with decode's instructions. fp32 uses no
tensor-core instruction at all (IEEE, never TF32), the same warps on both paths, and spills
nothing either. 16-bit keys and values arrive by TMA (paged caches: pointer loads). The
candidate prefill tiles (128 rows over two warpgroups) and the conditional rescale issue
prefill's instructions and spill nothing. Checked with the Triton of .venv (3.9) and of `make
test-gpu-image` (3.6).

The launches are described here with meta tensors and compiled by ``bik.testing.sm90``.
"""

import pytest
import torch

from bik.backends.base import AttentionOptions

sm90 = pytest.importorskip("bik.testing.sm90")

from bik.testing.attention_candidates import (  # noqa: E402 (needs triton)
    PREFILL_CANDIDATES,
    rescale_when_max_moved,
)

pytestmark = pytest.mark.skipif(
    not all((sm90.TOOLS / tool).exists() for tool in ("ptxas", "cuobjdump")),
    reason="the triton wheel ships no ptxas / cuobjdump",
)

HQ, HKV, DIM = 32, 8, 128
FP_OPS = ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU")
CASES = {  # name: (Tq, Tk, dtype)
    "prefill": (8192, 8192, "bfloat16"),
    "prefill_8193": (8193, 8193, "bfloat16"),
    "decode": (1, 8192, "bfloat16"),
    "decode_8193": (1, 8193, "bfloat16"),
    "decode_tq3": (3, 8192, "bfloat16"),
    # IEEE fp32: no tensor cores (never TF32), 16-row tiles
    "fp32_prefill": (8192, 8192, "float32"),
    "fp32_decode": (1, 8192, "float32"),
}


# A packed step over a paged cache (paged_attention): tokens, sequences, dtype; 16-key pages
PAGED_CASES = {
    "paged": (8192, 16, "bfloat16"),
    "paged_8193": (8193, 16, "bfloat16"),
    "paged_5_sequences": (8192, 5, "bfloat16"),
    "fp32_paged": (8192, 16, "float32"),
    "paged_decode": (16, 16, "bfloat16"),  # one token per sequence: split-parallel
    "fp32_paged_decode": (16, 16, "float32"),
}
PAGE, BLOCKS = 16, 8192


def launches(tq, tk, dtype, **choices):
    from bik.backends.triton.attention_launch import attention_launches

    dtype = getattr(torch, dtype)
    q, out = sm90.meta(1, HQ, tq, DIM, dtype=dtype), sm90.meta(1, HQ, tq, DIM, dtype=dtype)
    k, v = sm90.meta(1, HKV, tk, DIM, dtype=dtype), sm90.meta(1, HKV, tk, DIM, dtype=dtype)
    kv_start = sm90.meta(1, dtype=torch.int32)
    options = AttentionOptions(True, DIM**-0.5, 256)
    return attention_launches(q, k, v, kv_start, out, options, **choices)


def paged_launches(tokens, sequences, dtype):
    """As bik's triton paged_attention launches it: q and out views of packed [T, Hq, D]."""
    from bik.backends.triton.attention_launch import attention_launches

    dtype = getattr(torch, dtype)
    decode = tokens == sequences
    q, out = (
        sm90.meta(tokens, HQ, DIM, dtype=dtype).unsqueeze(2)
        if decode
        else sm90.meta(tokens, HQ, DIM, dtype=dtype).transpose(0, 1)[None]
        for _ in "qo"
    )
    k, v = (sm90.meta(BLOCKS, HKV, PAGE, DIM, dtype=dtype) for _ in "kv")
    table = sm90.meta(sequences, BLOCKS // sequences, dtype=torch.int32)
    starts, lens = (
        sm90.meta(sequences + 1, dtype=torch.int32),
        sm90.meta(sequences, dtype=torch.int32),
    )
    first_keys = sm90.meta(sequences, dtype=torch.int32)
    return attention_launches(
        q,
        k,
        v,
        first_keys,
        out,
        AttentionOptions(True, DIM**-0.5, 256),
        pages=(table, None if decode else starts, lens),
    )


# The prefill variants benchmarks/gpu_probe.py times against the shipped kernel: its tiles
# and the conditional rescale
CANDIDATES: dict[str, dict] = {
    f"prefill_{'x'.join(map(str, tile))}": {"tile": tile} for tile in PREFILL_CANDIDATES
}
CANDIDATES["prefill_conditional_rescale"] = {"rescale_acc": rescale_when_max_moved}


@pytest.fixture(scope="module")
def facts():
    """{case: [facts of each launch's binary]}, every case compiled in one go."""
    cases = [(name, launch) for name, shape in CASES.items() for launch in launches(*shape)]
    cases += [
        (name, *launches(8192, 8192, "bfloat16", **choices)) for name, choices in CANDIDATES.items()
    ]
    cases += [
        (name, launch) for name, shape in PAGED_CASES.items() for launch in paged_launches(*shape)
    ]
    binaries = sm90.compile_launches([launch for _, launch in cases])
    facts = {name: [] for name in [*CASES, *PAGED_CASES, *CANDIDATES]}
    for (name, launch), binary in zip(cases, binaries):
        facts[name].append(
            dict(
                kernel=binary.name,
                split_parallel=launch.args.get("SPLIT_PARALLEL"),
                mma=sorted(binary.mma),
                hmma=binary.count("HMMA"),
                local_bytes=binary.local_bytes,
                num_warps=binary.num_warps,
                code=binary.code(),
                specialisation=binary.specialization,
                async_loads=binary.count("LDGSTS"),
                tma_loads=binary.count("UTMALDG"),
                shared_bytes=binary.shared_bytes,
                fp_ops={op: n for op, n in binary.opcodes.items() if op.startswith(FP_OPS)},
            )
        )
    return facts


def test_paths(facts):
    # Prefill merges its splits in registers (one kernel); decode runs split-parallel plus
    # the combine; a paged step is one in-register launch.
    assert [f["split_parallel"] for f in facts["prefill"]] == [False]
    assert [f["split_parallel"] for f in facts["paged"]] == [False]
    assert [f["kernel"] for f in facts["paged_decode"]] == ["_attention_kernel", "_combine_kernel"]
    assert facts["paged_decode"][0]["split_parallel"] is True
    assert [f["kernel"] for f in facts["decode"]] == ["_attention_kernel", "_combine_kernel"]
    assert facts["decode"][0]["split_parallel"] is True


def test_only_hgmma_and_the_same_mma_in_prefill_and_decode(facts):
    for case, binaries in facts.items():
        for f in binaries:
            assert f["hmma"] == 0, (case, f)
            if case.startswith("fp32"):  # IEEE fp32 dots: no tensor-core instruction at all
                assert f["mma"] == [], (case, f)
            elif f["kernel"] == "_attention_kernel":  # the combine does no dot
                assert f["mma"] and all(op.startswith("HGMMA.") for op in f["mma"]), (case, f)
    assert facts["prefill"][0]["mma"] == facts["decode"][0]["mma"] == facts["paged"][0]["mma"]
    assert facts["paged_decode"][0]["mma"] == facts["decode"][0]["mma"]
    for candidate in CANDIDATES:  # (128-row tiles: two warpgroups) the shipped tile's HGMMA
        assert facts[candidate][0]["mma"] == facts["prefill"][0]["mma"], candidate
    for prefill, decode in [
        ("prefill", "decode"),
        ("fp32_prefill", "fp32_decode"),
        ("prefill", "paged"),
        ("fp32_prefill", "fp32_paged"),
    ]:
        assert facts[prefill][0]["num_warps"] == facts[decode][0]["num_warps"]


def test_each_candidate_reaches_the_kernel(facts):
    """A candidate the launch dropped (a tile or a rescale function not passed on) would
    compile to the shipped prefill's code, and its same-bits tests would pass vacuously."""
    for candidate in CANDIDATES:
        assert facts[candidate][0]["code"] != facts["prefill"][0]["code"], candidate


def test_keys_and_values_arrive_by_tma_unless_paged(facts):
    """16-bit contiguous keys and values by TMA boxes (fewer registers: no per-element
    addresses); fp32 and paged caches by pointer loads."""
    for case, binaries in facts.items():
        split = binaries[0]
        assert split["kernel"] == "_attention_kernel"
        by_tma = not case.startswith(("fp32", "paged"))
        assert (split["tma_loads"] > 0) == by_tma, (case, split["tma_loads"])


def test_no_spills(facts):
    for case, binaries in facts.items():
        for f in binaries:
            assert f["local_bytes"] == 0, (case, f)


def test_binaries_do_not_change_with_lengths(facts):
    # Same specialisation (so the same compile-cache entry) and the same instructions.
    for case, same_as in [
        ("prefill_8193", "prefill"),
        ("decode_8193", "decode"),
        ("decode_tq3", "decode"),
        ("paged_8193", "paged"),
        ("paged_5_sequences", "paged"),
    ]:
        for key in ("specialisation", "code"):
            assert [f[key] for f in facts[case]] == [f[key] for f in facts[same_as]], (case, key)


def test_the_combine_loads_split_states_ahead_of_its_fold(facts):
    """The fold over the splits is a chain: each split's state is copied to shared memory
    (cp.async) stages ahead, never waited for at its own turn. Its arithmetic is the same
    for the contiguous and the paged decode (the same merge, the same binary but for reads)."""
    combines = {
        case: f
        for case, binaries in facts.items()
        for f in binaries
        if f["kernel"] == "_combine_kernel"
    }
    assert set(combines) >= {"decode", "paged_decode", "fp32_decode"}
    for case, f in combines.items():
        assert f["async_loads"] > 0 and f["shared_bytes"] <= 227 * 1024, (case, f)
    assert combines["decode"]["fp_ops"] == combines["paged_decode"]["fp_ops"]
