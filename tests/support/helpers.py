"""Shared test helpers: random inputs, bitwise and tolerance checks."""

import torch
from conftest import DEVICE

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# |bik - float64 reference| <= ATOL + RTOL * |reference|, per input dtype. Low-precision
# outputs are one rounding of an fp32 result, so their bound is a few output ulps.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}


def randn(shape, dtype, seed, scale=1.0):
    """Deterministic normal tensor on the test device, exactly representable in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_bitwise(actual, expected, what=""):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what}: not bit-identical (max abs diff {diff:.3e})")


def assert_close_to_reference(actual, reference, dtype, what=""):
    tol = TOLERANCES[dtype]
    err = (actual.double() - reference).abs()
    bound = tol["atol"] + tol["rtol"] * reference.abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: error {err.max().item():.3e} exceeds {tol} for {dtype}"


def embed_row(row, others, position):
    """A batch made of ``others`` with ``row`` inserted at ``position`` (dim 0)."""
    return torch.cat([others[:position], row, others[position:]])
