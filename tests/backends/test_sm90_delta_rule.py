"""Hopper (sm_90a) proof on a machine with no GPU: the gated delta rule's Triton kernel at the
head widths of Qwen3.5 / Qwen3-Next (K = V = 128) and Kimi Linear (a decay per key channel).

- the fp32 state tile stays in registers: no local-memory spills;
- no FMA: the kernel's every product and sum round on their own, as the torch composition's;
- the binary does not change with the batch, the heads or the number of tokens (a decode
  step vs a prompt), so the order cannot either.
"""

import importlib

import pytest
import torch

sm90 = pytest.importorskip("bik.tools.sm90")
if not (sm90.TOOLS / "ptxas").exists():
    pytest.skip("the triton wheel ships no ptxas", allow_module_level=True)

rule = importlib.import_module("bik.backends.triton.delta_rule")


def launch(batch, heads, tokens, k_dim=128, v_dim=128, per_key=False):
    f32 = torch.float32
    q, k = (sm90.meta(batch, heads, tokens, k_dim, dtype=f32) for _ in range(2))
    v, out = (sm90.meta(batch, heads, tokens, v_dim, dtype=f32) for _ in range(2))
    decay = sm90.meta(batch, heads, tokens, *((k_dim,) if per_key else ()), dtype=f32)
    beta, state = (
        sm90.meta(batch, heads, tokens, dtype=f32),
        sm90.meta(batch, heads, k_dim, v_dim, dtype=f32),
    )
    return rule.delta_rule_launch(q, k, v, decay, beta, state, out)


LAUNCHES = {
    "decode": launch(1, 16, 1),
    "prefill": launch(8, 32, 4097),
    "per key": launch(2, 16, 33, per_key=True),
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


def test_the_binary_is_the_same_for_a_decode_step_and_a_prompt(binary):
    decode, prefill = binary["decode"], binary["prefill"]
    assert decode.specialization == prefill.specialization
    assert decode.sass == prefill.sass
