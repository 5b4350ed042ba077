"""Seconds lost per failure: a lost replica taken over in place (``launch --in-place``) vs the
elastic restart (issue 31 item 7, 8), for 3 checkpoint intervals.

    sudo .venv/bin/python benchmarks/inplace_vs_restart.py --every 5 10 20 -o benchmarks/results/inplace_vs_restart.json

Each run is elastic_restart.py's: 4 emulated hosts (tools/emucluster, root), one torchrun agent
per host (``--nnodes 3:4``, c10d, the README's settings), the job planned at start from a profile
(4 workers: one stage x 4 replicas), a checkpoint every K steps; at a step drawn uniformly from
[2K, 3K) (seeded, the same for both modes) every process of host 3 gets SIGKILL. *Seconds lost*:
from the SIGKILL until the job is back at the step it was at, i.e. until its first step after
the failure completes plus the steps re-done after that one at the median step time (in place:
the interrupted step is the one redone; restart: every step since the newest checkpoint). With
``--loopback`` the hosts are 127.0.0.1 processes (no network emulation, no root).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from elastic_restart import MODEL, agent_argv, kill_namespace, profile, steps_done  # noqa: E402

from tests.runtime.elastic import ElasticJob, free_port  # noqa: E402


def job_args(args: argparse.Namespace, prof: Path, cluster: Path, every: int, work: Path, in_place: bool) -> list:
    return [str(ROOT / "launch.py"), "--profile", str(prof), "--cluster", str(cluster),
            "--micro-batches", str(args.micro_batches), "--steps", str(3 * every + args.steps_after),
            "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(every), "--resume",
            "--run-dir", str(work / "run"), "--timeout", "60", "--peer-timeout", str(args.peer_timeout),
            "--no-progress", "--no-trace", "--lr", "0.01", *(["--in-place"] if in_place else [])]


def wait_for_step(run: Path, step: int, alive) -> None:
    deadline = time.monotonic() + 600
    while steps_done(run) < step:
        if time.monotonic() > deadline or not alive():
            raise SystemExit(f"the job never reached step {step} (see {run})")
        time.sleep(0.005)


def emulated(args: argparse.Namespace, prof: Path, every: int, kill_step: int, work: Path, in_place: bool) -> float:
    """One run on emulated hosts; returns the time of the SIGKILL."""
    from tools.emucluster import EmulatedCluster

    with EmulatedCluster(4, rate=args.rate) as cluster:
        (work / "cluster.json").write_text(json.dumps(cluster.cluster_json(memory_gb=4.0)))
        job = job_args(args, prof, work / "cluster.json", every, work, in_place)
        endpoint = f"{cluster.hosts[0].addr}:{free_port()}"
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        agents = []
        for host in cluster.hosts:
            argv = agent_argv(host, 4, endpoint, cluster.tag, job)
            agents.append(cluster.start(host, argv, env={**cluster.env(host, ranks=False), **env}, cwd=ROOT))
            if host.index == 0:
                time.sleep(0.5)
        wait_for_step(work / "run", kill_step, lambda: True)
        killed = time.time()
        kill_namespace(cluster.hosts[3].ns)
        results = cluster.wait(agents[:3], 600, check=False, fail_fast=False)
    if any(r.returncode != 0 for r in results):
        raise SystemExit("\n".join(r.describe() + "\n" + r.tail(30) for r in results))
    return killed


def loopback(args: argparse.Namespace, prof: Path, every: int, kill_step: int, work: Path, in_place: bool) -> float:
    job = job_args(args, prof, ROOT / "examples" / "clusters" / "local4.json", every, work, in_place)
    with ElasticJob(work / "logs", job, hosts=4, min_hosts=3, max_restarts=2) as elastic:
        wait_for_step(work / "run", kill_step, lambda: all(a.poll() is None for a in elastic.agents))
        elastic.kill_host(3)
        killed = elastic.killed[3]
        results = elastic.wait(600)
    if any(rc != 0 for rc, _ in results[:3]):
        raise SystemExit("\n".join(f"agent {h} rc={rc}\n{out[-3000:]}" for h, (rc, out) in enumerate(results)))
    return killed


def one_run(args: argparse.Namespace, prof: Path, every: int, kill_step: int, work: Path, in_place: bool) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    killed = (loopback if args.loopback else emulated)(args, prof, every, kill_step, work, in_place)
    run = work / "run"
    summary = json.loads((run / "summary.json").read_text())
    (event,) = summary["restarts"]
    steps = [json.loads(x) for x in (run / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    step_s = statistics.median(s["step_ms"] for s in steps[1:]) / 1000
    back = event["failure_detected_at"] + event["seconds_to_first_step"] - killed     # first step after it done
    redone = event["steps_redone"] if event["kind"] == "restart" else 0    # beyond that first step
    return {"mode": "in place" if in_place else "restart", "kind": event["kind"], "every": every,
            "kill_step": kill_step, "steps_redone": event["steps_redone"], "step_s": round(step_s, 3),
            "kill_to_first_step_s": round(back, 2), "seconds_lost": round(back + max(0, redone - 1) * step_s, 2),
            "detection_s": round(event["failure_detected_at"] - killed, 2),
            "world": [event["world_size_before"], event["world_size_after"]], "event": event}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everys = sorted({r["every"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.38
    for i, mode in enumerate(["restart", "in place"]):
        values = [next((r["seconds_lost"] for r in rows if r["mode"] == mode and r["every"] == k), 0) for k in everys]
        bars = ax.bar([x + (i - 0.5) * width for x in range(len(everys))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.1f s", fontsize=8)
    ax.set_xticks(range(len(everys)), [f"K = {k}" for k in everys])
    ax.set_ylabel("seconds lost per failure")
    ax.set_title("a killed replica's host: restart vs in place", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=12)
    p.add_argument("--steps-after", type=int, default=10)
    p.add_argument("--every", type=int, nargs="+", default=[5, 10, 20])
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--loopback", action="store_true", help="127.0.0.1 processes instead of emulated hosts")
    p.add_argument("--modes", nargs="+", default=["restart", "in-place"], choices=["restart", "in-place"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rng = random.Random(args.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    out: dict = {"command": " ".join(["benchmarks/inplace_vs_restart.py", *sys.argv[1:]]),
                 "commit": commit.stdout.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load": os.getloadavg()[0], "hosts": "loopback" if args.loopback else f"emulated {args.rate}",
                 "model": args.model, "rows": []}
    with tempfile.TemporaryDirectory(prefix="inplace-") as tmp:
        work = Path(tmp)
        prof = args.profile or profile(args.model, args.batch, work / "profile.json")
        for every in args.every:
            kill_step = rng.randrange(2 * every, 3 * every)
            for mode in args.modes:
                row = one_run(args, prof, every, kill_step, work / f"{mode}-{every}", mode == "in-place")
                print(json.dumps({k: v for k, v in row.items() if k != "event"}), flush=True)
                out["rows"].append(row)
                args.output.write_text(json.dumps(out, indent=1) + "\n")
    plot(out["rows"], args.output.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
