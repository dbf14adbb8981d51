"""Hopper (sm_90a) proof on a machine with no GPU: the recurrences' Triton kernels, the gated
delta rule at the head widths of Qwen3.5 / Qwen3-Next (K = V = 128) and Kimi Linear (a decay
per key channel), the Mamba2 scan at Nemotron-H's (head dim 64, state 128, 8 groups).

- the fp32 state tile stays in registers: no local-memory spills;
- no FMA: the kernel's every product and sum round on their own, as the torch composition's;
- the binary does not change with the batch, the heads or the number of tokens (a decode
  step vs a prompt), so the order cannot either.
"""

import importlib

import pytest
import torch

sm90 = pytest.importorskip("bik.testing.sm90")
if not (sm90.TOOLS / "ptxas").exists():
    pytest.skip("the triton wheel ships no ptxas", allow_module_level=True)

rule = importlib.import_module("bik.backends.triton.delta_rule")
scan = importlib.import_module("bik.backends.triton.selective_scan")


def delta_rule(batch, heads, tokens, k_dim=128, v_dim=128, per_key=False):
    f32 = torch.float32
    q, k = (sm90.meta(batch, heads, tokens, k_dim, dtype=f32) for _ in range(2))
    v, out = (sm90.meta(batch, heads, tokens, v_dim, dtype=f32) for _ in range(2))
    decay = sm90.meta(batch, heads, tokens, *((k_dim,) if per_key else ()), dtype=f32)
    beta, state = (
        sm90.meta(batch, heads, tokens, dtype=f32),
        sm90.meta(batch, heads, k_dim, v_dim, dtype=f32),
    )
    return rule.delta_rule_launch(q, k, v, decay, beta, state, out)


def selective_scan(batch, heads, tokens, head_dim=64, groups=8, state_dim=128):
    f32 = torch.float32
    decay = sm90.meta(batch, heads, tokens, dtype=f32)
    dtx, out = (sm90.meta(batch, heads, tokens, head_dim, dtype=f32) for _ in range(2))
    b, c = (sm90.meta(batch, groups, tokens, state_dim, dtype=f32) for _ in range(2))
    state = sm90.meta(batch, heads, head_dim, state_dim, dtype=f32)
    return scan.selective_scan_launch(decay, dtx, b, c, state, out)


LAUNCHES = {
    "decode": delta_rule(1, 16, 1),
    "prefill": delta_rule(8, 32, 4097),
    "per key": delta_rule(2, 16, 33, per_key=True),
    "scan decode": selective_scan(1, 128, 1),
    "scan prefill": selective_scan(8, 128, 4097),
}


@pytest.fixture(scope="module")
def binary():
    return dict(zip(LAUNCHES, sm90.compile_launches(list(LAUNCHES.values()))))


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_the_state_tile_stays_in_registers_and_nothing_fuses(binary, name):
    compiled = binary[name]
    assert compiled.local_bytes == 0, f"spills: {compiled.local_bytes} bytes of local memory"
    assert compiled.count("FFMA") == 0
    assert compiled.count("FMUL") > 0 and compiled.count("FADD") > 0


@pytest.mark.parametrize("kernel", ["", "scan "])
def test_the_binary_is_the_same_for_a_decode_step_and_a_prompt(binary, kernel):
    decode, prefill = binary[kernel + "decode"], binary[kernel + "prefill"]
    assert decode.specialization == prefill.specialization
    assert decode.sass == prefill.sass
