"""The `hybridpipe profile` and `hybridpipe show` commands end to end (in-process and as a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.cli import main
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, save_calibration
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.syncunits import LayerSync
from hybridpipe.partitioner.plan import Plan, Stage, save_plan
from hybridpipe.profiles.format import load_profile

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--repeats", "1", "--warmup", "0", "-q"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hybridpipe.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prof") / "mlp.json"
    assert main(["profile", "mlp[layers=2]", "--batch-size", "4", *QUICK, "-o", str(out)]) == 0
    return out


def test_profile_precision_measures_under_autocast(mlp_profile, tmp_path):
    """--precision bf16: recorded, and the activations between nodes are autocast's 16-bit ones."""
    assert main(["profile", "mlp[layers=2]", "--batch-size", "4", *QUICK, "--precision", "bf16",
                 "-o", str(tmp_path / "b.json")]) == 0
    fp32, bf16 = load_profile(mlp_profile), load_profile(tmp_path / "b.json")
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    assert bf16.nodes[1].activation_bytes == fp32.nodes[1].activation_bytes // 2      # a Linear's output


def test_profile_writes_a_loadable_profile_and_a_summary(mlp_profile, capsys, tmp_path):
    p = load_profile(mlp_profile)
    assert p.model == "mlp[layers=2]" and p.batch_size == 4 and [n.name for n in p.nodes] == list("01234")
    assert main(["profile", "mlp", *QUICK, "-o", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "profiled mlp: 9 nodes (blocks)" in out and "ratio" in out and str(tmp_path / "m.json") in out
    assert "one optimizer step over all parameters: sgd" in out


def test_granularity_chooses_what_a_node_is(tmp_path, capsys):
    spec = "gpt[layers=2,width=16,heads=2,seq=8,vocab=11]"
    names = {}
    for granularity in ("blocks", "modules", "1"):
        out = tmp_path / f"{granularity}.json"
        assert main(["profile", spec, "-b", "2", "--granularity", granularity, *QUICK, "-o", str(out)]) == 0
        p = load_profile(out)
        assert p.granularity == granularity
        names[granularity] = [n.name for n in p.nodes]
    assert names["blocks"] == ["embed", "drop", "blocks.0", "blocks.1", "ln", "head"]
    assert names["1"] == ["embed", "drop", "blocks", "ln", "head"]
    assert names["modules"][:4] == ["embed", "drop", "blocks.0.ln1", "blocks.0.attn.qkv"]
    assert len(names["modules"]) == 20
    assert main(["profile", spec, "--granularity", "layers", *QUICK, "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown --granularity 'layers'" in err and len(err.splitlines()) == 1


def test_show_profile_prints_every_node_and_the_totals(mlp_profile, capsys):
    assert main(["show", str(mlp_profile)]) == 0
    out = capsys.readouterr().out
    p = load_profile(mlp_profile)
    for n in p.nodes:
        assert f" {n.name} " in out
    assert "fwd ms" in out and "bwd ms" in out and "node sum / measured" in out
    assert f"parameters {p.totals.param_count:,}" in out


def test_show_profile_sorted_and_cut(mlp_profile, capsys):
    assert main(["show", str(mlp_profile), "--sort", "params", "--top", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "Linear" in line]
    assert len(rows) == 2 and "shown 2 of 5 nodes (sorted by params)" in out
    assert "8,320" in rows[0] or "16,512" in rows[0]      # the biggest Linear comes first


def _cluster() -> Cluster:
    return Cluster((Level("node", 1, 1000.0), Level("network", 4, 1.0, 50.0)), 16.0)


def test_show_plan_has_the_stage_table(tmp_path, capsys):
    plan = Plan(model="mlp", batch_size=4, input_shape=(4, 64), profile_signature="abc", cluster=_cluster(),
                strategy="optimal", schedule="1f1b", micro_batches=4, optimizer="sgd",
                stages=(Stage(0, 0, 4, 2, (0, 1), compute_ms=1.5, sync_ms=0.25, send_ms=0.125, memory_bytes=3 << 20,
                              layers=(LayerSync("l0", ("0.weight",), 4096, "butterfly", 0.2, 0.1),)),
                        Stage(1, 5, 10, 1, (2,), compute_ms=1.25)),
                predicted_step_ms=9.5, predicted_samples_per_s=1684.2)
    path = save_plan(plan, tmp_path / "plan.json")
    assert main(["show", str(path), "--layers"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("stage  nodes"))
    assert header.split() == ["stage", "nodes", "replicas", "ranks", "compute", "ms", "sync", "ms", "send", "ms",
                              "memory"]
    assert any(line.split()[:8] == ["0", "0-4", "2", "0,1", "1.50", "0.25", "0.12", "3.0"] for line in out.splitlines())
    assert "butterfly" in out and "1f1b" in out and "network x4 @ 1 Gbit/s" in out


def test_show_calibration_and_cluster(tmp_path, capsys):
    cal = Calibration(world_size=4, hosts=4, backend="gloo", device="cpu", level="network", gamma_s_per_byte=1e-10,
                      p2p=LinkFit(5e-5, 8e-9), algorithms={"ring": LinkFit(1e-4, 8.4e-9, 0.05)})
    assert main(["show", str(save_calibration(cal, tmp_path / "cal.json"))]) == 0
    out = capsys.readouterr().out
    assert "4 ranks on 4 hosts" in out and "ring" in out and "0.952" in out and "5.0%" in out
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"levels": [{"name": "node", "workers": 2, "bandwidth_gbps": 100}], "memory_gb": 8}))
    assert main(["show", str(cluster)]) == 0
    assert "cluster: 2 workers" in capsys.readouterr().out


def test_show_refuses_an_unknown_kind(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"kind": "recipe"}')
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a file hybridpipe can show" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text, says", [('{"format": 1}', 'its "kind" is null'), ('{"kind": 7}', 'its "kind" is 7'),
                                        ("[1, 2]", "holds a list, not a JSON object")])
def test_show_names_what_it_read_as_json(tmp_path, capsys, text, says):
    """The refusal quotes the file's "kind" as JSON (null, not Python's None) and names a non-object file."""
    path = tmp_path / "x.json"
    path.write_text(text)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_malformed_profile_exits_2_with_one_line_and_no_traceback(mlp_profile, tmp_path, capsys):
    """(In this process: the real command's exit code and stderr are test_a_model_export_cannot_capture's.)"""
    data = json.loads(mlp_profile.read_text())
    data["edges"][0] = [2, 1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "goes backward" in err and str(bad) in err


@pytest.mark.parametrize("args, message", [
    (["profile", "nosuchmodel"], "unknown model"),
    (["profile", "tests.profiles.user_models:gated"], "`if x.sum() > 0:` (in Gate.forward)"),
    (["profile", "tests.profiles.user_models:gated"], "--leaf Gate"),
    (["profile", "tests.profiles.user_models:slow_backward"], "custom torch.autograd.Function _Sleep"),
    (["profile", "mlp", "--leaf", "Gate"], "'Gate' is not a module class of MLP"),
    (["profile", "mlp", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["show", "/nonexistent/p.json"], "does not exist"),
])
def test_user_errors_exit_2_with_one_line(args, message, capsys, tmp_path):
    assert main([*args, *([] if args[0] == "show" else [*QUICK, "-o", str(tmp_path / "p.json")])]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_model_export_cannot_capture_is_one_line_from_the_real_command(tmp_path):
    """torch.export prints the partial graph of a failed capture and logs warnings; none of it
    reaches the user, who gets the one line that names the construct, its line and the fix."""
    result = run_cli("profile", "tests.profiles.user_models:gated", *QUICK, "-o", str(tmp_path / "p.json"))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("hybridpipe profile: error: torch.export cannot capture Gated at user_models.py:")
    assert "`if x.sum() > 0:` (in Gate.forward)" in lines[0] and "--leaf Gate" in lines[0]


def test_user_factory_model_with_leaf_option(tmp_path, capsys):
    out = tmp_path / "gated.json"
    assert main(["profile", "tests.profiles.user_models:gated[width=6]", "--leaf", "Gate", *QUICK,
                 "-o", str(out)]) == 0
    p = load_profile(out)
    assert p.model == "tests.profiles.user_models:gated[width=6,leaf=Gate]"
    assert [(n.name, n.type) for n in p.nodes] == [("inp", "Linear"), ("gate", "Gate"), ("head", "Linear")]
    assert p.input_shape == (32, 6) and p.front_end == "export"    # the leaf runs as written inside the graph


def test_leaf_keeps_a_module_whole(tmp_path):
    out = tmp_path / "gpt.json"
    assert main(["profile", "gpt[layers=2,width=16,heads=2,seq=8,vocab=11]", "-b", "2", "--granularity", "modules",
                 "--leaf", "Block", *QUICK, "-o", str(out)]) == 0
    p = load_profile(out)
    assert [n.name for n in p.nodes] == ["embed", "drop", "blocks.0", "blocks.1", "ln", "head"]
    assert p.model.endswith("[layers=2,width=16,heads=2,seq=8,vocab=11,leaf=Block]") and p.granularity == "modules"


def test_default_output_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "mlp[layers=1]", "-b", "2", *QUICK]) == 0
    assert load_profile(tmp_path / "mlp_layers_1.json").batch_size == 2


@pytest.mark.slow
def test_alexnet_profile_command_of_the_issue(tmp_path):
    out = tmp_path / "alexnet.json"
    result = run_cli("profile", "alexnet", "--batch-size", "8", "-o", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    p = load_profile(out)
    layers = {n.name: n.param_count for n in p.nodes if n.type in ("Conv2d", "Linear")}
    assert layers == {"conv1": 34_944, "conv2": 614_656, "conv3": 885_120, "conv4": 1_327_488, "conv5": 884_992,
                      "fc1": 37_752_832, "fc2": 16_781_312, "fc3": 4_097_000}
    assert p.totals.measured_ms > 0 and p.totals.ratio > 0
