"""benchmarks/mismatch_anatomy.py on a tiny random Llama (no vLLM): every table, curve and plot
is written, bik's paths are exactly 0, and a second run reads every path from its cache."""

import json

import benchmark_scripts
import pytest

from bik.testing import load_model

PATHS = ["hf_fp32", "hf_bf16", "trainer_bf16", "bik_hf_fp32", "bik_hf_bf16", "bik_trainer_fp32"]


def _anatomy():
    return benchmark_scripts.load("mismatch_anatomy")


def test_anatomy_on_a_tiny_model_writes_its_tables_and_resumes(tmp_path, capsys):
    load_model("tiny-llama").save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path / "model"), "--prompts", "2", "--tokens", "6"]
    argv += ["--bik-tokens", "3", "--trainer-sequences", "hf_fp32", "--out", str(out)]
    argv += ["--paths", *PATHS]
    anatomy = _anatomy()
    assert anatomy.main(argv) == 0
    report = json.loads((out / "anatomy.json").read_text())
    rows = {r["path"]: r for r in report["paths"]}
    # plain paths first, then bik's; the trainer paths score hf_fp32's sequences (2 prompts x
    # 2 samples, 6 tokens each)
    assert list(rows) == PATHS
    assert rows["hf_fp32"]["tokens"] == 24 and rows["bik_hf_fp32"]["tokens"] == 12
    assert rows["hf_bf16"]["unequal_share"] > 0  # a bf16 decode against the fp32 trainer
    for name in ("bik_hf_fp32", "bik_hf_bf16", "bik_trainer_fp32"):
        assert rows[name]["unequal_share"] == 0 and rows[name]["max_abs_delta"] == 0
    for name in ("anatomy.md", "anatomy_bins.csv", "anatomy_profile.png"):
        assert (out / name).stat().st_size > 0
    capsys.readouterr()
    assert anatomy.main(argv) == 0  # every path from the cache
    assert capsys.readouterr().out.count(": cached (") == len(rows)
    with pytest.raises(ValueError, match="remove the cache folder"):
        anatomy.main([*argv, "--tokens", "5"])  # a cache made with other settings


def test_anatomy_of_a_kept_policy_runs_on_its_weights(tmp_path):
    """--policy: the weights of a policy an RL run kept (keep_policies) in --model's
    architecture; the paths sample from them, and another policy needs another --out."""
    import torch

    model = load_model("tiny-llama")
    model.save_pretrained(tmp_path / "model")
    trained = {k: v + 0.01 for k, v in model.state_dict().items()}
    torch.save({"step": 3, "master": trained}, tmp_path / "step3.pt")
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path / "model"), "--prompts", "1", "--tokens", "4"]
    argv += ["--out", str(out), "--paths", "hf_fp32", "--policy", str(tmp_path / "step3.pt")]
    anatomy = _anatomy()
    assert anatomy.main(argv) == 0
    kept = load_model(str(out / "policy_model")).state_dict()
    assert all(torch.equal(kept[k], v) for k, v in trained.items())
    report = json.loads((out / "anatomy.json").read_text())
    assert report["settings"]["policy"] == str(tmp_path / "step3.pt")
    torch.save({"step": 4, "master": trained}, tmp_path / "step4.pt")
    with pytest.raises(SystemExit, match="choose another --out"):
        anatomy.main([*argv[:-1], str(tmp_path / "step4.pt")])
