"""Host work of the hot eager decode calls, counted instead of timed: how many Python-level
calls (functions and builtins) one call of linear, rms_norm, token_logprobs and decode
attention makes through the op layer and the Triton launcher, with the kernel launches
themselves stubbed, and how many launches it issues.

A timing guard would be as noisy as the machine it runs on; a call count is not, and on the
host it tracks the time (a decode bik.linear: about 100 calls and 21 us on a 2-core AMD EPYC,
Triton 3.6). The budgets are today's counts with a little room: a change that adds host work
to every decode call has to raise them here, on purpose. The launch itself (the plan lookup
and Triton's compiled launcher, tests/backends/test_launch_plans.py) is not counted: it needs
a GPU driver.
"""

import sys
from collections.abc import Callable

import pytest
import torch

import bik
from bik.backends.triton import _common

BUDGETS = {  # op: (Python calls, kernel launches) of one eager call
    "linear": (105, 1),
    "rms_norm": (85, 1),
    "token_logprobs": (110, 2),
    "decode_attention": (230, 2),
}


def _calls(fn: Callable[[], object]) -> int:
    """Python-level calls ``fn()`` makes (each function or builtin entered counts once)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


def _decode_calls() -> dict[str, Callable[[], object]]:
    """One decode step's hot ops at small shapes (the count does not depend on the sizes;
    attention's keys span three splits: the split-parallel path, split states and combine)."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    gain = torch.randn(64, dtype=torch.bfloat16)
    logits = torch.randn(1, 1000)
    tokens = torch.tensor([3])
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 2 * bik.DEFAULT_SPLIT_SIZE + 5, 64, dtype=torch.bfloat16)  # 3 splits
    kv_start = torch.zeros(1, dtype=torch.int32)
    return {
        "linear": lambda: bik.linear(x, weight),
        "rms_norm": lambda: bik.rms_norm(x, gain, 1e-6),
        "token_logprobs": lambda: bik.token_logprobs(logits, tokens),
        "decode_attention": lambda: bik.attention(q, kv, kv, kv_start=kv_start),
    }


@pytest.fixture
def stubbed_launches(monkeypatch):
    """Every Triton launch recorded instead of run (its output is left as allocated)."""
    launches: list[str] = []
    monkeypatch.setattr(_common.Launch, "__call__", lambda self: launches.append(self.kernel))
    return launches


@pytest.mark.parametrize("op", sorted(BUDGETS))
def test_an_eager_decode_call_stays_within_its_host_budget(op, stubbed_launches):
    call = _decode_calls()[op]
    calls_budget, launches_budget = BUDGETS[op]
    with bik.use_backend("triton"):
        call()  # first call: caches (bucket choice, compiled-kernel parameters) fill
        stubbed_launches.clear()
        calls = _calls(call)
    assert len(stubbed_launches) == launches_budget, stubbed_launches
    assert calls <= calls_budget, f"{op}: {calls} Python calls, budget {calls_budget}"


def test_the_count_sees_added_host_work(stubbed_launches, monkeypatch):
    """The guard's negative control: one more helper call in the linear's path is counted."""
    linear = _decode_calls()["linear"]
    with bik.use_backend("triton"):
        linear()
        before = _calls(linear)
        launch = _common.Launch.__call__
        monkeypatch.setattr(_common.Launch, "__call__", lambda self: [launch(self), abs(-1)])
        assert _calls(linear) == before + 2  # the wrapper and the builtin
