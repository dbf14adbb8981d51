"""benchmarks/anatomy_along_training.py on made-up anatomy runs: the aggregates, the per-bin
ratio of the last point to the first, the registered factor-2 verdict and the plot."""

import json

import benchmark_scripts
import pytest

HEADER = "path,axis,low,high,tokens,mean_abs_delta,outside_band_share\n"


def point(directory, bins, mean_abs_delta):
    """An anatomy run of one path (hf_bf16) with entropy bins {(low, high): (tokens, delta)}."""
    directory.mkdir()
    record = dict(
        path="hf_bf16",
        tokens=sum(n for n, _ in bins.values()),
        mean_abs_delta=mean_abs_delta,
        p99_abs_delta=0.2,
        outside_band_share=0.1,
        abs_cumsum_end_mean=0.5,
        abs_cumsum_end_max=1.5,
    )
    (directory / "anatomy.json").write_text(json.dumps({"paths": [record]}))
    rows = [f"hf_bf16,entropy,{lo},{hi},{n},{d},0.0\n" for (lo, hi), (n, d) in bins.items()]
    rows.append("hf_bf16,position,0.0,4.0,32,1.0,0.0\n")  # another axis: not compared
    (directory / "anatomy_bins.csv").write_text(HEADER + "".join(rows))
    return f"{directory.name}={directory}"


def test_the_last_point_against_the_first_per_entropy_bin(tmp_path, capsys):
    first = point(tmp_path / "pretrained", {(0.0, 0.5): (40, 0.01), (0.5, 1.0): (30, 0.02)}, 0.02)
    middle = point(tmp_path / "step19", {(0.0, 0.5): (50, 0.03)}, 0.03)
    last = point(tmp_path / "step59", {(0.0, 0.5): (60, 0.05), (0.5, 1.0): (10, 0.02)}, 0.04)
    along = benchmark_scripts.load("anatomy_along_training")
    out = tmp_path / "out"
    assert along.main([first, middle, last, "--out", str(out)]) == 0
    text = (out / "along_training.md").read_text()
    # mean entropy from the bins' midpoints: (40 * 0.25 + 30 * 0.75) / 70
    assert "| pretrained | 70 | 0.46 | 0.02 |" in text
    # only the bin with >= 20 tokens at both ends is compared; 0.05 / 0.01 is outside 2x
    assert "| 0-0.5 | 40, 0.01 | 50, 0.03 | 60, 0.05 | 5.00 | no |" in text
    assert "0.5-1 |" not in text
    assert "Every compared bin within 2x: no." in text
    assert (out / "along_training.png").stat().st_size > 0
    capsys.readouterr()


def test_points_and_paths_are_checked(tmp_path):
    along = benchmark_scripts.load("anatomy_along_training")
    only = point(tmp_path / "a", {(0.0, 0.5): (40, 0.01)}, 0.01)
    with pytest.raises(SystemExit):
        along.main([only, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="no path 'hf_fp32'"):
        along.main([only, only, "--path", "hf_fp32", "--out", str(tmp_path / "out")])
