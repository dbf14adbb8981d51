"""Range checks of integer arguments (bik._checks.values_in_range) and the tensors bik built
itself in range (known_in_range): such a tensor is not checked again until it is written to,
and nothing else escapes the check."""

import gc

import pytest
import torch

import bik
from bik import _checks, testing
from bik.hf import attention as hf_attention


@pytest.fixture
def checks_run(monkeypatch):
    """The names of the range checks that ran (and ran for real: a bad value still raises)."""
    ran: list[str] = []
    check = _checks._check_range

    def recorded(values, low, high, expected, on_device):
        ran.append(expected.split(":")[0])
        check(values, low, high, expected, on_device)

    monkeypatch.setattr(_checks, "_check_range", recorded)
    return ran


def check(values, low, high):
    _checks.values_in_range("ids", values, low, high, "a test range")


def test_a_known_tensor_skips_the_check_until_it_is_written(checks_run):
    values = torch.tensor([0, 5, 9])
    _checks.known_in_range(values, 0, 9)
    check(values, 0, 9)
    check(values, 0, 12)  # a wider range holds too
    assert checks_run == []
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 8\]"):
        check(values, 0, 8)  # a narrower one is checked
    with pytest.raises(ValueError, match=r"ids: expected values in \[1, 9\]"):
        check(values, 1, 9)
    values[1] = 3  # a write: the next use is checked again
    check(values, 0, 9)
    assert checks_run == ["ids"] * 3


def test_only_the_known_tensor_itself_skips_the_check(checks_run):
    values = torch.tensor([0, 99])
    _checks.known_in_range(values, 0, 1)  # a false vouch, to see who trusts it
    check(values, 0, 1)
    for other in (values.clone(), values[1:], values.detach().clone().long()):
        with pytest.raises(ValueError, match="got min"):
            check(other, 0, 1)
    assert checks_run == ["ids"] * 3


def test_a_freed_tensors_entry_never_answers_for_another(checks_run):
    old = torch.tensor([0])
    _checks.known_in_range(old, 0, 0)
    entry = _checks._KNOWN_IN_RANGE.entries[id(old)]
    del old
    gc.collect()
    new = torch.tensor([7])
    _checks._KNOWN_IN_RANGE.entries[id(new)] = entry  # as if new had taken old's id
    with pytest.raises(ValueError, match="got min 7, max 7"):
        check(new, 0, 0)


def test_an_inference_tensor_is_never_known(checks_run):
    with torch.inference_mode():
        values = torch.tensor([4])
    _checks.known_in_range(values, 0, 1)
    with pytest.raises(ValueError, match="got min 4"):
        check(values, 0, 1)


MASKS = [  # (left padding, real tokens) per row
    [(0, 6), (0, 6)],
    [(3, 3), (0, 6), (5, 1)],
    [(1, 4), (2, 3)],  # zeros after the tokens (a row stopped at EOS)
]


@pytest.mark.parametrize("rows", MASKS)
@pytest.mark.parametrize("tq", [6, 1])
def test_the_kv_start_the_hf_layer_vouches_for_is_in_range(rows, tq, checks_run):
    tk = 6
    mask = torch.zeros(len(rows), 1, tq, tk, dtype=torch.bool)
    for row, (pad, real) in enumerate(rows):
        for query in range(tq):
            position = tk - tq + query
            mask[row, 0, query, pad : min(position + 1, pad + real)] = True
    hf_attention._last_bounds[0] = None
    kv_start, kv_len, _ = hf_attention._cached_kv_bounds(mask, len(rows), tq, tk, None, None)
    assert _checks._KNOWN_IN_RANGE.holds(kv_start, 0, kv_len - 1)
    _checks._check_range(kv_start, 0, kv_len - 1, "kv_start", on_device=False)  # really


def test_a_padded_forward_checks_kv_start_once_not_per_layer(checks_run, monkeypatch):
    model = testing.load_model("tiny-qwen3")
    layers = model.config.num_hidden_layers
    bik.patch_model(model)
    ids, mask = bik.hf.left_pad([torch.tensor([5, 6, 7]), torch.arange(8, 13)], pad_id=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert "kv_start" not in checks_run
    monkeypatch.setattr(_checks, "known_in_range", lambda *args: None)  # negative control
    hf_attention._last_bounds[0] = None
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert checks_run.count("kv_start") == layers


@pytest.mark.parametrize("written", [-(2**31), -1, 7, 2**31 - 1])
def test_no_kernel_reads_out_of_bounds_from_a_kv_start_written_past_the_vouch(backend, written):
    """Issue 72, item 5: a vouched kv_start written where no version counter sees it (through
    ``.data``, a numpy view, DLPack) skips the Python check. The cpu kernel checks each row's
    first key itself and raises; the Triton and CUDA kernels clamp it into the keys (a
    device-side raise would cost a sync) and read nothing out of bounds."""
    q, k, v = (torch.randn(2, 2, 3, 8) for _ in range(3))
    kv_start = torch.tensor([0, 1], dtype=torch.int32)
    _checks.known_in_range(kv_start, 0, 2)
    kv_start.data[1] = written  # no version bump: the vouch still holds
    assert _checks._KNOWN_IN_RANGE.holds(kv_start, 0, 2)
    if backend == "cpu":
        with pytest.raises(
            ValueError, match=rf"kv_start\[1\] = {written}, expected 0 <= kv_start < 3"
        ):
            bik.attention(q, k, v, kv_start=kv_start)
    else:
        clamped = torch.tensor([0, min(max(written, 0), 2)], dtype=torch.int32)
        expected = bik.attention(q, k, v, kv_start=clamped)
        assert torch.equal(bik.attention(q, k, v, kv_start=kv_start), expected)
