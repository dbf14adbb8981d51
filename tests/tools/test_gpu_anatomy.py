"""benchmarks/gpu_anatomy.py rehearsed on the CPU with a tiny random Llama: every
configuration is measured on the same fixed tokens, bik's are exactly 0, plain torch's move,
and the top-p configuration subtracts the nucleus's log mass."""

import json

import benchmark_scripts
import torch

from bik.testing import load_model


def _anatomy():
    return benchmark_scripts.load("gpu_anatomy")


def test_every_configuration_runs_and_bik_is_exactly_zero(tmp_path, capsys):
    load_model("tiny-llama").save_pretrained(tmp_path / "model")
    anatomy = _anatomy()
    argv = ["--device", "cpu", "--model", str(tmp_path / "model"), "--prompts", "3"]
    argv += ["--samples", "3", "--tokens", "5", "--top-p", "0.8", "--out", str(tmp_path / "out")]
    assert anatomy.main(argv) == 0
    report = json.loads((tmp_path / "out" / "gpu_anatomy.json").read_text())
    rows = {r["config"]: r for r in report["configs"]}
    assert list(rows) == list(anatomy.CONFIGS) and report["meta"]["rows"] == 9
    for name, config in anatomy.CONFIGS.items():  # batch 1 on the first 8 of the 9 rows
        assert rows[name]["tokens"] == 5 * min(9, config.rows), name
    for name, config in anatomy.CONFIGS.items():
        if config.bik:
            assert rows[name]["unequal_share"] == 0, name
    plain = ("decode_b1_bf16", "decode_b64_fp16", "decode_b64_fp32")
    assert any(rows[name]["unequal_share"] > 0 for name in plain)  # the negative control
    # renormalising over the nucleus raises every engine log-prob: far more than the numerics
    assert (
        rows["decode_b64_bf16_topp"]["mean_abs_delta"] > rows["decode_b64_bf16"]["mean_abs_delta"]
    )
    assert "| bik_decode_b64_fp32 | 0.0 % |" in (tmp_path / "out" / "gpu_anatomy.md").read_text()


def test_the_nucleus_is_the_one_transformers_samples_from():
    from transformers.generation.logits_process import TopPLogitsWarper

    anatomy = _anatomy()
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]]))
    mass = anatomy.nucleus_log_mass(logits, 0.8).exp()
    torch.testing.assert_close(mass, torch.tensor([0.8, 0.9]))  # {0, 1} and {0}
    kept = TopPLogitsWarper(0.8)(None, logits.clone()).isfinite()
    torch.testing.assert_close(mass, (logits.exp() * kept).sum(-1))
    random = torch.randn(3, 50) * 3
    kept = TopPLogitsWarper(0.9)(None, random.clone()).isfinite()
    expected = (torch.softmax(random, -1) * kept).sum(-1).log()
    torch.testing.assert_close(anatomy.nucleus_log_mass(random, 0.9), expected)
    assert torch.equal(anatomy.nucleus_log_mass(logits, 1.0), torch.zeros(2))
