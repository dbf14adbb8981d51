"""python -m bik bench --vllm: tokens/s of vLLM with bik and native vLLM, and their ratio.

One real run (--quick: a tiny random-init Qwen3, both engines in their own processes); the
argument cases stop before any engine starts.
"""

import json

import pytest
from test_cli import _never, usage_error

pytest.importorskip("vllm")

from bik.__main__ import main
from bik.tools import bench
from bik.tools.bench import speculative, vllm_throughput
from bik.vllm import engine as vllm_engine


def test_quick_vllm_bench_reports_both_engines_and_the_ratio(tmp_path, capsys):
    """--family: the random-init model is that family's tiny preset (here Nemotron-H's Mamba2
    mixers, bik.vllm.mamba2, in the bik engine)."""
    paths = {ext: tmp_path / f"out.{ext}" for ext in ("json", "md")}
    argv = ["bench", "--vllm", "--quick", "--family", "nemotron_h", "--dtypes", "float32"]
    argv += ["--tokens", "8", "--json", str(paths["json"]), "--markdown", str(paths["md"])]
    assert main(argv) == 0
    result = json.loads(paths["json"].read_text())
    assert result["vllm"] and result["device"] and result["backend"] == "cpu"
    (record,) = result["records"]
    assert record["op"] == "vllm_generate" and record["dtype"] == "float32"
    assert record["shape"].startswith("nemotron_h hidden=128 layers=2")
    assert "8 prompts x 8 tokens" in record["shape"] and record["generated_tokens"] == 8 * 8
    for side in ("bik", "baseline"):
        assert record[f"{side}_tokens_per_s"] == pytest.approx(64 / (record[f"{side}_ms"] / 1e3))
    assert record["ratio"] == pytest.approx(
        record["bik_tokens_per_s"] / record["baseline_tokens_per_s"]
    )
    assert record["ratio"] > 0
    table = paths["md"].read_text()
    assert "| vllm_generate |" in table and "tok/s (native vLLM)" in table
    assert f"vLLM {result['vllm']}" in table
    assert "| vllm_generate |" in capsys.readouterr().out


def test_quick_vllm_bench_of_a_sharded_mixture_of_experts(tmp_path, monkeypatch):
    """--tp 2 --family qwen3_moe: both engines shard the experts over two worker processes,
    bik's in the TP-invariant order, each rank bound to its core (the engines themselves:
    test_vllm_moe_parallel.py and test_verify_vllm.py run them at TP 2)."""
    asked = []

    def engine(name, model_dir, prompts, **options):
        asked.append((name, options))
        tokens = len(prompts) * options["sampling"]["max_tokens"]
        return {"vllm": "0.32.0", "seconds": [1.0], "generated_tokens": tokens, "threads": 1}

    monkeypatch.setattr(vllm_engine, "run_engine", engine)
    out = tmp_path / "out.json"
    argv = ["bench", "--vllm", "--quick", "--family", "qwen3_moe", "--dtypes", "bfloat16"]
    assert main([*argv, "--tp", "2", "--tokens", "4", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["shape"].startswith("qwen3_moe hidden=128 layers=2")
    assert "TP 2, 1 thread" in record["shape"] and record["ratio"] == 1.0
    assert sorted(name for name, _ in asked) == ["bik", "native"]
    for _, options in asked:
        assert options["tp_invariant"] and options["env"] == vllm_engine.cpu_binding(2)
        assert options["engine_args"]["tensor_parallel_size"] == 2
        assert options["engine_args"]["disable_custom_all_reduce"]


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(vllm_engine, "run_engine", _never("vllm_engine.run_engine"))
    monkeypatch.setattr(vllm_throughput, "run", _never("vllm_throughput.run"))
    monkeypatch.setattr(bench, "run", _never("bench.run"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "4"], "argument --prompts: applies to --vllm only"),
        (["--vllm", "--ops", "linear"], "argument --ops: times the kernels; not with --vllm"),
        (["--vllm", "--min-time", "1"], "argument --min-time: times the kernels; not with --vllm"),
        (["--vllm", "--model", "tiny-qwen3"], "argument --model: expected a local model directory"),
        (["--vllm", "--runs", "0"], "argument --runs: expected an integer >= 1, got '0'"),
        (["--family", "nemotron_h"], "argument --family: applies to --vllm only"),
        (["--vllm", "--family", "gemma2"], "argument --family: invalid choice: 'gemma2'"),
        (["--tp", "2"], "argument --tp: applies to --vllm only"),
        (["--vllm", "--tp", "3"], "argument --tp: expected a power of two dividing 8, got 3"),
        (["--speculative", "4"], "argument --speculative: applies to --vllm only"),
        (["--vllm", "--speculative", "4", "--tp", "2"], "argument --tp: not with --speculative"),
        (["--vllm", "--speculative", "0"], "argument --speculative: expected an integer >= 1"),
    ],
)
def test_vllm_arguments_are_checked_before_any_engine(capsys, no_engine, argv, message):
    assert message in usage_error(capsys, ["bench", *argv])


def test_without_vllm_the_error_says_how_to_install_it(capsys, no_engine, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_problem", lambda: vllm_engine.INSTALL_VLLM)
    line = usage_error(capsys, ["bench", "--vllm"])
    assert "argument --vllm: vLLM is not installed" in line and "make install-vllm" in line


def test_family_and_model_are_refused_together(capsys, no_engine, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    argv = ["bench", "--vllm", "--family", "qwen3", "--model", str(tmp_path)]
    message = "argument --family: sizes the random-init model; not with --model"
    assert message in usage_error(capsys, argv)


def test_the_speculative_record_refuses_other_bits_and_reads_its_counts():
    outputs = [[{"tokens": [5, 6], "logprobs": [-0.5, -0.25]}]]
    plain = {"outputs": outputs, "seconds": [2.0, 2.2], "generated_tokens": 40, "threads": 2}
    fast = {**plain, "seconds": [1.0, 1.2], "speculation": {"accepted": 30}}  # 2 calls: 15 each
    r = speculative.record("copy", "float32", "cpu", fast, plain, runs=1)
    assert r["ratio"] == pytest.approx(2.1 / 1.1) and r["kept_draft_share"] == 15 / 40
    other = [[{"tokens": [5, 6], "logprobs": [-0.5, -0.2500001]}]]
    with pytest.raises(RuntimeError, match="changed the tokens or log-probs"):
        speculative.record("copy", "float32", "cpu", {**fast, "outputs": other}, plain, runs=1)


def test_without_a_tokenizer_the_copy_task_repeats_a_segment(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64}))
    tasks = speculative.task_prompts(str(tmp_path), 3, seed=0)
    assert [len(p) for p in tasks["copy"]] == [36] * 3 and len(tasks["open"]) == 3
    assert all(p[:12] == p[12:24] == p[24:] for p in tasks["copy"])
