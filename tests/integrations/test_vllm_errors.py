"""Switching bik on in vLLM fails closed (issue 25, items 6, 7 and 11): a ``BIK_VLLM`` that
names no invariant backend, a non-invariant backend, or a ``VLLM_PLUGINS`` that keeps vLLM
from loading bik's plugin stops with an error naming the variable, before anything is
installed into vLLM. No engine is built here."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")

import bik
import bik.vllm
from bik.vllm import plugin
from rl_harness import config
from rl_harness.engines import vllm as vllm_rollout
from rl_harness.errors import ConfigError


@pytest.fixture
def never_installed(monkeypatch):
    """Installing bik into vLLM, or selecting a backend, fails the test."""

    def fail(*args):
        raise AssertionError("bik was switched on in vLLM")

    monkeypatch.setattr(bik.vllm, "_install", fail)
    monkeypatch.setattr(bik.vllm.backends, "set_backend", fail)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)


@pytest.mark.parametrize("value", ["", "0", "off", "OFF", " Off "])
def test_bik_vllm_unset_empty_0_or_off_leaves_bik_off(monkeypatch, never_installed, value):
    """Item 11: ``BIK_VLLM=0`` failed with a message that did not name BIK_VLLM."""
    monkeypatch.setenv("BIK_VLLM", value)
    assert bik.vllm.requested() is None
    plugin.register()  # nothing to switch on
    monkeypatch.delenv("BIK_VLLM")
    assert bik.vllm.requested() is None


@pytest.mark.parametrize("value", ["cpu", "CPU", " Cpu "])
def test_bik_vllm_names_a_backend_in_any_case(monkeypatch, value):
    """Issue 42, item 11: ``BIK_VLLM=CPU`` was refused although ``OFF`` is read in any case."""
    monkeypatch.setenv("BIK_VLLM", value)
    assert bik.vllm.requested() == "cpu"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("bogus", "BIK_VLLM='bogus': backend: expected one of ['auto', "),
        ("reference", "BIK_VLLM='reference': backend: 'reference' is not batch-invariant"),
    ],
)
def test_bik_vllm_must_name_an_invariant_backend(monkeypatch, never_installed, value, message):
    """Items 7 and 11: ``BIK_VLLM=bogus`` gave an error without the variable's name;
    ``BIK_VLLM=reference`` ran vLLM on a backend documented as not invariant."""
    monkeypatch.setenv("BIK_VLLM", value)
    for call in (bik.vllm.requested, plugin.register):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value).startswith(message)
        assert str(error.value).endswith("unset it (or set 0/off) for bik off")


def test_a_non_invariant_backend_is_refused(never_installed):
    """Item 7: ``bik.vllm.LLM(..., backend="reference")`` was accepted."""
    with pytest.raises(ValueError, match="'reference' is not batch-invariant, so vLLM's log-p"):
        bik.vllm.enable("reference")
    assert bik.vllm.check("cpu") == "cpu"


@pytest.mark.parametrize("listed", ["other", "", "other,bik_plugin"])
def test_vllm_plugins_without_bik_is_refused(monkeypatch, never_installed, listed):
    """Item 6: with VLLM_PLUGINS set and not listing bik's plugin, vLLM's engine processes
    ran natively while the user believed bik was on."""
    monkeypatch.setenv("VLLM_PLUGINS", listed)
    monkeypatch.setenv("BIK_VLLM", "cpu")
    expected = f"VLLM_PLUGINS={listed!r} does not list bik's plugin 'bik'"
    for call in (plugin.register, lambda: bik.vllm.enable("cpu")):
        with pytest.raises(ValueError, match=expected):
            call()
    cfg = config.build({}, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=f"rollout.engine=vllm: {expected}"):
        vllm_rollout.check_available(cfg)
    monkeypatch.setenv("VLLM_PLUGINS", f"{listed}, bik")
    assert bik.vllm.check("cpu") == "cpu"
