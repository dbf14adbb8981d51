"""The column form of a finished run's metrics (rl_harness.metrics_pack): exact, smaller than
gzip, read by every reader; the committed results within their size budget."""

import gzip
import json
import lzma
import math
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_harness import metrics_pack, rundir
from rl_harness.errors import RunDirError

REPO = Path(__file__).resolve().parents[2]
RESULTS_BUDGET = 20 * 2**20  # what results/ may hold, tracked (it travels to a GPU machine)

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
FLOAT32S = st.floats(allow_nan=False, width=32)
VALUES = st.one_of(FLOATS, st.integers(-(2**40), 2**40), st.none(), st.text(max_size=8))


@st.composite
def metric_rows(draw):
    """Rows as a run logs them: a step, columns of one kind (float64, float32-exact or
    mixed), and keys only some rows carry (an evaluation step's)."""
    steps = draw(st.integers(1, 12))
    kinds = {"f8": FLOATS, "f4": FLOAT32S, "mixed": VALUES}
    columns = draw(
        st.dictionaries(st.text(min_size=1, max_size=6), st.sampled_from(list(kinds)), max_size=5)
    )
    rows = []
    for step in range(steps):
        row = {"step": step}
        for key, kind in columns.items():
            if key != "step" and draw(st.booleans() if kind == "mixed" else st.just(True)):
                row[key] = draw(kinds[kind])
        rows.append(row)
    return rows


@settings(max_examples=60, deadline=None)
@given(metric_rows())
def test_unpack_gives_back_every_row_byte_for_byte(rows):
    back = metrics_pack.unpack(metrics_pack.pack(rows))
    assert rundir.metrics_text(back) == rundir.metrics_text(rows)  # key order, -0.0, NaN


def test_float32_columns_are_stored_in_four_bytes_and_others_in_eight():
    third = 1 / 3
    rows = [{"step": i, "loss": float(f"{i}.5"), "k3": third * i, "n": i} for i in range(4)]
    header = json.loads(lzma.decompress(metrics_pack.pack(rows)).partition(b"\n")[0])
    kinds = {c["key"]: c.get("dtype", "json") for c in header["columns"]}
    assert kinds == {"step": "json", "loss": "f4", "k3": "f8", "n": "json"}


def test_a_cut_or_foreign_file_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    packed = metrics_pack.pack([{"step": 0, "x": math.pi}, {"step": 1, "x": math.e}])
    (run / rundir.METRICS_PACKED).write_bytes(packed[: len(packed) // 2])
    with pytest.raises(RunDirError, match=r"metrics\.cols\.xz: cannot be read"):
        rundir.read_metrics(run)
    (run / rundir.METRICS_PACKED).write_bytes(lzma.compress(b'{"format": "other"}\n'))
    with pytest.raises(RunDirError, match="not a 'rl_harness metrics columns 1' file"):
        rundir.read_metrics(run)


def test_a_run_compacted_with_gzip_is_repacked_and_reads_the_same(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 0.1 * s, "digests": f"{s:04x}"} for s in range(5)]
    (run / rundir.METRICS_GZ).write_bytes(gzip.compress(rundir.metrics_text(rows).encode()))
    (run / rundir.SUMMARY).write_text("done\n")
    assert rundir.read_metrics(run) == rows
    assert rundir.compact(run) and not rundir.compact(run)
    assert not (run / rundir.METRICS_GZ).exists()
    assert rundir.read_metrics(run) == rows


def test_compact_refuses_lines_that_do_not_print_back(tmp_path):
    """A hand-edited file (a float written with fewer digits than Python prints) would not
    come back byte for byte: it is left as it is."""
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.METRICS).write_text('{"step": 0, "x": 1.50}\n')
    (run / rundir.SUMMARY).write_text("done\n")
    with pytest.raises(RunDirError, match="does not print back byte for byte"):
        rundir.compact(run)
    assert (run / rundir.METRICS).read_text() == '{"step": 0, "x": 1.50}\n'


def test_the_committed_results_stay_within_their_budget_and_are_packed():
    """results/ travels to the GPU machine inside its 64 MiB: it holds at most 20 MiB, no
    run's plot (``compare`` draws one) and no run's metrics in a form other than packed."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "results"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    files = [REPO / name for name in listed if name and (REPO / name).exists()]
    assert sum(f.stat().st_size for f in files) <= RESULTS_BUDGET
    names = {f.name for f in files}
    assert rundir.PLOT not in names
    assert not names & {rundir.METRICS, rundir.METRICS_GZ}
