"""`hybridpipe bench-allreduce` end to end on 2 local ranks: a calibration the partitioner
reads, a table and a figure; bad arguments end with one line and exit code 2."""

from __future__ import annotations

import pytest

from hybridpipe.cli import main
from hybridpipe.partitioner.cost.calibration import load_calibration


def test_writes_a_calibration_table_and_figure(tmp_path, capsys) -> None:
    out = tmp_path / "cal.json"
    code = main(["bench-allreduce", "--ranks", "2", "--sizes", "4K,64K", "--algorithms", "ring,butterfly,native",
                 "--reps", "1", "--budget", "0", "--no-progress", "--level", "host", "-o", str(out)])
    assert code == 0
    cal = load_calibration(out)
    assert (cal.world_size, cal.hosts, cal.backend, cal.level) == (2, 1, "gloo", "host")
    assert set(cal.algorithms) == {"ring", "butterfly", "native"}
    assert {(s.algorithm, s.bytes) for s in cal.samples} == {
        (a, b) for a in ("ring", "butterfly", "native", "p2p") for b in (4096, 65536)}
    assert all(s.seconds > 0 for s in cal.samples) and cal.gamma_s_per_byte > 0
    assert 0 <= cal.interference_s_per_byte < 1e-6           # measured beside the ring (interference.py)
    assert cal.overlap_slowdown >= 1.0
    printed = capsys.readouterr().out
    assert "busbw" in printed and "64K" in printed and "1/beta" in printed
    assert (tmp_path / "cal.png").stat().st_size > 1000


@pytest.mark.slow          # 3 spawned ranks, ~14 s on 2 busy cores; the fits per size are unit-tested
def test_group_sizes_are_timed_and_fitted_on_the_first_ranks(tmp_path, capsys) -> None:
    out = tmp_path / "cal.json"
    code = main(["bench-allreduce", "--ranks", "3", "--group-sizes", "2", "--sizes", "4K,64K", "--algorithms",
                 "ring,native", "--reps", "1", "--budget", "0", "--no-progress", "-o", str(out)])
    assert code == 0
    cal = load_calibration(out)
    assert cal.world_size == 3 and set(cal.algorithms) == set(cal.group_fits[2]) == {"ring", "native"}
    assert {(s.algorithm, s.bytes, s.ranks) for s in cal.samples} == {
        (a, b, r) for a in ("ring", "native") for b in (4096, 65536) for r in (0, 2)} | {
        ("p2p", b, 0) for b in (4096, 65536)}
    assert "on the first 2 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--group-sizes", "1,2"], "--group-sizes: must be auto, none or a list"),
    (["--ranks", "2", "--group-sizes", "2"], "fewer ranks than the 2 measured"),
    (["--algorithms", "ring,fastest"], "unknown fastest"),
    (["--sizes", "4K"], "at least two sizes"),
    (["--ranks", "1"], "--ranks: must be between 2 and 1024, got 1"),
    (["--sizes", "4Q..8K"], "cannot read size"),
])
def test_bad_arguments_fail_with_one_line(tmp_path, capsys, argv, message) -> None:
    assert main(["bench-allreduce", "-o", str(tmp_path / "c.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
