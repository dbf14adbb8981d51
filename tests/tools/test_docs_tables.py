"""Facts with one home: tables in the docs that are checked against the code they describe."""

import re
from pathlib import Path

import pytest
import torch

from bik import families
from rl_harness.metrics import mismatch_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_the_family_table_is_the_registry():
    assert families.markdown_table() in (ROOT / "docs" / "huggingface.md").read_text()


def test_the_vllm_family_table_is_the_registry():
    assert families.vllm_table() in (ROOT / "docs" / "vllm.md").read_text()


@pytest.mark.parametrize("keys", [{"experts_key": "n"}, {"expert_width_key": "w"}])
def test_a_family_record_names_both_moe_keys_or_neither(keys):
    with pytest.raises(ValueError, match="experts_key and expert_width_key"):
        families.Family("tiny", "Tiny", "a note", **keys)


def test_the_harness_manual_names_every_mismatch_metric_and_no_other():
    manual = (ROOT / "rl_harness" / "README.md").read_text()
    table = manual.split("| `mismatch/...` | what it is |", 1)[1].split("\n\n", 1)[0]
    documented = set()
    for row in table.splitlines()[2:]:
        documented |= {f"mismatch/{name}" for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    logp = torch.randn(2, 5)
    assert documented == set(mismatch_metrics(logp, logp + 0.01, torch.ones(2, 5)))


def test_the_readme_fits_on_a_screen_or_two():
    # details live in docs/, rl_harness/README.md and benchmarks/README.md
    assert len((ROOT / "README.md").read_text().encode()) <= 12 * 1024


def _linear_ratios(rows: str, keep) -> list[float]:
    """vs_cublas_graph of the H200 probe's linear rows whose M passes ``keep``."""
    ratios = []
    for row in rows.splitlines():
        m = re.match(r"\| M=(\d+) K=\d+ N=\d+ .*\| ([\d.]+) \| [\d.e+]+ \|$", row)
        if m and keep(int(m.group(1))):
            ratios.append(float(m.group(2)))
    return ratios


def test_the_readmes_gpu_linear_ratios_are_the_probes():
    """Issue 71, item 2: the README's CUDA-graph linear ratios are read back from the results
    file they come from, so a bound that the file contradicts fails."""
    probe = (ROOT / "benchmarks" / "results" / "h200-probe-2026-11-27.md").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    claims = (
        (lambda m: m >= 512, "{low} – {high}x cuBLAS at M ≥ 512"),
        (lambda m: m <= 128, "{low} – {high}x at M ≤ 128"),
    )
    for keep, claim in claims:
        ratios = _linear_ratios(probe, keep)
        expected = claim.format(low=f"{min(ratios):.2f}", high=f"{max(ratios):.2f}")
        assert ratios and expected in readme, expected
