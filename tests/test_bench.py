"""python -m bik bench on CPU: records carry the promised fields; bad arguments stop it
before any timing."""

import importlib.util
import json
import os

import pytest
import torch
from test_cli import usage_error

from bik.__main__ import main
from bik.tools import bench


@pytest.mark.skipif(
    "cpu" not in __import__("conftest").invariant_backends(torch.device("cpu")),
    reason="the CPU bench times the compiled cpu backend",
)
def test_quick_cpu_bench_writes_json_markdown_and_plot(tmp_path):
    paths = {ext: tmp_path / f"out.{ext}" for ext in ("json", "md", "png")}
    main(
        [
            "bench",
            "--device",
            "cpu",
            "--quick",
            "--ops",
            "linear",
            "rms_norm",
            "--dtypes",
            "float32",
            "--min-time",
            "0.005",
            "--json",
            str(paths["json"]),
            "--markdown",
            str(paths["md"]),
            "--plot",
            str(paths["png"]),
        ]
    )
    result = json.loads(paths["json"].read_text())
    assert result["device"] and result["peaks"]["float32"]["tflops"] > 0
    records = result["records"]
    assert {r["op"] for r in records} == {"linear", "rms_norm"}
    for record in records:
        assert {"op", "shape", "dtype", "backend", "bik_ms", "baseline_ms", "ratio"} <= set(record)
        assert record["bik_ms"] > 0 and record["ratio"] == pytest.approx(
            record["baseline_ms"] / record["bik_ms"]
        )
    assert "| linear |" in paths["md"].read_text()
    assert paths["png"].stat().st_size > 0


@pytest.fixture
def no_timing(monkeypatch):
    """Any timing fails the test: errors must come before the benchmark starts."""

    def fail(*args, **kwargs):
        raise AssertionError("the benchmark ran before the bad argument was reported")

    monkeypatch.setattr(bench, "measure_peaks", fail)
    monkeypatch.setattr(bench, "time_pair", fail)


def test_unknown_ops_are_all_named_with_the_valid_ones(capsys, no_timing):
    line = usage_error(capsys, ["bench", "--ops", "bogus", "linear", "nope"])
    assert "argument --ops: unknown bogus, nope; expected some of linear, rms_norm," in line
    assert "e2e_decode" in line


def test_op_without_a_case_on_this_device_is_rejected(capsys, no_timing):
    line = usage_error(capsys, ["bench", "--device", "cpu", "--quick", "--ops", "e2e_decode"])
    assert "argument --ops: no case for e2e_decode on cpu with --quick; expected some of" in line


def test_run_rejects_unknown_ops_and_bad_paths_before_timing(no_timing, tmp_path):
    with pytest.raises(ValueError, match="ops: no case for no_such_op on cpu"):
        bench.run(device="cpu", ops=["no_such_op"], quick=True)
    with pytest.raises(ValueError, match=r"json_path: the directory .* does not exist"):
        bench.run(device="cpu", quick=True, json_path=str(tmp_path / "missing" / "out.json"))


@pytest.mark.parametrize("value", ["0", "-1", "-0.5", "inf", "nan", "abc"])
def test_min_time_must_be_positive(capsys, no_timing, value):
    line = usage_error(capsys, ["bench", "--min-time", value])
    assert f"argument --min-time: expected a finite number > 0, got {value!r}" in line


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_output_in_a_missing_directory_is_rejected(capsys, no_timing, tmp_path, option):
    path = tmp_path / "missing" / "out"
    line = usage_error(capsys, ["bench", option, str(path)])
    assert f"argument {option}: the directory {str(path.parent)!r}" in line
    assert "does not exist; create it first" in line


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_output_that_is_a_directory_is_rejected(capsys, no_timing, tmp_path, option):
    line = usage_error(capsys, ["bench", option, str(tmp_path)])
    assert f"argument {option}: {str(tmp_path)!r} is a directory; expected a file path" in line


def test_output_under_a_file_or_empty_is_rejected(capsys, no_timing, tmp_path):
    (tmp_path / "file").write_text("")
    line = usage_error(capsys, ["bench", "--json", str(tmp_path / "file" / "out.json")])
    assert "argument --json:" in line and "is not a directory" in line
    assert "expected a file path, got ''" in usage_error(capsys, ["bench", "--markdown", ""])


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_in_a_read_only_directory_is_rejected(capsys, no_timing, tmp_path):
    tmp_path.chmod(0o500)
    try:
        line = usage_error(capsys, ["bench", "--json", str(tmp_path / "out.json")])
    finally:
        tmp_path.chmod(0o700)
    assert "argument --json:" in line and "is not writable" in line


def test_two_outputs_to_one_file_are_rejected(capsys, no_timing, tmp_path):
    path = str(tmp_path / "out")
    line = usage_error(capsys, ["bench", "--json", path, "--markdown", path])
    assert f"argument --markdown: {path!r} is also the --json file" in line


def test_plot_without_matplotlib_is_rejected_at_start(capsys, no_timing, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "matplotlib" else find_spec(name, *args),
    )
    line = usage_error(capsys, ["bench", "--plot", str(tmp_path / "out.png")])
    assert "argument --plot: needs matplotlib: pip install matplotlib" in line


def test_cuda_without_cuda_is_rejected_at_start(capsys, no_timing, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = usage_error(capsys, ["bench", "--device", "cuda"])
    assert "argument --device: cuda requested but" in line and "use --device cpu" in line
