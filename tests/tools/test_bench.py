"""python -m bik bench on CPU: records carry the promised fields; bad arguments stop it
before any timing."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import usage_error

from bik.__main__ import main
from bik.testing import cases, graphs
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


# -- GPU timing set-up, checked on the CPU ---------------------------------------------------

L2_SIZES = [50 * 2**20, 60 * 10**6, 40 * 2**20]  # H100, H200 (as torch reports it), A100


@pytest.mark.parametrize("l2", L2_SIZES)
@pytest.mark.parametrize("set_bytes", [2048, 4096, 10**6, 33_554_432, 60 * 10**6, 10**8, 10**9])
def test_rotation_copies_exceed_the_l2_cache_with_the_fewest_copies(l2, set_bytes):
    copies = bench.rotation_copies(set_bytes, l2)
    assert copies * set_bytes >= bench.ROTATION_FACTOR * l2
    assert copies == 1 or (copies - 1) * set_bytes < bench.ROTATION_FACTOR * l2
    # a copy is reused only after at least one L2 cache of other inputs was read
    assert copies == 1 or (copies - 1) * set_bytes >= l2


def test_rotation_copies_respect_their_caps():
    l2 = 50 * 2**20
    assert bench.rotation_copies(0, l2) == 1
    assert bench.rotation_copies(1000, l2, max_copies=10) == 10
    assert bench.rotation_copies(2**28, l2, budget=2**28) == 1
    assert bench.rotation_copies(2**20, l2, budget=8 * 2**20) == 8


def _input_bytes(case, dtype=torch.bfloat16):
    """Bytes of one copy of a case's inputs, from meta tensors (nothing allocated)."""
    return cases.input_bytes(case.inputs(torch.device("meta"), dtype))


@pytest.mark.parametrize("quick", [True, False])
def test_every_cuda_kernel_case_is_timed_with_its_inputs_out_of_l2(quick):
    kernel_cases = [c for c in cases.cuda_cases(quick) if c.rotate]
    assert kernel_cases
    for case in kernel_cases:
        for dtype in (torch.bfloat16, torch.float32):
            set_bytes = _input_bytes(case, dtype)
            for l2 in L2_SIZES:
                copies = bench.rotation_copies(set_bytes, l2)
                assert copies * set_bytes >= bench.ROTATION_FACTOR * l2, (case.shape, dtype)
    assert all(not c.rotate for c in cases.cuda_cases(quick) if c.op.startswith(("e2e", "moe")))


def _field(shape, name):
    return int(next(part for part in shape.split() if part.startswith(f"{name}="))[len(name) + 1 :])


def test_cuda_cases_cover_llama_and_qwen_shapes():
    full = cases.cuda_cases(False)
    linears = [c for c in full if c.op == "linear"]
    for model, k, n in [*cases.LINEAR_SHAPES, cases.LM_HEAD]:
        ms = {_field(c.shape, "M") for c in linears if f"K={k} N={n} ({model})" in c.shape}
        assert min(ms) == 1 and any(m <= 64 for m in ms - {1}), model
        assert any(m >= 2048 for m in ms), model
    decode = [c for c in full if c.op == "attention_decode"]
    gqa_8k = [
        c
        for c in decode
        if _field(c.shape, "Tk") == 8192 and "H=32/8" in c.shape and _field(c.shape, "D") == 128
    ]
    assert {_field(c.shape, "B") for c in gqa_8k} == {1, 16}
    prefill = {_field(c.shape, "Tq") for c in full if c.op == "attention_prefill"}
    assert {512, 2048, 8192} <= prefill
    assert {_field(c.shape, "D") for c in full if c.op == "rms_norm"} >= {2048, 4096}
    assert {_field(c.shape, "V") for c in full if c.op == "log_softmax"} >= {128256, 152064}
    assert {"e2e_decode", "e2e_forward", "token_logprobs"} <= {c.op for c in full}
    tp = {(_field(c.shape, "M"), _field(c.shape, "K")) for c in full if c.op == "tp_linear"}
    assert {(1, 4096), (8192, 4096), (1, 14336), (8192, 14336)} <= tp
    quick_ops = {c.op for c in cases.cuda_cases(True)}
    assert {"linear", "attention_decode", "attention_prefill", "e2e_decode"} <= quick_ops


def test_paged_decode_case_and_its_baseline_agree():
    # Pages in shuffled order, the last one partly used (70 keys in pages of 16).
    case = cases.paged_decode(2, 4, 2, 70, 16)
    args = case.inputs(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(case.bik(*args), case.baseline(*args))


def test_cuda_e2e_cases_include_the_real_models_decode_shapes():
    config = cases.smollm2_config(528)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.intermediate_size, config.vocab_size) == (1536, 49152)
    assert config.tie_word_embeddings
    labels = [c.shape for c in cases.cuda_cases(False) if c.op == "e2e_decode"]
    assert any("SmolLM2-135M" in label for label in labels)


def _recording_case(seen, rotate=True):
    return cases.Case(
        "probe",
        "n=4",
        0,
        0,
        lambda device, dtype: (torch.zeros(4, device=device, dtype=dtype), 3),
        lambda x, three: seen.append(("bik", x.data_ptr(), three)),
        lambda x, three: seen.append(("baseline", x.data_ptr(), three)),
        rotate=rotate,
    )


def test_bik_and_baseline_walk_the_copies_through_one_cursor():
    seen = []
    bik_fn, base_fn = _recording_case(seen).make(torch.device("cpu"), torch.float32, copies=3)
    for _ in range(3):
        bik_fn(), base_fn()
    pointers = [p for _, p, _ in seen]
    assert len(set(pointers[:3])) == 3 and pointers[3:] == pointers[:3]
    assert {p for who, p, _ in seen if who == "bik"} == set(pointers[:3])
    assert {p for who, p, _ in seen if who == "baseline"} == set(pointers[:3])
    assert {three for *_, three in seen} == {3}  # other arguments are passed as they are
    seen.clear()
    bik_fn, base_fn = _recording_case(seen, rotate=False).make(
        torch.device("cpu"), torch.float32, copies=3
    )
    bik_fn(), base_fn(), bik_fn()
    assert len({p for _, p, _ in seen}) == 1  # model cases are never copied


def test_the_gpu_path_rotates_enough_copies_for_the_l2_size(monkeypatch):
    seen, timed = [], []

    def fake_time_pair(bik_fn, base_fn, device, min_time):
        for _ in range(8):
            bik_fn(), base_fn()
        timed.append(min_time)
        return bench.Timing(2.0, 1.0, 0.01)

    monkeypatch.setattr(bench, "time_pair", fake_time_pair)
    timing, copies, set_bytes, _ = bench._time_case(
        _recording_case(seen), torch.device("cpu"), torch.float32, l2=100, min_time=0.5
    )
    assert (timing.bik_ms, timing.base_ms, set_bytes, timed) == (2.0, 1.0, 16, [0.5])
    assert copies == bench.rotation_copies(16, 100) == 13
    assert len({p for _, p, _ in seen}) == 13
    seen.clear()
    assert bench._time_case(_recording_case(seen), torch.device("cpu"), torch.float32, 0, 0.5)[
        1:3
    ] == (1, 16)  # no L2 given (the CPU): one copy, as before
    assert len({p for _, p, _ in seen}) == 1


def test_the_cpu_bench_does_not_rotate(monkeypatch):
    seen = []
    monkeypatch.setattr(cases, "cases_for", lambda device_type, quick: [_recording_case(seen)])
    monkeypatch.setattr(bench, "measure_peaks", lambda device, dtype, quick: (1e12, 1e11))
    monkeypatch.setattr(
        bench,
        "time_pair",
        lambda b, base, device, t: (b(), base(), b(), bench.Timing(1, 1.5, 0))[-1],
    )
    result = bench.run("cpu", dtypes=["float32"], echo=lambda line: None)
    assert len({p for _, p, _ in seen}) == 1
    (record,) = result["records"]
    assert record["ratio"] == 1.5 and "copies" not in record
    assert result["timer"] == "wall clock" and "l2_bytes" not in result


def _gpu_case_on_the_cpu(seen):
    """A kernel case whose "GPU" inputs live on the CPU; each call says who made it."""
    return cases.Case(
        "probe",
        "n=4",
        8e9,
        8e6,
        lambda device, dtype: (torch.zeros(4, dtype=dtype), 3),
        lambda x, three: seen.append("bik"),
        lambda x, three: seen.append("baseline"),
    )


def test_a_gpu_case_is_recorded_eager_with_host_costs_and_replayed_from_graphs(monkeypatch):
    """The GPU records of a kernel case, the GPU parts faked on the CPU: the eager record
    with each side's host cost, then the graph record, per call of the captured calls."""
    seen: list[str] = []
    case = _gpu_case_on_the_cpu(seen)
    calls = graphs.GRAPH_CALLS
    fake_pair = lambda b, base, device, t: (b(), base(), bench.Timing(2.0, 1.0, 0.01))[-1]
    monkeypatch.setattr(bench, "time_pair", fake_pair)
    monkeypatch.setattr(graphs, "graphed", lambda fn: lambda: [fn() for _ in range(calls)])
    monkeypatch.setattr(graphs, "host_us", lambda fn, device: 42.0)
    eager, graph = bench._case_records(
        case, torch.device("cuda"), "float32", l2=100, min_time=0.1, backend="triton"
    )
    assert (eager["mode"], eager["host_us"], eager["baseline_host_us"]) == ("eager", 42.0, 42.0)
    assert (eager["bik_ms"], eager["ratio"], eager["l2_cold"]) == (2.0, 0.5, True)
    assert (graph["mode"], graph["bik_ms"], graph["ratio"]) == ("graph", 2.0 / calls, 0.5)
    assert seen.count("bik") == 1 + calls  # one eager sample, one replay of the captured calls
    graph.update(bench._rates(case, graph, 1e12, 1e11))
    assert bench._row(graph).startswith("| probe (graph) | n=4 | float32 |")


def test_a_failed_capture_keeps_the_eager_record(monkeypatch):
    monkeypatch.setattr(bench, "time_pair", lambda b, base, device, t: bench.Timing(1, 1, 0))
    monkeypatch.setattr(graphs, "host_us", lambda fn, device: 1.0)

    def no_graph(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "graphed", no_graph)
    eager, graph = bench._case_records(
        _gpu_case_on_the_cpu([]), torch.device("cuda"), "float32", 100, 0.1, "triton"
    )
    assert eager["ratio"] == 1 and graph["error"].startswith("RuntimeError: operation not")


def _result(backend, **extra):
    record = {
        "op": "linear",
        "shape": "M=1 K=8 N=8",
        "dtype": "bfloat16",
        "backend": backend,
        "bik_ms": 2.0,
        "baseline_ms": 1.0,
        "ratio": 0.5,
        "bik_tflops": 1.0,
        "bik_gbps": 10.0,
        "peak_share": 0.25,
        "copies": 3,
        "l2_cold": True,
    }
    failed = {"op": "rms_norm", "shape": "rows=1 D=8", "dtype": "bfloat16", "error": "Boom: x"}
    return {
        "device": "NVIDIA H200",
        "date": "2026-01-01",
        "torch": "2.11.0+cu130",
        "triton": "3.6.0",
        "cuda": "13.0",
        "backend": backend,
        "timer": "CUDA events",
        "l2_bytes": 60 * 2**20,
        "peaks": {"bfloat16": {"tflops": 790.0, "gbps": 4300.0}},
        "records": [record, failed],
        **extra,
    }


def test_markdown_says_the_cuda_backend_is_the_portable_reference():
    text = bench.markdown(_result("cuda"))
    assert "portable reference backend" in text and "not performance figures" in text
    assert "portable reference" not in bench.markdown(_result("triton"))


def test_offline_a_real_model_case_is_skipped_not_failed(tmp_path, monkeypatch, capsys):
    from bik.testing import models

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))  # nothing prepared there
    monkeypatch.setenv(models.OFFLINE_ENV, "1")
    monkeypatch.setattr(bench, "measure_peaks", lambda *args: (1e12, 1e9))
    out = tmp_path / "out.json"
    argv = ["bench", "--device", "cpu", "--ops", "e2e_smollm2_forward", "--dtypes", "float32"]
    assert main([*argv, "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert "BIK_OFFLINE=1" in record["skipped"] and "bik_ms" not in record
    printed = capsys.readouterr().out
    assert "| e2e_smollm2_forward |" in printed
    assert "| float32 | skipped: smollm2 is not prepared" in printed


def test_markdown_names_versions_timer_rotation_peaks_and_failures():
    text = bench.markdown(_result("triton", interrupted=True))
    assert "torch 2.11.0+cu130, Triton 3.6.0, CUDA 13.0; bik backend `triton`" in text
    assert "Timed with CUDA events; inputs rotated over copies holding >= 2 x the 60 MiB" in text
    assert "bfloat16 790 TFLOP/s, 4300 GB/s" in text
    assert "| rms_norm | rows=1 D=8 | bfloat16 | failed: Boom: x |" in text
    assert "| linear | M=1 K=8 N=8 | bfloat16 | 2.0000 | 1.0000 | 0.50 |" in text
    assert "Interrupted" in text


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_skips_failed_cases(tmp_path):
    bench.plot(_result("cuda"), str(tmp_path / "out.png"))
    assert (tmp_path / "out.png").stat().st_size > 0


# -- benchmarks/gpu_run.sh, what can be checked without a GPU ------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _gpu_run(*args, out):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_gpu_run_test_parts_split_the_suite(tmp_path):
    parts = {
        part: _gpu_run("files", part, out=tmp_path).stdout.split()
        for part in ("all", "kernels", "models", "rl")
    }
    assert sorted(parts["kernels"] + parts["models"] + parts["rl"]) == sorted(parts["all"])
    every = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*.py")}
    assert set(parts["all"]) == every
    assert {"tests/backends/test_gpu.py", "tests/ops/test_attention.py"} <= set(parts["kernels"])
    assert "tests/integrations/test_hf.py" in parts["models"]
    assert "tests/rl/test_rl_harness.py" in parts["rl"]


def test_gpu_run_names_bad_steps(tmp_path):
    done = _gpu_run("help", out=tmp_path)
    assert done.returncode == 0 and "bench GROUP" in done.stdout
    done = _gpu_run("bench", "bogus", out=tmp_path)
    assert done.returncode == 1 and "unknown group 'bogus'" in done.stderr
    done = _gpu_run("frobnicate", out=tmp_path)
    assert done.returncode == 2 and "unknown step 'frobnicate'" in done.stderr
    for step in ([], ["rehearse"], ["bench", "bogus"], ["test", "bogus"]):
        done = _gpu_run("rehearse", *step, out=tmp_path)
        assert done.returncode == 1 and "gpu_run.sh: " in done.stderr, step
    assert list(tmp_path.iterdir()) == []  # refused before any output or build


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPU")
def test_gpu_run_stops_before_building_without_a_gpu(tmp_path):
    for step in (["build"], ["test", "kernels"], ["bench", "matmul"], ["anatomy"]):
        done = _gpu_run(*step, out=tmp_path)
        assert done.returncode == 1 and "no usable CUDA device" in done.stderr, step
        assert "building" not in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="rehearses on a machine without GPU")
def test_gpu_run_rehearsal_goes_on_without_a_gpu(tmp_path):
    # env needs no GPU but its name: the rehearsal reports the environment in full. (build,
    # test and bench rehearse the CUDA build first: benchmarks/README.md, by hand.)
    done = _gpu_run("rehearse", "env", out=tmp_path)
    assert done.returncode == 0 and "rehearsal without a GPU" in done.stdout, done.stderr
    (report,) = tmp_path.glob("rehearsal-env-*.txt")
    assert f"torch {torch.__version__}" in report.read_text()
    done = _gpu_run("rehearse", "anatomy", "--top-p", "0.9", out=tmp_path)
    assert done.returncode == 0 and "stops here: benchmarks/gpu_anatomy.py" in done.stdout


def _fake_clock(monkeypatch, rounds):
    """_seconds_per_call returns the next value of ``rounds`` (lists of per-sample seconds,
    bik and baseline alternating), after the warm-up's and the call count's calls."""
    values = iter([1.0] * 1 + [v for r in rounds for v in r])
    monkeypatch.setattr(bench, "_seconds_per_call", lambda fn, device, calls: next(values))


def test_a_noisy_round_is_timed_again_until_it_settles(monkeypatch):
    """Issue 48, item 5: a loaded machine's samples spread; the bench retimes them."""
    noisy = [1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # bik and baseline alternate
    steady = [2.0, 4.0] * 5
    _fake_clock(monkeypatch, [noisy, steady])
    timing = bench.time_pair(lambda: None, lambda: None, torch.device("cpu"), 0.0)
    assert timing == bench.Timing(2000.0, 4000.0, 0.0)


def test_a_round_that_never_settles_keeps_the_steadiest_and_says_so(monkeypatch):
    rounds = [[1.0, 1.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]] * bench.ROUNDS
    rounds[1] = [1.0, 1.0, 1.5, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # spread 0.5: the steadiest
    _fake_clock(monkeypatch, rounds)
    timing = bench.time_pair(lambda: None, lambda: None, torch.device("cpu"), 0.0)
    assert timing.spread == 0.5 > bench.SPREAD_LIMIT
    record = {"op": "linear", "shape": "8x8x8", "dtype": "float32", "bik_ms": 1.0}
    record.update(baseline_ms=1.0, ratio=1.0, bik_tflops=1.0, bik_gbps=1.0, peak_share=0.1)
    record.update(spread=timing.spread, reliable=False)
    result = {"device": "cpu", "torch": "2", "backend": "cpu", "date": "d", "records": [record]}
    result["load_before"] = {"load_1min": 0.1, "cpus": 2}
    text = bench.markdown(result)
    assert "| 1.00 ? |" in text and "1 row(s) marked `?` never settled" in text
    assert "machine was loaded" not in text


def test_a_run_started_on_a_loaded_machine_says_its_ratios_are_not_to_quote(monkeypatch):
    monkeypatch.setattr(bench, "machine_load", lambda: {"load_1min": 3.5, "cpus": 2})
    monkeypatch.setattr(cases, "cases_for", lambda device_type, quick: [_recording_case([])])
    monkeypatch.setattr(bench, "measure_peaks", lambda device, dtype, quick: (1e12, 1e11))
    monkeypatch.setattr(bench, "time_pair", lambda *a: bench.Timing(1.0, 1.0, 0.0))
    result = bench.run("cpu", dtypes=["float32"], echo=lambda line: None)
    assert result["load_before"] == result["load_after"] == {"load_1min": 3.5, "cpus": 2}
    text = bench.markdown(result)
    assert "Load average (1 min) before the run 3.50, after it 3.50, on 2 CPUs." in text
    assert "machine was loaded when the run started" in text


@pytest.mark.skipif(
    "cpu" not in __import__("conftest").invariant_backends(torch.device("cpu")),
    reason="the CPU bench times the compiled cpu backend",
)
def test_python_m_bik_bench_is_the_bench_command(tmp_path):
    """``python -m bik.bench``, the entry point the project promises, runs the bench CLI
    (options, checks, outputs) as ``python -m bik bench`` does."""
    out = tmp_path / "bench.json"
    args = ["--quick", "--ops", "rms_norm", "--dtypes", "float32", "--min-time", "0.005"]
    done = subprocess.run(
        [sys.executable, "-m", "bik.bench", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert records and {r["op"] for r in records} == {"rms_norm"}
    bad = subprocess.run(
        [sys.executable, "-m", "bik.bench", "--ops", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--ops" in bad.stderr
