"""Every class of bad input of issue 22 ends with exit 2 and one line that says what is wrong (or,
for a valid one, runs): output paths, input files, the user's code, numbers, things that used to
be accepted, files' permissions. Each command's main() runs in this process; the multi-process
classes (resume, non-finite loss, ports, the failing rank) are in tests/runtime/test_hardening.py.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch

from hybridpipe.argtypes import check_output_dir, check_output_file
from hybridpipe.errors import UserError
from hybridpipe.jsonfile import file_mode, read_json, write_json
from hybridpipe.partitioner.plan import save_plan
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.checkpoint_files import MANIFEST, atomic_save, sha256_of, stage_file, step_dir
from tests.badinput import cluster_dict, run, save_files, write_checkpoint
from tests.pipeline.harness import make_plan

ROOT = Path(__file__).resolve().parents[1]
USER = "tests.profiles.user_models"
QUICK = ["--repeats", "1", "--warmup", "0", "-q"]
AS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("valid")
    profile = base / "profile.json"
    assert run(["profile", "mlp[layers=1,hidden=8]", "-b", "2", *QUICK, "-o", str(profile)]).code == 0
    plan = make_plan("mlp[layers=1,hidden=8]", [1], [1, 1], micro_batches=2, batch_size=2,
                     times=[(1.0, 2.0), (0.5, 1.0)])
    paths = save_files(base, profile, plan)
    paths["a_file"] = base / "a_file"
    paths["a_file"].write_text("not a directory")
    paths["loop"] = base / "loop.json"
    os.symlink(paths["loop"], paths["loop"])                     # a symlink to itself
    write_checkpoint(base / "ckpt", make_plan("mlp[layers=1,hidden=8]", [], [1], micro_batches=1, batch_size=2))
    paths["checkpoint"] = base / "ckpt"
    return paths


def _one_line(outcome, *expected: str) -> None:
    outcome.check_one_line_or_ok()
    assert outcome.code == 2, outcome
    for text in expected:
        assert text in outcome.err, (text, outcome.err)


# ---- output paths --------------------------------------------------------------------------------
OUTPUTS = [
    lambda f, o: ["profile", "mlp[layers=1]", *QUICK, "-o", o],
    lambda f, o: ["partition", str(f["profile"]), "--cluster", str(f["cluster"]), "-o", o],
    lambda f, o: ["simulate", str(f["plan"]), "--trace", o],
    lambda f, o: ["simulate", str(f["plan"]), "--png", o],
    lambda f, o: ["schedule", str(f["plan"]), "--png", o],
    lambda f, o: ["timeline", str(f["trace"].parents[1]), "-o", o],
    lambda f, o: ["timeline", str(f["trace"].parents[1]), "--png", o],
    lambda f, o: ["merge-checkpoint", str(f["checkpoint"]), "-o", o],
    lambda f, o: ["bench-allreduce", "-o", o],
]


@pytest.mark.parametrize("where", ["a directory", "under a file"])
@pytest.mark.parametrize("command", range(len(OUTPUTS)))
def test_an_output_path_that_cannot_be_written_is_one_line_before_any_work(files, where, command, tmp_path):
    target = str(tmp_path) if where == "a directory" else str(files["a_file"] / "out.json")
    argv = OUTPUTS[command](files, target)
    _one_line(run(argv), f"cannot write {target}",
              "it is a directory" if where == "a directory" else "is a file, not a directory")


@pytest.mark.parametrize("option", ["--run-dir", "--checkpoint-dir", "--trace-dir"])
def test_launch_output_directories_are_checked_before_the_job_starts(files, option, tmp_path):
    _one_line(run(["--plan", str(files["plan"]), option, str(files["a_file"])], launch=True),
              f"argument {option}: cannot write to {files['a_file']}: it is a file, not a directory")
    _one_line(run(["--plan", str(files["plan"]), option, str(files["a_file"] / "sub")], launch=True),
              "is a file, not a directory")


@pytest.mark.skipif(AS_ROOT, reason="root may write anywhere")
def test_a_directory_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(UserError, match="cannot write .*Permission denied"):
            check_output_file(locked / "x.json")
        with pytest.raises(UserError, match="no permission to create folders"):
            check_output_dir(locked / "new" / "deeper")
    finally:
        locked.chmod(0o700)


def test_output_checks_create_nothing(tmp_path):
    check_output_file(tmp_path / "a" / "b" / "out.json")
    check_output_dir(tmp_path / "run" / "x")
    assert list(tmp_path.iterdir()) == []


# ---- input files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    lambda f, p: ["show", p],
    lambda f, p: ["simulate", p],
    lambda f, p: ["schedule", p],
    lambda f, p: ["partition", p, "--cluster", str(f["cluster"])],
    lambda f, p: ["partition", str(f["profile"]), "--cluster", p],
    lambda f, p: ["partition", str(f["profile"]), "--cluster", str(f["cluster"]), "--calibration", p],
])
@pytest.mark.parametrize("defect, message", [
    ("symlink loop", "Too many levels of symbolic links"),
    ("nested 100000 deep", "nested too deeply"),
    ("nested 200 deep", "nested more than 64 levels deep"),
    ("a directory", "Is a directory"),
    ("not UTF-8", "is not text"),
    ("a huge integer", "is not valid JSON"),
])
def test_a_broken_input_file_is_one_line(files, tmp_path, argv, defect, message):
    path = tmp_path / "in.json"
    if defect == "symlink loop":
        path = files["loop"]
    elif defect.startswith("nested"):
        depth = int(defect.split()[1])
        path.write_text("[" * depth + "]" * depth)
    elif defect == "a directory":
        path = tmp_path
    elif defect == "not UTF-8":
        path.write_bytes(b'{"kind": "\xff\xfe"}')
    else:
        path.write_text('{"kind": ' + "9" * 5000 + "}")
    _one_line(run(argv(files, str(path))), message)


def test_launch_plan_symlink_loop_and_depth(files, tmp_path):
    _one_line(run(["--plan", str(files["loop"])], launch=True), "Too many levels of symbolic links")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    _one_line(run(["--plan", str(tmp_path / "deep.json")], launch=True), "nested too deeply")


def _manifest_copy(files, tmp_path) -> tuple[Path, dict]:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(files["checkpoint"], root)
    path = step_dir(root, 1) / MANIFEST
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(files=[]), 'field "files" must be an object'),
    (lambda m: m["files"][stage_file(0)].pop("bytes"), 'missing required field "bytes"'),
    (lambda m: m["files"][stage_file(0)].update(bytes="12"), 'field "bytes" must be an integer'),
    (lambda m: m.update(n_stages="one"), 'field "n_stages" must be an integer'),
    (lambda m: m["files"].update({"../../etc/passwd": {"bytes": 1, "sha256": "x"}}), "is not a plain name"),
])
def test_a_malformed_checkpoint_manifest_is_one_line(files, tmp_path, change, message):
    path, manifest = _manifest_copy(files, tmp_path)
    change(manifest)
    path.write_text(json.dumps(manifest))
    _one_line(run(["merge-checkpoint", str(step_dir(tmp_path / "ckpt", 1)), "--no-check", "-o",
                   str(tmp_path / "m.pt")]), message)


def _replace_shard(root: Path, step: int, name: str, payload: bytes) -> None:
    """Overwrite a checkpoint file and update its manifest to match (what an attacker would do)."""
    path = step_dir(root, step) / name
    path.write_bytes(payload)
    manifest = json.loads((step_dir(root, step) / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(payload), "sha256": sha256_of(path)}
    (step_dir(root, step) / MANIFEST).write_text(json.dumps(manifest))


class RunsACommand:
    """Unpickling this would run ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_shard_is_refused_by_merge_checkpoint_and_never_runs(files, tmp_path):
    path, _ = _manifest_copy(files, tmp_path)
    marker = tmp_path / "pwned"
    _replace_shard(tmp_path / "ckpt", 1, stage_file(0), pickle.dumps({"model": RunsACommand(marker)}))
    _one_line(run(["merge-checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.pt")]),
              "is not plain tensor data and was not loaded")
    assert not marker.exists()
    pickle.loads(pickle.dumps(RunsACommand(marker)))             # the payload is real: unpickling runs it
    assert marker.exists()


def test_a_shard_that_matches_its_hash_but_is_garbage_is_one_line(files, tmp_path):
    _manifest_copy(files, tmp_path)
    _replace_shard(tmp_path / "ckpt", 1, stage_file(0), b"\x80\x04garbage")
    _one_line(run(["merge-checkpoint", str(tmp_path / "ckpt"), "--no-check", "-o", str(tmp_path / "m.pt")]),
              "is not plain tensor data")


# ---- the user's code ------------------------------------------------------------------------------
def test_a_model_factory_that_raises_names_the_factory_the_error_and_the_line():
    with pytest.raises(UserError) as e:
        resolve_model(f"{USER}:raising")
    text = str(e.value)
    assert text.startswith(f"your factory `{USER}:raising` raised RuntimeError: cannot build a model of width 4 (at ")
    assert text.endswith(f"{os.sep}tests{os.sep}profiles{os.sep}user_models.py:{_line_of('raise RuntimeError')})")


def _line_of(snippet: str) -> int:
    lines = (ROOT / "tests" / "profiles" / "user_models.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line)


def test_a_module_with_a_syntax_error_and_one_that_raises_on_import(tmp_path, monkeypatch):
    (tmp_path / "broken_model.py").write_text("def build(:\n    pass\n")
    (tmp_path / "failing_model.py").write_text("import json\nx = json.loads('{')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line(run(["profile", "broken_model:build", *QUICK, "-o", str(tmp_path / "p.json")]),
              "your model module 'broken_model' raised SyntaxError", "broken_model.py:1)")
    _one_line(run(["profile", "failing_model:build", *QUICK, "-o", str(tmp_path / "p.json")]),
              "your model module 'failing_model' raised JSONDecodeError", "failing_model.py:2)")


def test_an_example_input_that_does_not_fit_the_model(tmp_path):
    _one_line(run(["profile", f"{USER}:misfit", *QUICK, "-o", str(tmp_path / "p.json")]),
              f"your model from `{USER}:misfit` (on its example input) raised RuntimeError")


def test_a_dataset_factory_that_raises():
    with pytest.raises(UserError, match=rf"your dataset factory `{USER}:raising_dataset` raised ValueError: "
                                        r"the data directory is empty \(at .*user_models.py:\d+\)"):
        resolve_dataset(f"{USER}:raising_dataset", resolve_model("mlp"), size=4)


# ---- numbers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["profile", "mlp[hidden=-5]"], "zoo model option hidden=-5 of 'mlp' must be a whole number >= 1"),
    (["profile", "mlp[hidden=abc]"], "zoo model option hidden='abc' of 'mlp' must be a whole number >= 1"),
    (["profile", "mlp[hiden=5]"], "zoo model 'mlp' has no option 'hiden'"),
    (["profile", "mlp[hidden=1000000]"], "(3,000,078,000,010 parameters) needs about 11176.2 GiB of memory"),
    (["profile", "mlp", "--batch-size", "1000000000"], "profiling mlp at batch 1000000000 on cpu"),
    (["profile", "mlp", "--batch-size", "1e9"], "--batch-size: expected a whole number, got '1e9'"),
    (["profile", "mlp", "--seed", "-1"], "--seed: must be between 0 and 9223372036854775807, got -1"),
    (["profile", "alexnet[image=8]"], "zoo model 'alexnet[image=8]'"),
    (["show", "{plan}", "--top", "-1"], "--top: must be >= 0, got -1"),
    (["simulate", "{plan}", "--steps", "1000000000"], "simulating 1000000000 steps"),
    (["simulate", "{plan}", "--micro-batches", "100000000"], "of 100000000 micro-batches"),
    (["simulate", "{plan}", "--steps", "0", "--png", "{tmp}/x.png"], "--steps: must be >= 1, got 0"),
    (["schedule", "{plan}", "--micro-batches", "100000000"], "listing 1 steps of 100000000 micro-batches"),
    (["partition", "{profile}", "--cluster", "{big}"], "partitioning 3 nodes over 10,000,000,000 workers needs about"),
    (["partition", "{profile}", "--cluster", "{cluster}", "--memory-gb", "nan"], "--memory-gb: must be a finite"),
    (["partition", "{profile}", "--cluster", "{cluster}", "--memory-gb", "1e308"], "--memory-gb: must be <= 1e+15"),
    (["timeline", "{run}", "--png-steps", "-2"], "--png-steps: must be >= 0"),
    # past int64 (the property test's draw): once an OverflowError deep in the partitioner's search
    (["partition", "{profile}", "--cluster", "{cluster}", "--micro-batches", "99999999999999999999"],
     "--micro-batches: must be at most 1e+15"),
    (["bench-allreduce", "-o", "{tmp}/c.json", "--level", ""], "--level: must be the name of a level"),
    (["bench-allreduce", "-o", "{tmp}/c.json", "--ranks", "1"], "--ranks: must be between 2 and 1024"),
    (["aggregator", "--port", "0", "--world", "2", "--sessions", "0"], "--sessions: must be >= 1, got 0"),
    (["aggregator", "--port", "0", "--world", "2", "--timeout", "-1"], "--timeout: must be greater than 0"),
    (["aggregator", "--port", "70000", "--world", "2"], "--port: must be between 0 and 65535"),
])
def test_numbers_out_of_range_are_one_line_before_any_work(files, tmp_path, argv, message):
    big = tmp_path / "big.json"
    big.write_text(json.dumps(cluster_dict(10_000_000_000)))
    names = {"plan": files["plan"], "profile": files["profile"], "cluster": files["cluster"], "big": big,
             "run": files["trace"].parents[1], "tmp": tmp_path}
    argv = [a.format(**names) for a in argv]
    if argv[0] == "profile":
        argv += [*QUICK, "-o", str(tmp_path / "p.json")]
    _one_line(run(argv), message)


def test_a_plan_without_stages_says_how_to_write_one(files, tmp_path):
    data = read_json(files["plan"], "plan")
    data["stages"] = []
    (tmp_path / "empty.json").write_text(json.dumps(data))
    _one_line(run(["simulate", str(tmp_path / "empty.json")]), '"stages" is empty',
              "write it with hybridpipe partition")


# ---- accepted and run before -----------------------------------------------------------------------
def test_a_garbage_calibration_file_is_refused_where_it_enters(files, tmp_path):
    garbage = tmp_path / "cal.json"
    garbage.write_text(json.dumps({"kind": "calibration", "format": 1, "world_size": 4}))
    _one_line(run(["partition", str(files["profile"]), "--cluster", str(files["cluster"]), "--calibration",
                   str(garbage)]), "missing required field")
    _one_line(run(["--plan", str(files["plan"]), "--calibration", str(garbage)], launch=True),
              "missing required field")


# ---- small ones ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["-v", "show", "{f}"], ["show", "-v", "{f}"], ["show", "{f}", "-v"]])
def test_verbose_goes_before_or_after_the_command(files, argv):
    outcome = run([a.format(f=files["plan"]) for a in argv])
    assert outcome.code == 0 and "plan for mlp" in outcome.out, outcome


def test_summaries_print_the_global_batch(files, tmp_path):
    assert "global batch 4 = 2 micro-batches x 2 samples" in run(["show", str(files["plan"])]).out
    assert "global batch 4" in run(["simulate", str(files["plan"])]).out
    out = run(["partition", str(files["profile"]), "--cluster", str(files["cluster"])]).out
    assert "global batch" in out


# ---- file permissions ----------------------------------------------------------------------------
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_files_get_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert file_mode() == mode
        paths = [write_json(tmp_path / "a.json", {"x": 1}), tmp_path / "b.pt"]
        atomic_save({"w": torch.zeros(2)}, paths[1])
        plan = save_plan(make_plan("mlp", [3], [1, 1]), tmp_path / "plan.json")
        paths.append(plan)
        ck = write_checkpoint(tmp_path / "ckpt", make_plan("mlp[layers=1,hidden=8]", [], [1], micro_batches=1,
                                                           batch_size=2))
        paths += list(ck.iterdir())
        assert run(["merge-checkpoint", str(tmp_path / "ckpt"), "--no-check", "-o", str(tmp_path / "m.pt")]).code == 0
        paths.append(tmp_path / "m.pt")
        for p in paths:
            assert stat.S_IMODE(p.stat().st_mode) == mode, p
    finally:
        os.umask(old)
    assert read_json(tmp_path / "a.json", "test") == {"x": 1}
