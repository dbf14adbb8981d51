"""python -m bik: a bad argument stops the command at its start with one line naming it.

Each case runs ``bik.__main__.main`` with the work it must not reach (loading or checking a
model, timing) replaced by a failure, so an error reported only after work began fails.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bik import hf, testing
from bik.__main__ import TOOLS, main
from bik.tools import bench, demo, verify

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ", ".join(hf.SUPPORTED_FAMILIES)


def usage_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run ``python -m bik ARGV``, expect argparse's exit (status 2, no traceback); return the
    error line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m bik {argv[0]}: error: " if argv else "python -m bik: ")
    return last


def _never(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad argument was reported")

    return fail


@pytest.fixture
def no_work(monkeypatch):
    """Any model load, check or benchmark fails the test."""
    monkeypatch.setattr(verify, "load_model", _never("verify.load_model"))
    monkeypatch.setattr(verify, "run_checks", _never("verify.run_checks"))
    monkeypatch.setattr(demo, "run", _never("demo.run"))
    monkeypatch.setattr(bench, "run", _never("bench.run"))
    monkeypatch.setattr(bench, "time_pair", _never("bench.time_pair"))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny random-init GPT-2 saved with save_pretrained: a family bik does not patch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_no_command(capsys):
    assert "the following arguments are required: command" in usage_error(capsys, [])


# -- verify --------------------------------------------------------------------------------


def test_verify_model_path_that_does_not_exist(capsys, no_work):
    line = usage_error(capsys, ["verify", "--model", "/no/such"])
    assert "argument --model:" in line and "'/no/such' does not exist" in line
    assert FAMILIES in line and "tiny-qwen3" in line and "strict" not in line


def test_verify_model_directory_without_a_model(capsys, no_work, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    line = usage_error(capsys, ["verify", "--model", str(tmp_path)])
    assert f"{str(tmp_path)!r} has no config.json" in line and FAMILIES in line
    line = usage_error(capsys, ["verify", "--model", str(tmp_path / "notes.txt")])
    assert "is a file, not a directory" in line


def test_verify_unsupported_family_names_the_model_and_the_families(capsys, no_work, gpt2_dir):
    line = usage_error(capsys, ["verify", "--model", str(gpt2_dir)])
    assert f"argument --model: {str(gpt2_dir)!r} holds a 'gpt2' model" in line
    assert f"verify supports the {FAMILIES} families" in line and "strict" not in line


def test_verify_translates_patch_model_refusing_the_family(capsys, monkeypatch):
    """A model that passes the config check but whose family patch_model refuses stops before
    any check runs, without strict=False advice (verify cannot take it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    monkeypatch.setattr(verify, "load_model", lambda *args: gpt2)
    monkeypatch.setattr(verify, "run_checks", _never("verify.run_checks"))
    line = usage_error(capsys, ["verify", "--model", "tiny-llama"])
    assert f"'tiny-llama' is a 'gpt2' model; verify supports the {FAMILIES} families" in line
    assert "strict" not in line


def test_verify_translates_patch_model_refusing_a_module(capsys, monkeypatch):
    llama = testing.load_model("tiny-llama")
    llama.model.norm = torch.nn.LayerNorm(llama.config.hidden_size)  # reduces; bik cannot patch
    monkeypatch.setattr(verify, "load_model", lambda *args: llama)
    monkeypatch.setattr(verify, "run_checks", _never("verify.run_checks"))
    line = usage_error(capsys, ["verify", "--model", "tiny-llama"])
    assert "'tiny-llama' (llama) has modules bik cannot make invariant: model.norm (LayerNorm)" in (
        line
    )
    assert "strict" not in line
    assert not hasattr(llama, "_bik_patch")  # left as it was


def test_verify_model_that_cannot_load(capsys, monkeypatch, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama", vocab_size=64, hidden_size=32).save_pretrained(tmp_path)
    monkeypatch.setattr(verify, "run_checks", _never("verify.run_checks"))
    line = usage_error(capsys, ["verify", "--model", str(tmp_path)])  # config.json, no weights
    assert f"argument --model: cannot load {str(tmp_path)!r}:" in line


def test_verify_cuda_without_cuda(capsys, monkeypatch, no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = usage_error(capsys, ["verify", "--device", "cuda", "--model", "tiny-qwen3"])
    assert "argument --device: cuda requested but" in line and "use --device cpu" in line


@pytest.mark.parametrize("seed", ["x", "1.5", "-1", str(2**64)])
def test_seed_must_be_an_integer_torch_takes(capsys, no_work, seed):
    for tool in ("demo", "verify"):
        line = usage_error(capsys, [tool, "--seed", seed])
        assert f"argument --seed: expected an integer from 0 to 2**64 - 1, got {seed!r}" in line


def test_contradictory_demo_flags_are_refused(capsys, no_work):
    line = usage_error(capsys, ["demo", "--vllm-prompts", "2", "--no-vllm"])
    assert "argument --vllm-prompts: sizes the vLLM comparison, which --no-vllm skips" in line


# -- the alias and a real process ----------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_bad_argument_in_a_process_is_one_line_without_traceback():
    done = _run("-m", "bik", "verify", "--model", "/no/such")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "python -m bik verify: error: argument --model: '/no/such' does not exist; expected"
    )


def _help(run, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run(argv)
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


def test_help_of_every_subcommand_of_both_command_lines(capsys):
    """Issue 25, item 16: ``python -m rl_harness --help`` crashed on an unescaped ``%`` in a
    help string (argparse formats help text with %)."""
    import argparse

    import rl_harness.__main__ as rl_cli

    rl_commands = next(
        a.choices for a in rl_cli.parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for run, commands in ((main, TOOLS), (rl_cli.main, rl_commands)):
        assert "usage:" in _help(run, ["--help"], capsys)
        for command in commands:
            assert f" {command} " in _help(run, [command, "--help"], capsys)
    assert "95% CIs" in _help(rl_cli.main, ["--help"], capsys)


@pytest.mark.parametrize("tool", ["demo", "verify", "bench", "model", "backends"])
def test_help_shows_no_docstring_markup_and_keeps_its_lines(tool, capsys):
    """Issue 71, item 5: help texts showed ``markup`` and :mod: roles, and folded verify's
    list of checks into one paragraph; --device, --dtype and --seed had no help."""
    with pytest.raises(SystemExit):
        main([tool, "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text
    if tool == "verify":
        assert "\n  batch_1_vs_n      a sequence alone" in text
        for option in ("--device", "--dtype", "--seed"):
            assert re.search(rf"\n  {option} \S+\s+\S", text), option


def test_a_missing_model_directory_is_named_first(capsys, tmp_path):
    line = usage_error(capsys, ["verify", "--model", str(tmp_path / "nosuch")])
    assert f"argument --model: '{tmp_path / 'nosuch'}' does not exist; expected" in line


def test_a_python_without_torch_is_told_how_to_run_the_tools(tmp_path):
    """Issue 71, item 5: outside the virtualenv the tools ended in a raw
    ``ModuleNotFoundError: torch``."""
    python = shutil.which("python3")
    if python is None or Path(python).resolve() == Path(sys.executable).resolve():
        pytest.skip("no second Python on PATH")
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, cwd=tmp_path)
    if has_torch.returncode == 0:
        pytest.skip(f"{python} has torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for tool in ("bik", "rl_harness"):
        done = subprocess.run(
            [python, "-m", tool, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert done.returncode == 1
        assert "bik needs torch" in done.stderr and ".venv/bin/activate" in done.stderr
