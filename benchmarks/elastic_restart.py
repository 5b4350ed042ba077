"""Elastic restarts (issue 21): seconds from SIGKILL of a host to the first step after the
restart, split into its parts; steps re-done against the checkpoint interval; the cost of a
checkpoint per step.

    sudo .venv/bin/python benchmarks/elastic_restart.py --every 5 10 20 -o benchmarks/results/elastic.json

Restarts run on 4 emulated hosts (tools/emucluster, root: one network namespace per host, 1
Gbit/s links), one torchrun agent per host (``--nnodes 3:4``, c10d rendezvous with the README's
settings, ``--max-restarts 2``), the job planned at start from a profile (``--profile``); when the
kill step is reached (chosen uniformly in [2K, 3K) for interval K, seeded) every process of host
3 (agent and worker) gets SIGKILL. From the run's restart record (runtime/restarts.py) and the
kill time (one clock: every host is this machine):

* detection: SIGKILL -> the survivors' exit (their exit notes);
* rendezvous: -> the restarted worker process starts (agent notices, keep-alive expiry,
  re-rendezvous as 3, process spawn);
* start-up: Python and the imports, the process group (every rank joined), the configuration
  agreed, model build and capture (torch.export, or the capture cache), the rank's stages (their
  seeded weights), optimizer, replica groups and p2p channels (split by the worker's milestones);
* re-planning (rank 0's partitioner) and checkpoint load (resharding included);
* first step: the step itself.

The checkpoint cost runs without a kill on 4 loopback processes (one plan, ``--plan``), each
interval K against no checkpoints: (step time with K - without) and the manifests' save times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime.elastic import RDZV_CONF, free_port  # noqa: E402

MODEL = "mlp[hidden=1024,layers=8]"


def profile(model: str, batch: int, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "hybridpipe.cli", "profile", model, "-b", str(batch), "--repeats", "2",
                    "-q", "-o", str(out)], cwd=ROOT, check=True)
    return out


def agent_argv(host, hosts: int, endpoint: str, tag: str, job: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{hosts - 1}:{hosts}", "--nproc-per-node",
            "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", tag,
            "--rdzv-conf", f"{RDZV_CONF},is_host={1 if host.index == 0 else 0}", "--local-addr", host.addr,
            "--max-restarts", "2", "--monitor-interval", "0.2", *job]


def kill_namespace(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], capture_output=True)


def steps_done(run: Path) -> int:
    path = run / "metrics" / "rank-00000.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def one_restart(args: argparse.Namespace, prof: Path, every: int, kill_step: int, work: Path) -> dict:
    from tools.emucluster import EmulatedCluster

    ckpt, run = work / "ckpt", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(4, rate=args.rate, cpus=args.cpus) as cluster:
        (work / "cluster.json").write_text(json.dumps(cluster.cluster_json(memory_gb=4.0)))
        job = [str(ROOT / "launch.py"), "--profile", str(prof), "--cluster", str(work / "cluster.json"),
               "--micro-batches", str(args.micro_batches), "--steps", str(3 * every + args.steps_after),
               "--checkpoint-dir", str(ckpt),
               "--checkpoint-every", str(every), "--resume", "--run-dir", str(run), "--timeout", "60",
               "--peer-timeout", str(args.peer_timeout), "--no-progress", "--no-trace", "--lr", "0.01"]
        endpoint = f"{cluster.hosts[0].addr}:{free_port()}"
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        agents = []
        for host in cluster.hosts:
            base = cluster.env(host, ranks=False)
            agents.append(cluster.start(host, agent_argv(host, 4, endpoint, cluster.tag, job), env={**base, **env},
                                        cwd=ROOT))
            if host.index == 0:
                time.sleep(0.5)
        deadline = time.monotonic() + 600
        while steps_done(run) < kill_step and time.monotonic() < deadline:
            time.sleep(0.005)
        killed = time.time()
        kill_namespace(cluster.hosts[3].ns)
        results = cluster.wait(agents[:3], 600, check=False, fail_fast=False)
    if any(r.returncode != 0 for r in results):
        raise SystemExit("\n".join(r.describe() + "\n" + r.tail(30) for r in results))
    summary = json.loads((run / "summary.json").read_text())
    (entry,) = summary["restarts"]
    detect = entry["failure_detected_at"] - killed
    rendezvous = entry["seconds_to_worker_start"]
    total = entry["seconds_to_first_step"] + detect
    startup = total - detect - rendezvous - entry["planning_s"] - entry["checkpoint_load_s"] - entry["first_step_s"]
    # the worker's milestones (restarts.restart_entry): Python and imports, every rank joined the process
    # group, the plan and configuration agreed (re-planning subtracted), model capture, stages + optimizer + groups
    split = {"imports_s": entry.get("imports_s"), "process_group_s": entry.get("process_group_s"),
             "config_s": round(entry.get("config_s", 0.0) - entry["planning_s"], 2),
             "model_capture_s": entry.get("model_s"), "stages_optimizer_groups_s": entry.get("job_s")}
    return {"every": every, "kill_step": kill_step, "resumed_from": entry["resumed_from_step"],
            "steps_redone": entry["steps_redone"], "world": [entry["world_size_before"], entry["world_size_after"]],
            "plans": summary["stages"], "kill_to_first_step_s": round(total, 2), "detection_s": round(detect, 2),
            "rendezvous_s": round(rendezvous, 2), "startup_s": round(startup, 2), **split,
            "replanning_s": entry["planning_s"], "checkpoint_load_s": entry["checkpoint_load_s"],
            "first_step_s": entry["first_step_s"]}


def checkpoint_cost(args: argparse.Namespace, prof: Path, work: Path) -> list[dict]:
    """Mean step time on 4 loopback processes with a checkpoint every K steps vs none."""
    plan = work / "plan.json"
    subprocess.run([sys.executable, "-m", "hybridpipe.cli", "partition", str(prof), "--cluster",
                    str(ROOT / "examples" / "clusters" / "local4.json"), "--micro-batches", str(args.micro_batches),
                    "-o", str(plan)], cwd=ROOT, check=True, capture_output=True)
    rows = []
    for every in [0, *args.cost_every]:
        ckpt, run = work / f"cost-ckpt-{every}", work / f"cost-run-{every}"
        extra = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every)] if every else []
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(ROOT / "launch.py"), "--plan", str(plan), "--steps", str(args.cost_steps), "--run-dir",
                        str(run), "--no-progress", "--no-trace", *extra], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        summary = json.loads((run / "summary.json").read_text())
        saves = [json.loads(p.read_text())["save_seconds"] for p in ckpt.glob("step-*/manifest.json")] if every else []
        size = sum(f.stat().st_size for f in ckpt.glob("step-*/*")) / max(1, len(saves)) if every else 0
        rows.append({"every": every, "step_ms": summary["measured_step_ms"], "save_ms": round(1000 * (
            sum(saves) / len(saves)), 1) if saves else 0.0, "checkpoint_mb": round(size / 1e6, 1)})
    base = rows[0]["step_ms"]
    for r in rows[1:]:
        r["overhead_ms_per_step"] = round(r["step_ms"] - base, 2)
        r["save_ms_per_step"] = round(r["save_ms"] / r["every"], 2)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (the profile's)")
    p.add_argument("--micro-batches", type=int, default=12, help="fixed, so the global batch survives a re-plan")
    p.add_argument("--steps-after", type=int, default=10, help="each restart run has 3K + this many steps")
    p.add_argument("--every", type=int, nargs="+", default=[5, 10, 20], help="checkpoint intervals K to restart with")
    p.add_argument("--kills", type=int, default=1, help="restarts per interval, each a fresh job (the median is kept)")
    p.add_argument("--cost-every", type=int, nargs="+", default=[1, 10, 50])
    p.add_argument("--cost-steps", type=int, default=60)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--cpus", type=float, default=None, help="CPU quota per emulated host (default none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-restarts", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--profile", type=Path, help="an existing profile of --model (else one is made)")
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args()
    rng = random.Random(args.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    out: dict = {"command": " ".join(["benchmarks/elastic_restart.py", *sys.argv[1:]]), "commit": commit.stdout.strip(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0],
                 "model": args.model, "micro_batches": args.micro_batches, "batch": args.batch, "restarts": [],
                 "checkpoint_cost": []}
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        work = Path(tmp)
        prof = args.profile or profile(args.model, args.batch, work / "profile.json")
        if not args.skip_restarts:
            for every in args.every:
                for kill in range(args.kills):
                    kill_step = rng.randrange(2 * every, 3 * every)
                    row = one_restart(args, prof, every, kill_step, work / f"restart-{every}-{kill}")
                    row["load"] = round(os.getloadavg()[0], 1)
                    print(json.dumps(row), flush=True)
                    out["restarts"].append(row)
            out["median_kill_to_first_step_s"] = statistics.median(r["kill_to_first_step_s"] for r in out["restarts"])
            out["load_after"] = os.getloadavg()[0]
        for row in [] if args.skip_cost else checkpoint_cost(args, prof, work):
            print(json.dumps(row), flush=True)
            out["checkpoint_cost"].append(row)
    if args.output:
        args.output.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
