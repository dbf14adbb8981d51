"""batch_invariant_mode over the matmul family: every aten product runs bik's fixed-order matmul.

Each test ties the mode's bits to bik's own op (bik.matmul / bik.linear, computed outside the
mode), checks a row alone against the same row in a larger batch with torch.equal, and, where
plain torch really differs, shows that it does (negative control).
"""

import pytest
import torch
import torch.nn.functional as F

import bik
import bik.mode
from bik.mode import batch_invariant_mode

pytestmark = pytest.mark.filterwarnings("ignore:Warning only once")

SIZES = (1, 2, 9, 33)


def _randn(seed, *shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_mv_gives_the_row_of_the_batched_linear(dtype):
    w, x = _randn(0, (300, 256), (33, 256), dtype=dtype)
    expected = bik.linear(x, w)
    if dtype == torch.float32:  # negative control: torch's gemv and gemm differ
        assert not any(torch.equal(torch.mv(w, x[i]), (x @ w.t())[i]) for i in range(33))
    with batch_invariant_mode():
        for i in (0, 7, 32):
            assert torch.equal(torch.mv(w, x[i]), expected[i])
            assert torch.equal(w @ x[i], expected[i])  # matmul(2-D, 1-D) is mv
            assert torch.equal(x[i] @ w.t(), expected[i])  # matmul(1-D, 2-D) is mm
        # how many rows the weight has does not move a bit either
        assert all(torch.equal(torch.mv(w[:n], x[0]), expected[0, :n]) for n in (1, 5, 300))


def test_mode_dot_and_vdot_give_the_entry_of_the_matmul():
    x, y = _randn(1, (33, 256), (256,))
    expected = bik.matmul(x, y[:, None])[:, 0]
    assert not all(torch.equal(torch.dot(x[i], y), (x @ y[:, None])[i, 0]) for i in range(33))
    with batch_invariant_mode():
        for i in (0, 7, 32):
            assert torch.equal(torch.dot(x[i], y), expected[i])
            assert torch.equal(torch.vdot(x[i], y), expected[i])
            assert torch.equal(x[i] @ y, expected[i])  # matmul(1-D, 1-D) is dot


# (name, call): call(rows) runs the op on the first ``rows`` rows (M) of fixed operands.
_M, _K, _N, _B = 33, 512, 300, 3  # K >= 512: torch blocks K on every CPU seen, so it differs
_A, _W, _BIAS, _IN2, _B1, _B2, _IN3 = _randn(
    2, (_M, _K), (_N, _K), (_N,), (_M, _N), (_B, _M, _K), (_B, _K, _N), (_B, _M, _N)
)
_ROWWISE = {
    "mm": lambda m: torch.mm(_A[:m], _W.t()),
    "addmm": lambda m: torch.addmm(_IN2[:m], _A[:m], _W.t(), beta=0.5, alpha=2),
    "linear": lambda m: F.linear(_A[None, :m], _W, _BIAS),
    "bmm": lambda m: torch.bmm(_B1[:, :m], _B2),
    "baddbmm": lambda m: torch.baddbmm(_IN3[:, :m], _B1[:, :m], _B2, beta=0.5, alpha=2),
    "addbmm": lambda m: torch.addbmm(_IN2[:m], _B1[:, :m], _B2),
    "addmv": lambda m: torch.addmv(_BIAS[:m], _W[:m], _A[0]),  # rows of the matrix
    "_addmm_activation": lambda m: torch._addmm_activation(_BIAS, _A[:m], _W.t(), use_gelu=True),
    "einsum": lambda m: torch.einsum("bmk,bkn->bmn", _B1[:, :m], _B2),
    "tensordot": lambda m: torch.tensordot(_A[:m], _W, dims=([1], [1])),
}


@pytest.mark.parametrize("name", sorted(_ROWWISE))
def test_mode_matmul_family_row_does_not_depend_on_the_batch(name):
    call = _ROWWISE[name]
    rows = lambda out: out[..., :1, :] if out.dim() > 1 else out[:1]
    if name in ("mm", "linear", "baddbmm", "addbmm", "addmv", "_addmm_activation"):
        # negative control: plain torch changes the row's bits with the batch
        assert not all(torch.equal(rows(call(m)), rows(call(1))) for m in SIZES)
    with batch_invariant_mode():
        alone = call(1)
        assert all(torch.equal(rows(call(m)), rows(alone)) for m in SIZES)


def test_mode_products_match_bik_bits():
    """Each product is bik's matmul on the documented operands (bias in the fp32 epilogue)."""
    with batch_invariant_mode():
        addmm = torch.addmm(_BIAS, _A, _W.t())
        baddbmm = torch.baddbmm(_BIAS, _B1, _B2)
        addbmm = torch.addbmm(_BIAS, _B1, _B2)
        addmv = torch.addmv(_BIAS, _W, _A[3])
        relu = torch._addmm_activation(_IN2, _A, _W.t(), beta=0.5)
        gelu = torch._addmm_activation(_IN2, _A, _W.t(), alpha=2, use_gelu=True)
        relu_expected = F.relu(torch.addmm(_IN2, _A, _W.t(), beta=0.5))
        gelu_expected = F.gelu(torch.addmm(_IN2, _A, _W.t(), alpha=2))  # CPU: exact GELU, as torch
    assert torch.equal(addmm, bik.linear(_A, _W, _BIAS))
    for i in range(_B):
        assert torch.equal(baddbmm[i], bik.matmul(_B1[i], _B2[i], _BIAS))
    # addbmm: the batches are one long K, summed in ascending (batch, k) order
    long_k = bik.matmul(_B1.transpose(0, 1).reshape(_M, _B * _K), _B2.reshape(_B * _K, _N), _BIAS)
    assert torch.equal(addbmm, long_k)
    assert torch.equal(addmv, bik.linear(_A[3], _W, _BIAS))
    assert torch.equal(relu, relu_expected) and torch.equal(gelu, gelu_expected)
    exact = _BIAS.double() + (_B1.double() @ _B2.double()).sum(0)
    assert torch.allclose(addbmm.double(), exact, atol=1e-3)


_FORMS = {  # (out= or in-place form, its functional form), both run under the mode
    "mm.out": (lambda o: torch.mm(_A, _W.t(), out=o), lambda: torch.mm(_A, _W.t())),
    "addmm.out": (
        lambda o: torch.addmm(_BIAS, _A, _W.t(), out=o),
        lambda: torch.addmm(_BIAS, _A, _W.t()),
    ),
    "addmm_": (
        lambda o: o.copy_(_IN2).addmm_(_A, _W.t(), beta=0.5),
        lambda: torch.addmm(_IN2, _A, _W.t(), beta=0.5),
    ),
    "bmm.out": (lambda o: torch.bmm(_B1, _B2, out=o), lambda: torch.bmm(_B1, _B2)),
    "baddbmm_": (
        lambda o: o.copy_(_IN3).baddbmm_(_B1, _B2, alpha=2),
        lambda: torch.baddbmm(_IN3, _B1, _B2, alpha=2),
    ),
    "addbmm_": (
        lambda o: o.copy_(_IN2).addbmm_(_B1, _B2),
        lambda: torch.addbmm(_IN2, _B1, _B2),
    ),
    "mv.out": (lambda o: torch.mv(_W, _A[0], out=o), lambda: torch.mv(_W, _A[0])),
    "addmv_": (
        lambda o: o.copy_(_BIAS).addmv_(_W, _A[0], beta=2),
        lambda: torch.addmv(_BIAS, _W, _A[0], beta=2),
    ),
    "dot.out": (lambda o: torch.dot(_A[0], _W[0], out=o), lambda: torch.dot(_A[0], _W[0])),
}


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_mode_out_and_inplace_forms_write_bik_bits(form):
    write, functional = _FORMS[form]
    with batch_invariant_mode():
        expected = functional()
        out = torch.empty_like(expected)
        assert write(out) is out and torch.equal(out, expected)
    assert not torch.equal(functional(), expected), "negative control: torch's own kernel differs"


def test_mode_out_form_resizes_and_writes_into_views():
    with batch_invariant_mode():
        expected = torch.mm(_A, _W.t())
        empty = torch.empty(0)
        torch.mm(_A, _W.t(), out=empty)  # an empty out is resized, as torch does
        assert torch.equal(empty, expected)
        big = torch.zeros(_M + 2, _N)
        torch.mm(_A[5:6], _W.t(), out=big[1:2])  # a row written into a view of a larger tensor
        assert torch.equal(big[1], expected[5]) and not big[0].any() and not big[2:].any()
        with pytest.raises(TypeError, match=r"out of aten\.mm\.out: expected dtype torch\.float32"):
            torch.mm(_A, _W.t(), out=torch.empty(_M, _N, dtype=torch.float64))


_NAN2, _NAN3 = torch.full((_M, _N), float("nan")), torch.full((_B, _M, _N), float("nan"))
_BETA_ZERO = {  # torch: with beta=0 the input is ignored, its NaN not propagated
    "addmm": (
        lambda: torch.addmm(_NAN2, _A, _W.t(), beta=0),
        lambda: torch.mm(_A, _W.t()),
    ),
    "baddbmm": (
        lambda: torch.baddbmm(_NAN3, _B1, _B2, beta=0, alpha=2),
        lambda: torch.bmm(_B1, _B2) * 2,
    ),
    "addbmm": (
        lambda: torch.addbmm(_NAN2, _B1, _B2, beta=0),
        lambda: torch.addbmm(torch.zeros(_N), _B1, _B2),
    ),
    "addmv": (
        lambda: torch.addmv(_NAN2[0], _W, _A[0], beta=0),
        lambda: torch.mv(_W, _A[0]),
    ),
    "_addmm_activation": (
        lambda: torch._addmm_activation(_NAN2, _A, _W.t(), beta=0),
        lambda: F.relu(torch.mm(_A, _W.t())),
    ),
}


@pytest.mark.parametrize("name", sorted(_BETA_ZERO))
def test_mode_beta_zero_ignores_the_input(name):
    ignored, expected = _BETA_ZERO[name]
    assert not ignored().isnan().any(), "torch's semantics"
    with batch_invariant_mode():
        out = ignored()
        assert not out.isnan().any()
        assert torch.equal(out, expected())
        # beta != 0 still propagates the input's NaN, as torch does
        assert torch.addmm(_NAN2, _A, _W.t(), beta=1).isnan().all()


def test_mode_refuses_fp8_and_quantised_matmuls():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w_int8 = torch.randint(-8, 8, (32, 64), dtype=torch.int8)
    scales = torch.ones(32, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    a8, b8 = torch.randn(16, 32).to(fp8), torch.randn(32, 16).to(fp8)
    one = torch.tensor(1.0)
    torch._weight_int8pack_mm(x, w_int8, scales)  # plain torch runs both on this machine
    torch._scaled_mm(a8, b8.t().contiguous().t(), one, one, out_dtype=torch.bfloat16)
    with batch_invariant_mode():
        with pytest.raises(NotImplementedError, match=r"aten\._weight_int8pack_mm .*dense float32"):
            torch._weight_int8pack_mm(x, w_int8, scales)
        with pytest.raises(NotImplementedError, match=r"aten\._scaled_mm "):
            torch._scaled_mm(a8, b8.t().contiguous().t(), one, one, out_dtype=torch.bfloat16)


def test_mode_rejects_bad_operands_naming_them():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    with batch_invariant_mode():
        with pytest.raises(ValueError, match=r"mat2 of aten\.mm: expected size 3 in dim 0"):
            torch.mm(a, b)
        with pytest.raises(TypeError, match=r"mat2 of aten\.mm: expected dtype torch\.float32"):
            torch.mm(a, torch.randn(3, 5, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"self of aten\.addmm: expected a shape broadcast"):
            torch.addmm(torch.randn(3), a, torch.randn(3, 5))
        with pytest.raises(ValueError, match=r"vec of aten\.mv: expected size 3 in dim 0"):
            torch.mv(a, torch.randn(4))
        with pytest.raises(NotImplementedError, match=r"self of aten\.dot is torch\.float64"):
            torch.dot(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))


def test_mode_out_dtype_forms_accumulate_in_fp32():
    """mm/bmm/addmm/baddbmm with out_dtype (CUDA kernels only in torch): fp32 result of the
    exact fp32 products of the bf16 operands; checked here by calling the kernels."""
    kernels = bik.mode._CUDA_ONLY
    a, w, bias = _A.bfloat16(), _W.bfloat16(), _BIAS.bfloat16()
    expected = bik.linear(a.float(), w.float())  # bf16 products are exact in fp32
    mm = kernels["mm.dtype"](a, w.t(), torch.float32)
    assert mm.dtype == torch.float32 and torch.equal(mm, expected)
    assert torch.equal(kernels["mm.dtype"](a[:1], w.t(), torch.float32), expected[:1])
    assert torch.equal(kernels["bmm.dtype"](a[None], w.t()[None], torch.float32)[0], expected)
    addmm = kernels["addmm.dtype"](bias, a, w.t(), torch.float32)
    assert torch.equal(addmm, bik.linear(a.float(), w.float(), bias.float()))
    out = torch.empty(_M, _N)
    kernels["mm.dtype_out"](a, w.t(), torch.float32, out=out)
    assert torch.equal(out, expected)
    assert torch.equal(kernels["mm.dtype"](a, w.t(), torch.bfloat16), bik.linear(a, w))


@pytest.mark.parametrize("case", ["2d-3d", "3d-2d", "2d-2d", "3d-3d"])
def test_mode_grouped_mm_matches_torchs_decomposition(case):
    """The CUDA _grouped_mm override gives the bits of torch's CPU decomposition (a loop of
    mm / bmm, which the mode runs on bik); a token's row does not depend on its group."""
    a, b = {
        "2d-3d": ((16, 64), (3, 64, 32)),
        "3d-2d": ((3, 16, 64), (64, 48)),
        "2d-2d": ((16, 96), (96, 32)),
        "3d-3d": ((3, 16, 64), (3, 64, 32)),
    }[case]
    a, b = _randn(3, a, b, dtype=torch.bfloat16)
    offs = {"2d-3d": [4, 4, 13], "3d-2d": [16, 32, 48], "2d-2d": [32, 32, 96], "3d-3d": None}[case]
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    with batch_invariant_mode():
        expected = torch._grouped_mm(a, b, offs)
        out = bik.mode._CUDA_ONLY["_grouped_mm"](a, b, offs)
    valid = slice(0, 13) if case == "2d-3d" else slice(None)  # torch leaves rows past offs unset
    assert out.shape == expected.shape and torch.equal(out[valid], expected[valid])
    if case == "2d-3d":  # token 5 (expert 2) alone in its group: same bits
        alone = bik.mode._CUDA_ONLY["_grouped_mm"](a[5:6], b, torch.tensor([0, 0, 1]).int())
        assert torch.equal(alone[0], out[5])
        assert not out[13:].any()  # rows past the last offset are zeros, not garbage
        with pytest.raises(ValueError, match=r"offs of aten\._grouped_mm: expected non-decr"):
            bik.mode._CUDA_ONLY["_grouped_mm"](a, b, torch.tensor([4, 4, 17]).int())
