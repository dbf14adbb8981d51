"""A patched model keeps its patch-time backend and split size through deepcopy and pickle."""

import copy
import pickle
import subprocess
import sys

import pytest
import torch

import bik
from bik import hf

pytest.importorskip("transformers")
from bik import testing

IDS = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def calls(monkeypatch):
    """(op, selected backend, split size) of every bik call the patched forwards make."""
    seen = []

    def spy(module, name, fn, label):
        def record(*args, **kwargs):
            seen.append((label, bik.get_backend(), kwargs.get("split_size")))
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, record)

    # the names the patched forwards call, where they look them up
    for module, name, label in (
        (hf.forwards, "linear", "linear"),
        (hf.forwards, "rms_norm_like_transformers", "rms_norm"),
        (hf.attention, "attention", "attention"),
    ):
        spy(module, name, getattr(module, name), label)
    return seen


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_keeps_backend_and_split_size(calls, how):
    model = testing.load_model("tiny-qwen3")
    report = bik.patch_model(model, backend="reference", split_size=64)
    want = _logits(model)
    assert {c[1] for c in calls} == {"reference"}
    assert {c[2] for c in calls if c[0] == "attention"} == {64}
    clone = COPIES[how](model)
    bik.unpatch_model(model)  # the copy owns its patch: undoing the original leaves it be
    calls.clear()
    assert torch.equal(_logits(clone), want)
    assert {c[1] for c in calls} == {"reference"}
    assert {c[2] for c in calls if c[0] == "attention"} == {64}
    bik.unpatch_model(clone)
    assert clone.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in clone.modules())
    assert torch.equal(_logits(clone), _logits(model))
    assert (report.backend, report.split_size) == ("reference", 64)


@pytest.mark.slow  # test_a_copy_keeps_backend_and_split_size[pickle] checks the same settings
def test_a_pickled_patched_model_runs_in_a_fresh_process(tmp_path):
    model = testing.load_model("tiny-llama")
    bik.patch_model(model, backend="reference", split_size=32)
    torch.save({"model": model, "logits": _logits(model)}, tmp_path / "patched.pt")
    script = (
        "import sys, torch\n"
        "saved = torch.load(sys.argv[1], weights_only=False)\n"
        "with torch.no_grad():\n"
        "    got = saved['model'](input_ids=torch.load(sys.argv[2])).logits\n"
        "assert torch.equal(got, saved['logits'])\n"
        "assert saved['model']._bik_patch.backend == 'reference'\n"
    )
    torch.save(IDS, tmp_path / "ids.pt")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "patched.pt"), str(tmp_path / "ids.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
