"""All-reduce calibrations per group size on the emulated hosts of ``plans.py`` (issue 30 item 4).

    sudo .venv/bin/python benchmarks/allreduce_groups.py --hosts 4 --cpus-per-host 0.5 --groups 2,3,4 \
        --lock /tmp/hybridpipe-bench.lock --out /tmp/cal
    .venv/bin/python benchmarks/allreduce_groups.py --join /tmp/cal/h4_g4.json /tmp/cal/h4_g2.json \
        /tmp/cal/h4_g3.json -o /tmp/cal/allreduce4_groups.json

The first brings up the emulated cluster of ``plans.py`` (1 Gbit/s, the CPU quota per host) under the benchmark
lock and runs ``hybridpipe bench-allreduce`` (``plans_steps.allreduce_calibration``'s settings) on its first g
hosts for each g, one calibration ``h{hosts}_g{g}.json`` each (the other hosts idle, as ``bench-allreduce
--group-sizes`` leaves them). The second joins such files into one calibration (format 3): the whole
group's fits and one fit per smaller group (``fitting.with_groups``), which ``plans_prediction.py
--calibration`` and ``hybridpipe partition --calibration`` price with.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(hosts: int, cpus: float | None, groups: Sequence[int], out: Path, lock: str | None) -> list[Path]:
    """``bench-allreduce`` on the first g hosts of one emulated cluster, for each g (see the module docstring)."""
    from benchmarks.common import REPO, bench_lock, worker_env
    from tools.emucluster import EmulatedCluster
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with bench_lock(lock) as waited, EmulatedCluster(hosts, rate="1gbit", cpus=cpus) as cluster:
        print(f"lock after {waited} s, load {os.getloadavg()}", flush=True)
        for g in groups:
            path = out / f"h{hosts}_g{g}.json"
            t = time.monotonic()
            cluster.run([sys.executable, "-m", "hybridpipe.cli", "bench-allreduce", "-o", str(path), "--level",
                         "network", "--sizes", "64K..64M", "--size-step", "4", "--reps", "3", "--budget", "0.2",
                         "--group-sizes", "none", "--no-progress"], hosts=cluster.hosts[:g], timeout_s=900,
                        env=lambda h, g=g: {**worker_env(cluster, h), "WORLD_SIZE": str(g),
                                            "MASTER_PORT": str(29650 + g)}, cwd=REPO)
            print(f"{hosts} hosts, {cpus} cores each: first {g} hosts in {time.monotonic() - t:.0f} s, "
                  f"load {os.getloadavg()}", flush=True)
            written.append(path)
    return written


def join(whole: Path, parts: Sequence[Path], out: Path) -> Path:
    """One format-3 calibration from ``whole`` and the ``parts`` timed on its first ranks (``with_groups``)."""
    from hybridpipe.partitioner.cost.calibration import load_calibration, save_calibration
    from hybridpipe.partitioner.cost.fitting import with_groups
    return save_calibration(with_groups(load_calibration(whole), [load_calibration(p) for p in parts]), out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--cpus-per-host", type=float, default=None, help="CPU quota per host (plans.py's)")
    p.add_argument("--groups", default="2,3,4", help="group sizes to time (the first g hosts each)")
    p.add_argument("--lock", default=None, help="the benchmark lock to hold (flock)")
    p.add_argument("--out", type=Path, default=Path("/tmp/allreduce-groups"), help="folder of the calibrations")
    p.add_argument("--join", type=Path, nargs="+", metavar="CAL",
                   help="instead of measuring: join the whole group's calibration (first) with the smaller groups'")
    p.add_argument("-o", "--output", type=Path, help="with --join: the calibration to write")
    a = p.parse_args(argv)
    if a.join:
        if not a.output or len(a.join) < 2:
            p.error("--join WHOLE PART... needs at least two calibrations and -o")
        print(f"wrote {join(a.join[0], a.join[1:], a.output)}")
        return 0
    for path in measure(a.hosts, a.cpus_per_host, [int(g) for g in a.groups.split(",")], a.out, a.lock):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
