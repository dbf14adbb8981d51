"""Launch plans (bik.backends.triton._common.LaunchPlans), checked on the CPU with a stand-in
kernel: a seen specialisation calls the compiled kernel directly with the arguments in the
kernel's parameter order; anything Triton's binder specialises on (dtype, alignment, an
integer's divisibility, a constexpr, warps) gets its own compile; a profiler's launch hooks
send every launch through ``kernel[grid]``. On a GPU, tests/backends/test_gpu.py runs the real
kernels through plans, and benchmarks/gpu_probe.py compares their bits with ``kernel[grid]``'s.
"""

import ast
import importlib
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

common = importlib.import_module("bik.backends.triton._common")
attention_candidates = importlib.import_module("bik.testing.attention_candidates")

PARAMETERS = [  # (name, constexpr, do_not_specialize)
    ("x_ptr", False, False),
    ("M", False, True),
    ("N", False, False),
    ("scale", False, False),
    ("BLOCK", True, False),
]


class Compiled:
    """What ``kernel[grid](...)`` returns: records the direct launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args) -> None:
        self.runs.append(args)


class Kernel:
    """A stand-in JIT function: ``params`` as Triton lists them; ``kernel[grid](**args)``
    counts a compile and returns a :class:`Compiled`."""

    def __init__(self) -> None:
        self.params = [
            SimpleNamespace(name=n, is_constexpr=c, do_not_specialize=d) for n, c, d in PARAMETERS
        ]
        self.compiles: list[dict] = []

    def __getitem__(self, grid):
        def launch(**args):
            self.compiles.append(args)
            return Compiled()

        return launch


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return common.LaunchPlans()


def launch(kernel, x=None, m=5, n=32, block=64, warps=4):
    x = torch.zeros(8) if x is None else x
    args = dict(x_ptr=x, M=m, N=n, scale=0.5, BLOCK=block)
    return common.Launch(kernel, (3,), args, num_warps=warps)


def test_a_seen_specialisation_calls_the_compiled_kernel_in_parameter_order(plans):
    kernel = Kernel()
    x = torch.zeros(8)
    plans.launch(launch(kernel, x))
    assert len(kernel.compiles) == 1
    plans.launch(launch(kernel, x, m=9))
    assert len(kernel.compiles) == 1, "M is do_not_specialize: the same binary"
    (compiled,) = plans.compiled.values()
    (args,) = compiled.runs
    assert args[:6] == (3, 1, 1, 7, "function", "metadata")  # grid padded to 3 dims, stream
    assert args[6:9] == (None, None, None)  # no launch metadata, no hooks
    assert args[9] is x and args[10:] == (9, 32, 0.5, 64)


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.zeros(8, dtype=torch.float64)),  # dtype
        dict(x=torch.zeros(9)[1:]),  # a 4-byte offset: not 16-byte aligned
        dict(n=33),  # no longer divisible by 16
        dict(n=1),  # the value 1
        dict(m=2**40),  # a 64-bit integer, even where it is not specialised on
        dict(block=128),  # a constexpr
        dict(warps=8),  # a compile option
    ],
    ids=["dtype", "alignment", "divisibility", "one", "int64", "constexpr", "warps"],
)
def test_what_the_binder_specialises_on_gets_its_own_compile(plans, change):
    kernel = Kernel()
    plans.launch(launch(kernel))
    plans.launch(launch(kernel, **change))
    assert len(kernel.compiles) == 2


def test_values_with_the_same_specialisation_share_a_plan(plans):
    kernel = Kernel()
    plans.launch(launch(kernel, n=32))
    plans.launch(launch(kernel, n=48, m=1))  # both divisible by 16; M not specialised
    assert len(kernel.compiles) == 1


def test_launch_hooks_send_every_launch_through_the_jit(plans):
    kernel = Kernel()
    knobs.runtime.launch_enter_hook.add(print)
    try:
        plans.launch(launch(kernel))
        plans.launch(launch(kernel))
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert len(kernel.compiles) == 2


def test_an_argument_without_a_key_is_refused(plans):
    kernel = Kernel()
    bad = launch(kernel)
    bad.args["x_ptr"] = object()
    with pytest.raises(TypeError, match="no plan key"):
        plans.launch(bad)


def test_host_integer_helpers_match_triton():
    for a in range(0, 300):
        for b in (1, 3, 16, 64):
            assert common.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert common.next_power_of_2(n) == triton.next_power_of_2(n)


def test_no_triton_host_arithmetic_in_the_launchers():
    """``triton.cdiv`` and ``triton.next_power_of_2`` cost microseconds a host call."""
    folder = Path(common.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) not in {
                    ("triton", "cdiv"),
                    ("triton", "next_power_of_2"),
                }, f"{path.name}: triton.{node.attr} on the host"


def _parameters(kernel):
    """LaunchPlans.parameters, also for a kernel the interpreter wraps (read off its
    signature and triton.jit's arguments)."""
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        return common.LaunchPlans().parameters(kernel)
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    return tuple(
        (name, p.annotation is tl.constexpr, name not in unspecialised)
        for name, p in inspect.signature(kernel.fn).parameters.items()
    )


def _site_keys_decide_the_binary(launches):
    """Each launcher-given plan key stands for one argument key (a superset of what
    Triton's binder specialises on)."""
    plans, full = common.LaunchPlans(), {}
    plans.parameters = _parameters  # type: ignore[method-assign]
    for launch in launches:
        assert launch.plan_key is not None
        site = plans.site_key(launch, 0)
        full.setdefault(site, set()).add(plans.key(launch, 0))
    assert all(len(keys) == 1 for keys in full.values()), "a plan key hides a specialisation"
    return len(full)


def test_the_linear_launchers_plan_key_decides_its_binary():
    sm90 = pytest.importorskip("bik.testing.sm90")
    matmul = importlib.import_module("bik.backends.triton.matmul")
    launches = []
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (1, 7, 16, 17, 64, 300, 5000):
            for n, k in ((8, 16), (24, 40), (4096, 4096), (4104, 4096), (4096, 14336)):
                x, out, weight = (
                    sm90.meta(rows, k, dtype=dtype),
                    sm90.meta(rows, n, dtype=dtype),
                    sm90.meta(n, k, dtype=dtype),
                )
                for bias in (None, sm90.meta(n, dtype=dtype)):
                    for bucket in {matmul.token_bucket(rows, n), *matmul.ALL_BUCKETS[:2]}:
                        launches.append(matmul.linear_launch(x, weight, bias, out, bucket))
    assert _site_keys_decide_the_binary(launches) > 20


def test_the_rms_norm_launchers_plan_key_decides_its_binary():
    rms_norm = importlib.import_module("bik.backends.triton.rms_norm")
    launches = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 3, 64):
            for d in (1, 7, 16, 64, 4096, 5000, 20000):
                for padded in (0, 8):  # a row stride wider than the row
                    x = torch.zeros(rows, d + padded, dtype=dtype)[:, :d]
                    weight, out = torch.zeros(d, dtype=dtype), torch.zeros(rows, d, dtype=dtype)
                    for eps in (1e-6, 1e-5, 0):
                        launches.append(rms_norm.rms_norm_launch(x, weight, out, eps))
    assert _site_keys_decide_the_binary(launches) > 20


def _attention_cases():
    """Decode, prefill and paged steps over dtypes, head shapes, options, sinks and paths."""
    from bik.backends.base import AttentionOptions

    options = [
        AttentionOptions(True, 0.125, 256),
        AttentionOptions(False, 0.125, 512),
        AttentionOptions(True, 0.125, 256, softcap=30.0, window=128),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        for hq, hkv, d in ((8, 8, 64), (32, 8, 128), (4, 1, 256)):
            for tq, tk in ((1, 1), (1, 700), (3, 700), (80, 80), (200, 9000)):
                for option in options:
                    for sinks in (None, torch.zeros(hq, device="meta")):
                        yield dtype, hq, hkv, d, tq, tk, option, sinks


def test_the_attention_launchers_plan_key_decides_its_binaries():
    attention = importlib.import_module("bik.backends.triton.attention_launch")
    launches = []
    for dtype, hq, hkv, d, tq, tk, option, sinks in _attention_cases():
        meta = dict(dtype=dtype, device="meta")
        q, out = torch.empty(2, hq, tq, d, **meta), torch.empty(2, hq, tq, d, **meta)
        k = torch.empty(2, tk, hkv, d, **meta).transpose(1, 2)  # a strided view
        v = torch.empty(2, hkv, tk, d, **meta)
        padded = torch.empty(2, hkv, tk, d + 1, **meta)[..., :d]  # strides of no 16-byte unit
        kv_start = torch.empty(2, dtype=torch.int32, device="meta")
        for split_parallel in (None, True, False):
            for values in (v, padded):
                launches += attention.attention_launches(
                    q, k, values, kv_start, out, option, sinks, split_parallel=split_parallel
                )
        for choice in (
            {"mask_every_block": True},
            {"rescale_acc": attention_candidates.rescale_when_max_moved},
        ):
            launches += attention.attention_launches(
                q, k, v, kv_start, out, option, sinks, **choice
            )
        table = torch.empty(2, 64, dtype=torch.int32, device="meta")
        lens = torch.empty(2, dtype=torch.int32, device="meta")
        caches = [torch.empty(128, hkv, 16, d, **meta) for _ in "kv"]
        step = torch.empty(2, hq, 1, d, **meta)
        launches += attention.attention_launches(
            step, *caches, kv_start, step, option, sinks, pages=(table, None, lens)
        )
        packed = torch.empty(1, hq, 2 * tq, d, **meta)
        starts = torch.empty(3, dtype=torch.int32, device="meta")
        launches += attention.attention_launches(
            packed, *caches, kv_start, packed, option, sinks, pages=(table, starts, lens)
        )
    assert _site_keys_decide_the_binary(launches) > 50


def test_the_log_softmax_launchers_plan_key_decides_their_binaries():
    lsm = importlib.import_module("bik.backends.triton.log_softmax")
    launches = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 3, 200):
            for vocab in (1, 7, 100, 4096, 32000, 151936):
                for padded in (0, 8):
                    x = torch.empty(rows, vocab + padded, dtype=dtype, device="meta")[:, :vocab]
                    for temperature in (1.0, 0.7, 2):
                        out = torch.empty(rows, vocab, dtype=torch.float32, device="meta")
                        launches += lsm.log_softmax_launches(x, out, temperature)
                        tokens = torch.empty(rows, dtype=torch.long, device="meta")
                        out = torch.empty(rows, dtype=torch.float32, device="meta")
                        launches += lsm.token_logprobs_launches(x, tokens, out, temperature)
    assert _site_keys_decide_the_binary(launches) > 50


@pytest.mark.parametrize("shape", [(1, 64), (300, 4096), (8, 2048)])
def test_a_tma_descriptor_has_the_fields_triton_constructor_sets(shape):
    """bik's descriptors (linear, attention) skip the constructor's checks, never its fields: a new
    Triton field without a default, or a default that changes, shows up here."""
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    fast = common.tma_descriptor(tensor, [16, 64])
    built = TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), [16, 64])
    assert vars(fast).keys() == vars(built).keys()
    assert fast.base is built.base
    assert all(vars(fast)[k] == vars(built)[k] for k in vars(built) if k != "base")


def test_a_self_check_that_raises_keeps_the_plain_launch(monkeypatch):
    """Issue 72, item 8: a device self-check whose check raised propagated the exception
    instead of taking the plain launch (which needs no proof)."""
    from bik.backends.triton import _common

    monkeypatch.setattr(_common, "SELF_CHECK_DEVICES", ("cpu",))
    choice = _common.SelfCheck("a fast choice")

    def broken() -> bool:
        raise RuntimeError("out of resources")

    device = torch.device("cpu")
    with pytest.warns(UserWarning, match=r"could not be checked \(RuntimeError\('out of resou"):
        assert not choice.allows(("key",), device, broken)
    assert not choice.allows(("key",), device, broken)  # decided once
    assert choice.allows(("other",), device, lambda: True)
