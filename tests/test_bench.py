"""Smoke test of python -m bik bench on CPU: records carry the promised fields."""

import json

import pytest
import torch

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


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="ops: unknown"):
        bench.run(device="cpu", ops=["no_such_op"], quick=True)
