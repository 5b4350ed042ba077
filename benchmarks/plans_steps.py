"""The steps of ``benchmarks/plans.py``, each one process or job: profile a model, partition it,
calibrate the all-reduce on the emulated cluster, train a plan on the emulated hosts; and the
models it runs (MODELS: the sizes are reduced so that n workers on 2 cores stay in proportion
to 1 Gbit/s)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.plans_analysis import refusal_lines
from hybridpipe.jsonfile import read_json
from hybridpipe.runtime.parts import CAPTURE_CACHE

# name -> (model spec, samples per micro-batch, what was reduced)
MODELS = {
    "alexnet": ("alexnet[image=64]", 32, "input 3x64x64 (paper 224); the adaptive pool keeps fc1 at 9216 inputs, "
                "so all 62.4M parameters are kept"),
    "alexnet224": ("alexnet[image=224]", 8, "the paper's input 3x224x224, batch 8: the convolutions are ~70% of the "
                   "compute and hold 4% of the 62.4M parameters, fc1-fc3 the rest (at 64x64 the fc layers' compute "
                   "dominates too and no plan differs much)"),
    "vgg16": ("vgg16[image=32]", 4, "input 3x32x32 (paper 224), batch 4; the adaptive pool keeps fc1 at 25088 "
              "inputs, so all 138.4M parameters are kept"),
    "resnet50": ("resnet50[image=64]", 8, "input 3x64x64 (paper 224), batch 8; all 25.6M parameters kept"),
    "gpt": ("gpt", 8, "the zoo's small GPT (4 layers, width 256, seq 128, vocab 2048; 4.2M parameters), batch 8"),
    "llama": ("hf:llama[num_hidden_layers=14,hidden_size=128,intermediate_size=448,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=32000,tie_word_embeddings=False,seq=64]", 4,
              "Llama-style (hf:llama: untied embedding and LM head, grouped-query attention), 14 layers of width 128, "
              "seq 64, vocabulary 32000 (RESULTS 4c's 128k model scaled to 2 cores): the LM head with its loss is "
              "~13 layers' compute, the embedding and the head hold 75% of the 12.3M parameters; batch 4"),
}
LAUNCH_TIMEOUT_S = 120       # launch.py --timeout: any receive / collective


def hybridpipe_cli(args: Sequence[str], timeout_s: float = 600,
                   threads: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-m", "hybridpipe.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def profile_model(name: str, work: Path, repeats: int) -> Path:
    spec, batch, _ = MODELS[name]
    out = work / f"{name}.profile.json"
    r = hybridpipe_cli(["profile", spec, "-b", str(batch), "--repeats", str(repeats), "-q", "-o", str(out)], threads=1)
    if r.returncode:
        raise RuntimeError(f"profiling {spec} failed:\n{r.stderr[-2000:]}")
    return out


def partition(profile: Path, cluster_file: Path, strategy: str, out: Path, calibrations: Sequence[Path]) -> dict:
    """The plan dict, or {"refused": message} when the partitioner refuses."""
    cmd = ["partition", str(profile), "--cluster", str(cluster_file), "--strategy", strategy, "-o", str(out)]
    for c in calibrations:
        cmd += ["--calibration", str(c)]
    r = hybridpipe_cli(cmd, timeout_s=300)
    if r.returncode:
        return {"refused": (r.stderr.strip() or r.stdout.strip())[-1000:]}
    return read_json(out, "plan")


def allreduce_calibration(cluster, out: Path, timeout_s: float) -> Path:
    """``hybridpipe bench-allreduce`` on every host of the emulated cluster (level ``network``)."""
    from benchmarks.common import worker_env
    cluster.run([sys.executable, "-m", "hybridpipe.cli", "bench-allreduce", "-o", str(out), "--level", "network",
                 "--sizes", "64K..64M", "--size-step", "4", "--reps", "3", "--budget", "0.2", "--no-progress"],
                timeout_s=timeout_s, env=lambda h: worker_env(cluster, h), cwd=REPO)
    return out


def link_fits(calibration_file: Path) -> dict[str, dict[str, float]]:
    """Per algorithm (and p2p) of a calibration: fitted per-step latency (us) and bandwidth (Gbit/s)."""
    from hybridpipe.partitioner.cost.calibration import load_calibration
    cal = load_calibration(calibration_file)
    fits = {"p2p": cal.p2p, **cal.algorithms} if cal.p2p else dict(cal.algorithms)
    out = {name: {"alpha_us": round(f.alpha_s * 1e6, 1), "gbps": round(8e-9 / f.beta_s_per_byte, 3)
                  if f.beta_s_per_byte > 0 else None, "fit_error": round(f.rel_error, 3)}
           for name, f in fits.items()}
    return {**out, "interference_ms_per_mb": round(cal.interference_s_per_byte * 1e9, 3),
            "overlap_slowdown": round(cal.overlap_slowdown, 3)}


def train_plan(cluster, plan_file: Path, run_dir: Path, steps: int, port: int, timeout_s: float,
               trace: bool = False, capture_cache: Path | None = None) -> dict:
    """Run launch.py on every emulated host; the summary.json, or {"failed": message}.

    ``capture_cache``: a folder of the model's captures (``RUN_DIR/capture``, keyed by the model, its
    parameters and the micro-batch's shapes; one stage and several capture under different keys): copied
    into the run directory before the run and filled from every run's, so later runs skip torch.export
    (minutes on a 0.5-core host)."""
    from tools.emucluster.errors import HostCommandFailed
    if capture_cache is not None and capture_cache.is_dir():
        shutil.copytree(capture_cache, run_dir / CAPTURE_CACHE, dirs_exist_ok=True)
    t = time.monotonic()
    try:
        cluster.torchrun(["launch.py", "--plan", str(plan_file), "--steps", str(steps), "--run-dir", str(run_dir),
                          *([] if trace else ["--no-trace"]), "--no-progress", "--timeout", str(LAUNCH_TIMEOUT_S)],
                         timeout_s=timeout_s, port=port, cwd=REPO,
                         env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    except HostCommandFailed as e:
        return {"failed": refusal_lines(str(e)), "wall_s": time.monotonic() - t}
    summary = read_json(run_dir / "summary.json", "summary")
    summary["wall_s"] = time.monotonic() - t
    if capture_cache is not None and (run_dir / CAPTURE_CACHE).is_dir():     # keep every key (dp and pipelines differ)
        shutil.copytree(run_dir / CAPTURE_CACHE, capture_cache, dirs_exist_ok=True)
    return summary
