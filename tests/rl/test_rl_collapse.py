"""rl_harness collapse detector: the smoothed grad-norm drop flag and its own factor, the
blow-up flag's factor, and a deterministic resume through state_dict; the length-surge LR
schedule that reacts to the same signals."""

import copy
import json

import pytest

from rl_harness import collapse, config
from rl_harness.collapse import Detector, smoothed_grad_norm
from rl_harness.config import CollapseConfig, LRScheduleConfig
from rl_harness.schedule import LRSchedule


def _step(grad_norm, reward=0.5, length=10.0, **extra):
    return {"reward/mean": reward, "grad_norm": grad_norm, "response_length/mean": length, **extra}


def _run(detector, grad_norms):
    return [detector.update(_step(g))["grad_norm_drop"] for g in grad_norms]


def test_smoothed_grad_norm_is_a_rolling_median():
    g = [1.0, 9.0, 2.0, 3.0, 0.5]
    assert smoothed_grad_norm(g, 3) == 2.0  # median of 2, 3, 0.5
    assert smoothed_grad_norm(g, 3, lag=2) == 2.0  # median of 1, 9, 2
    assert smoothed_grad_norm(g, 3, lag=3) is None
    assert smoothed_grad_norm(g[:2], 3) is None


def test_a_sustained_drop_of_3_5x_raises_the_drop_flag():
    # window 3: steps 0-5 at 1.0, then 1 / 3.5. The median of the last 3 falls to 1 / 3.5
    # once 2 of them are low (step 7), against the earlier window's 1.0: 0.286 < 1 / 3.
    detector = Detector(CollapseConfig(window=3))
    flags = _run(detector, [1.0] * 6 + [1 / 3.5] * 4)
    assert flags == [False] * 7 + [True] * 3
    # the blow-up factor (10) alone would not see it
    strict = Detector(CollapseConfig(window=3, grad_norm_drop_factor=10.0))
    assert not any(_run(strict, [1.0] * 6 + [1 / 3.5] * 4))


def test_a_lone_small_step_does_not_raise_the_drop_flag():
    detector = Detector(CollapseConfig(window=3))
    assert not any(_run(detector, [1.0] * 6 + [0.01] + [1.0] * 5))


def test_the_drop_flag_needs_two_windows_and_a_baseline_above_the_floor():
    detector = Detector(CollapseConfig(window=3))
    assert _run(detector, [1.0, 1.0, 1.0, 0.1, 0.1]) == [False] * 5  # 5 < 2 x 3 steps
    floor = Detector(CollapseConfig(window=3, grad_norm_floor=2.0))
    assert not any(_run(floor, [1.0] * 6 + [0.01] * 4))


def test_the_blowup_flag_keeps_grad_norm_factor():
    detector = Detector(CollapseConfig(window=3, grad_norm_factor=10.0))
    flags = [detector.update(_step(g))["grad_norm_blowup"] for g in [1.0] * 3 + [9.0, 11.0]]
    assert flags == [False, False, False, False, True]


def test_state_dict_resumes_deterministically():
    cfg = CollapseConfig(window=3)
    steps = [
        _step(g, reward=r, length=n, **{"mismatch/k3_kl": k})
        for g, r, n, k in zip(
            [1.0, 1.2, 0.9, 30.0, 1.1, 1.0, 0.3, 0.2, 0.25, 0.2, 0.1, 0.1],
            [0.2, 0.4, 0.6, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1],
            [10, 10, 11, 12, 15, 20, 25, 30, 30, 31, 32, 33],
            [0.0] * 6 + [0.1] * 6,
            strict=True,
        )
    ]
    whole = Detector(cfg)
    expected = [whole.update(copy.deepcopy(s)) for s in steps]
    assert any(f["grad_norm_drop"] for f in expected)
    for cut in range(len(steps) + 1):
        first = Detector(cfg)
        got = [first.update(copy.deepcopy(s)) for s in steps[:cut]]
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        first.update(_step(1e6))  # the saved state is a copy, not a view
        resumed = Detector(cfg)
        resumed.load_state_dict(state)
        got += [resumed.update(copy.deepcopy(s)) for s in steps[cut:]]
        assert got == expected, cut
        assert resumed.state_dict() == whole.state_dict()


def test_collapse_step_counts_the_drop_flag():
    history = [
        {"step": i, **{f"collapse/{f}": f == "grad_norm_drop" and i >= 4 for f in collapse.FLAGS}}
        for i in range(6)
    ]
    assert collapse.collapse_step(history) == 4


def test_grad_norm_drop_factor_is_checked():
    assert config.build({}, []).collapse.grad_norm_drop_factor == 3.0
    assert (
        config.build({}, ["collapse.grad_norm_drop_factor=3.5"]).collapse.grad_norm_drop_factor
        == 3.5
    )
    with pytest.raises(config.ConfigError, match=r"collapse\.grad_norm_drop_factor"):
        config.build({}, ["collapse.grad_norm_drop_factor=0.5"])


def test_length_surge_lr_schedule():
    cfg = LRScheduleConfig(name="length_surge", surge_window=2)
    schedule = LRSchedule(cfg, 1.0)
    lrs = [schedule.step(step, 3.0 if step < 10 else 9.0) for step in range(100)]
    assert schedule.surge_step == 10  # the first window whose mean is >= 1.5 x the first one's
    period = round(1.8 * 10)
    assert lrs[period - 1] == 1.0 and lrs[period] == 0.5 and lrs[2 * period] == 0.25
    assert min(lrs) == pytest.approx(0.1)  # floor: min_ratio x lr0
    assert LRSchedule(LRScheduleConfig(), 1.0).step(40, 100.0) == 1.0
    fixed = LRSchedule(LRScheduleConfig(name="length_surge", decay_period=5), 1.0)
    assert [fixed.step(s, 3.0) for s in range(11)][4:] == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25]
